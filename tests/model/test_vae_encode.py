"""The streaming VAE encoder (``rtvideo.workers.pipelines.vae_encode``) on the tiny preset's VAE: fp32, CPU."""

from __future__ import annotations

import copy

import pytest
import torch

from rtvideo.workers.pipelines.base import Abandoned, abandon_when
from rtvideo.workers.pipelines.presets import build_tiny
from rtvideo.workers.pipelines.vae_encode import StreamingEncoder
from rtvideo.workers.pipelines.vae_stream import StreamingDecoder

LATENT_FRAMES = 3  # the causal pipeline's latent_frames_per_chunk


@pytest.fixture(scope="module")
def vaes():
    """The tiny preset's VAE as the pipeline runs it (its CPU kernels swapped in by
    the streaming decoder), and an untouched copy: diffusers' own modules."""
    vae = build_tiny(0).vae.eval()
    reference = copy.deepcopy(vae)
    StreamingDecoder(vae)
    return vae, reference


def camera(frames: int, size: int = 64, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (frames, size, size, 3), generator=generator, dtype=torch.uint8)


def as_pixels(frames: torch.Tensor) -> torch.Tensor:
    return frames.permute(3, 0, 1, 2).unsqueeze(0).float() / 127.5 - 1.0


def test_chunk_sizes_are_the_decoders(vaes):
    encoder = StreamingEncoder(vaes[0])
    decoder = StreamingDecoder(vaes[0])
    for first in (True, False):
        assert encoder.frames_for(LATENT_FRAMES, first) == decoder.frames_for(LATENT_FRAMES, first)
    assert encoder.frames_for(LATENT_FRAMES, True) == 9 and encoder.frames_for(LATENT_FRAMES, False) == 12


def test_streamed_chunks_equal_diffusers_one_shot_encode(vaes):
    vae, reference = vaes
    encoder = StreamingEncoder(vae)
    frames = camera(9 + 12 * 3)
    cache = encoder.new_cache()
    chunks = [encoder.encode_uint8(frames[:9], cache, first=True)]
    for k in range(3):
        chunks.append(encoder.encode_uint8(frames[9 + 12 * k : 21 + 12 * k], cache, first=False))
    assert [c.shape[2] for c in chunks] == [LATENT_FRAMES] * 4
    streamed = torch.cat(chunks, dim=2)
    one_shot = StreamingEncoder(reference).reference_encode(as_pixels(frames))
    assert streamed.shape == one_shot.shape == (1, 16, 12, 8, 8)
    assert (streamed - one_shot).abs().max().item() <= 1e-5
    assert one_shot.abs().max().item() > 0.1  # a real signal, not zeros on both sides


def test_chunk_by_chunk_equals_one_pass(vaes):
    encoder = StreamingEncoder(vaes[0])
    frames = camera(9 + 12 * 2, seed=1)
    cache = encoder.new_cache()
    chunks = [encoder.encode_uint8(frames[:9], cache, True)]
    chunks += [encoder.encode_uint8(frames[9 + 12 * k : 21 + 12 * k], cache, False) for k in range(2)]
    whole = encoder.encode_uint8(frames, encoder.new_cache(), True)
    assert torch.equal(torch.cat(chunks, dim=2), whole)
    # The cache carries the stream: a later chunk cannot go without it, nor a first chunk with one.
    with pytest.raises(ValueError, match="a chunk after the first needs the encoder cache"):
        encoder.encode_uint8(frames[21:], encoder.new_cache(), False)
    with pytest.raises(ValueError, match="first chunk needs a fresh encoder cache"):
        encoder.encode_uint8(frames[:9], cache, True)


@pytest.mark.parametrize(
    ("frames", "first", "match"),
    [
        (8, True, "first chunk takes 1 \\+ 4k frames.*got 8"),
        (0, True, "got 0"),
        (11, False, "after the first takes 4k .*got 11"),
        (0, False, "after the first takes 4k .*got 0"),
    ],
)
def test_a_wrong_frame_count_is_refused_naming_it(vaes, frames, first, match):
    encoder = StreamingEncoder(vaes[0])
    cache = encoder.new_cache()
    if not first:
        encoder.encode_uint8(camera(9), cache, True)
    with pytest.raises(ValueError, match=match):
        encoder.encode_uint8(camera(frames), cache, first)


def test_a_wrong_frame_layout_or_size_is_refused_naming_it(vaes):
    encoder = StreamingEncoder(vaes[0])
    with pytest.raises(ValueError, match="frame size 60x60 is not a multiple of the VAE's 8"):
        encoder.encode_uint8(camera(9, size=60), encoder.new_cache(), True)
    with pytest.raises(ValueError, match="frames must be uint8 \\[frames, height, width, 3\\]"):
        encoder.encode_uint8(camera(9).float(), encoder.new_cache(), True)
    with pytest.raises(ValueError, match="frames must be uint8"):
        encoder.encode_uint8(camera(9)[..., :2], encoder.new_cache(), True)


def test_an_abandoned_encode_leaves_the_cache_as_it_was(vaes):
    encoder = StreamingEncoder(vaes[0])
    frames = camera(21, seed=2)
    cache = encoder.new_cache()
    encoder.encode_uint8(frames[:9], cache, True)
    before = list(cache)
    calls = []
    with pytest.raises(Abandoned), abandon_when(lambda: calls.append(1) or len(calls) > 2):
        encoder.encode_uint8(frames[9:], cache, False)  # stops before its third call of the encoder
    assert all(a is b for a, b in zip(before, cache, strict=True))
    again = encoder.encode_uint8(frames[9:], cache, False)
    expected = encoder.encode_uint8(frames, encoder.new_cache(), True)[:, :, LATENT_FRAMES:]
    assert torch.equal(again, expected)


def test_cache_bytes_is_what_a_stream_holds(vaes):
    encoder = StreamingEncoder(vaes[0])
    for side in (64, 96):
        cache = encoder.new_cache()
        frames = camera(21, size=side)
        encoder.encode_uint8(frames[:9], cache, True)
        encoder.encode_uint8(frames[9:], cache, False)
        held = sum(t.numel() * t.element_size() for t in cache if isinstance(t, torch.Tensor))
        assert held == encoder.cache_bytes(side // 8, side // 8) > 0
