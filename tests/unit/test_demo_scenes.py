"""The demo model's synthetic scenes, its latent codec and the clip classifier (fast)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rtvideo.training.demo import scenes
from rtvideo.training.demo.classify import classify
from rtvideo.training.demo.train import TINY, fit_codec
from rtvideo.workers.demo.codec import LinearVideoCodec

SIZE = 64


def chunks_of(clip: scenes.Clip, frames: np.ndarray) -> list[np.ndarray]:
    bounds = np.cumsum([0, *clip.frames_per_chunk()])
    return [frames[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def test_the_same_seed_and_index_give_the_same_clip_and_frames():
    a = scenes.clip_for(3, 17, SIZE, SIZE, 4)
    b = scenes.clip_for(3, 17, SIZE, SIZE, 4)
    assert a == b
    assert np.array_equal(scenes.render(a, SIZE, SIZE), scenes.render(b, SIZE, SIZE))
    others = {scenes.clip_for(3, i, SIZE, SIZE, 4) for i in range(20)}
    assert len(others) > 15
    assert scenes.clip_for(3, 17, SIZE, SIZE, 4, stream=scenes.EVALUATION) != a


def test_chunks_have_the_pipelines_frame_counts_and_a_stream_starts_at_the_centre():
    assert [scenes.chunk_frames(c) for c in range(3)] == [9, 12, 12]
    rng = np.random.default_rng(0)
    clips = [scenes.draw_clip(rng, SIZE, SIZE, 4) for _ in range(200)]
    for clip in clips:
        frames = scenes.render(clip, SIZE, SIZE)
        assert frames.shape == (sum(clip.frames_per_chunk()), SIZE, SIZE, 3)
        if clip.first_chunk == 0:
            assert len(frames) == 9 + 3 * 12
            assert tuple(clip.positions(SIZE, SIZE)[0]) == scenes.canonical_start(SIZE, SIZE)
    switching = [c for c in clips if len(set(c.attributes)) > 1]
    assert 0.2 < len(switching) / len(clips) < 0.5
    for clip in switching:  # a switch happens at a chunk boundary, and only once
        changes = [i for i in range(1, clip.chunks) if clip.attributes[i] != clip.attributes[i - 1]]
        assert len(changes) == 1


def test_captions_name_the_attributes_and_parse_back():
    for attributes in scenes.ALL_ATTRIBUTES:
        assert scenes.parse_caption(attributes.caption) == attributes
    assert scenes.parse_caption("a paper boat") is None
    assert max(len(c.encode()) for c in scenes.CAPTIONS) + 1 <= TINY.text_length  # bytes + EOS


def test_the_classifier_reads_ground_truth_chunks():
    """Every attribute combination, across the edges (wrapping), from stream starts and later chunks."""
    right = total = 0
    for index in range(150):
        clip = scenes.clip_for(11, index, SIZE, SIZE, 4, stream=scenes.EVALUATION)
        for attributes, frames in zip(clip.attributes, chunks_of(clip, scenes.render(clip, SIZE, SIZE)), strict=True):
            reading = classify(frames)
            right += reading.attributes == attributes
            total += 1
            assert reading.presence == 1.0
    assert right / total >= 0.99, f"{right}/{total}"


def test_the_classifier_sees_no_object_in_an_empty_frame():
    frames = np.broadcast_to(np.asarray(scenes.BACKGROUND, dtype=np.uint8), (9, SIZE, SIZE, 3)).copy()
    assert classify(frames).attributes is None and classify(frames).presence == 0.0


@pytest.fixture(scope="module")
def codec() -> LinearVideoCodec:
    return fit_codec(TINY.__class__(size=SIZE, chunks=4, codec_fit_clips=16))  # fitted to the clips it is checked on


def test_the_codec_round_trip_keeps_what_the_classifier_reads(codec):
    errors = []
    for index in range(12):
        clip = scenes.clip_for(5, index, SIZE, SIZE, 4, stream=scenes.EVALUATION, switch_probability=0.0)
        frames = scenes.render(clip, SIZE, SIZE)
        pixels = torch.from_numpy(frames).float().permute(3, 0, 1, 2)[None] / 127.5 - 1.0
        latents = codec.encode_frames(pixels, first=clip.first_chunk == 0)
        assert latents.shape == (1, 16, 12, SIZE // 8, SIZE // 8)
        decoded = codec.decode_latents(latents, first=clip.first_chunk == 0)
        back = ((decoded[0].permute(1, 2, 3, 0) + 1.0) * 127.5).round().clamp(0, 255).to(torch.uint8).numpy()
        assert back.shape == frames.shape
        errors.append(np.abs(back.astype(int) - frames.astype(int)).mean())
        for attributes, chunk in zip(clip.attributes, chunks_of(clip, back), strict=True):
            assert classify(chunk).attributes == attributes
    assert np.mean(errors) < 6.0  # grey levels


def test_codec_latents_are_whitened(codec):
    clips = [scenes.clip_for(0, i, SIZE, SIZE, 4, stream=scenes.CODEC_FIT) for i in range(16)]
    latents = []
    for clip in clips:
        pixels = torch.from_numpy(scenes.render(clip, SIZE, SIZE)).float().permute(3, 0, 1, 2)[None] / 127.5 - 1
        latents.append(codec.encode_frames(pixels, first=clip.first_chunk == 0))
    std = torch.cat(latents).transpose(0, 1).flatten(1).std(dim=1)
    assert torch.allclose(std, torch.ones_like(std), atol=0.05)


def test_a_streamed_decode_equals_a_one_shot_decode_and_saves_and_loads(codec, tmp_path):
    """The pipeline's streaming decoder (latent frame by latent frame, chunk by chunk) on the
    codec equals its one-shot decode; the codec round-trips through save/from_pretrained."""
    from rtvideo.workers.pipelines.vae_stream import StreamingDecoder

    codec.save_pretrained(tmp_path / "vae")
    loaded = LinearVideoCodec.from_pretrained(tmp_path / "vae")
    decoder = StreamingDecoder(loaded)
    latents = torch.randn(1, 16, 6, 4, 4, generator=torch.Generator().manual_seed(0))
    cache = decoder.new_cache()
    parts = [decoder.decode(latents[:, :, i : i + 3], cache, first=i == 0) for i in (0, 3)]
    assert [p.shape[2] for p in parts] == [9, 12]
    assert decoder.cache_bytes(8, 8) == 0
    whole = codec.decode_latents(latents, first=True)
    assert torch.allclose(torch.cat(parts, dim=2), whole, atol=1e-5)
