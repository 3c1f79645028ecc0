"""The tiny streaming decoder (``rtvideo.workers.pipelines.tiny_decoder``), in process, in
fp32 on the CPU, with random weights written as a ``taew2_1`` weights file is:

- streamed chunk by chunk it makes the frames the design's own one-shot decode
  makes of the same latents: ``data/tiny_decoder_golden.safetensors`` holds
  frames computed by madebyollin/taehv's ``decode_video`` (parallel, commit
  115aaa7) on the weights ``random_tiny_decoder(seed=7)`` draws, and the
  latents beside them;
- a chunk-by-chunk decode equals one pass over all the chunks, and a batch of
  two streams equals each alone;
- a weights file that is missing, unreadable, incomplete or another model's is
  refused naming the file and what is wrong;
- in the causal Wan pipeline each session decodes with the decoder it chose,
  the same frames on every decode path (in place, on another rank, split,
  batched beside a session of the other decoder).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from rtvideo.engine.messages import StartSession
from rtvideo.engine.plan import BoundaryTask, MicroStep, StepRow
from rtvideo.workers.chunk_driver import ChunkDriver
from rtvideo.workers.pipelines.tiny_decoder import (
    TinyDecoderWeightsError,
    load_tiny_decoder,
    random_tiny_decoder,
    read_decoder_weights,
)

GOLDEN = Path(__file__).parent / "data" / "tiny_decoder_golden.safetensors"
CPU = torch.device("cpu")


def published_layout(seed: int = 7) -> dict[str, torch.Tensor]:
    """``random_tiny_decoder(seed)``'s weights keyed as a published file keys them
    (its encoder's tensors beside them, which the decoder ignores)."""
    network = random_tiny_decoder(CPU, torch.float32, seed=seed).network
    tensors = {"decoder." + key.removeprefix("layers."): t.clone() for key, t in network.state_dict().items()}
    tensors["encoder.0.weight"] = torch.zeros(64, 3, 3, 3)
    return tensors


@pytest.fixture
def weights_file(tmp_path) -> Path:
    path = tmp_path / "taew2_1.safetensors"
    save_file(published_layout(), str(path))
    return path


def stream(decoder, latents: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """``latents`` ``[1, frames, 16, h, w]`` decoded in chunks of ``sizes`` latent
    frames, one state throughout: ``[1, frames, 3, H, W]`` in [0, 1]."""
    cache, out, at = decoder.new_cache(), [], 0
    for size in sizes:
        chunk = latents[:, at : at + size].transpose(1, 2)  # as the pipeline holds latents: [1, 16, frames, h, w]
        out.append(decoder.decode(chunk, cache, first=at == 0))
        at += size
    return (torch.cat(out, dim=2).transpose(1, 2) + 1.0) / 2.0


def test_streamed_chunk_by_chunk_it_makes_the_designs_one_shot_frames(weights_file):
    golden = load_file(str(GOLDEN))
    decoder = load_tiny_decoder(weights_file, CPU, torch.float32)
    frames = stream(decoder, golden["latents"], [3, 3, 1])
    assert frames.shape == golden["frames"].shape == (1, 25, 3, 16, 24)
    assert (frames - golden["frames"]).abs().max().item() <= 1e-5
    assert decoder.frames_for(3, first=True) == 9 and decoder.frames_for(3, first=False) == 12


def test_a_chunk_by_chunk_decode_equals_one_pass_and_a_batch_each_stream_alone(weights_file):
    decoder = load_tiny_decoder(weights_file, CPU, torch.float32)
    generator = torch.Generator().manual_seed(3)
    a, b = (torch.randn(1, 9, 16, 3, 2, generator=generator) for _ in range(2))
    whole = stream(decoder, a, [9])
    assert (stream(decoder, a, [3, 3, 3]) - whole).abs().max().item() <= 1e-5
    assert (stream(decoder, a, [1, 4, 2, 2]) - whole).abs().max().item() <= 1e-5

    caches = [decoder.new_cache(), decoder.new_cache()]
    together = []
    for at, first in ((0, True), (3, False), (6, False)):
        chunks = [x[:, at : at + 3].transpose(1, 2) for x in (a, b)]
        together.append(decoder.decode_rows(chunks, caches, first=first))
    for row, x in enumerate((a, b)):
        batched = (torch.cat([pixels[row] for pixels in together], dim=2).transpose(1, 2) + 1.0) / 2.0
        assert (batched - stream(decoder, x, [3, 3, 3])).abs().max().item() <= 1e-5
    assert decoder.cache_shape(caches[0]) == decoder.cache_shape(caches[1])
    assert decoder.cache_bytes(3, 2) == sum(slot.numel() * 4 for slot in caches[0])


def test_a_torch_file_and_time_up_sampling_trained_for_more_frames_load_too(tmp_path, weights_file):
    tensors = published_layout()
    made = tensors["decoder.7.conv.weight"]
    tensors["decoder.7.conv.weight"] = torch.cat([torch.full_like(made, 9.0), made])  # 2 frames' channels
    path = tmp_path / "taew2_1.pth"
    torch.save(tensors, str(path))
    loaded = read_decoder_weights(path)
    assert torch.equal(loaded["layers.7.conv.weight"], made)  # the last frame's channels
    assert torch.equal(loaded["layers.1.weight"], read_decoder_weights(weights_file)["layers.1.weight"])


def test_a_weights_file_that_is_not_one_is_refused_naming_it_and_why(tmp_path):
    missing = tmp_path / "nowhere.safetensors"
    with pytest.raises(TinyDecoderWeightsError, match=rf"'{missing}': no such file"):
        read_decoder_weights(missing)

    garbage = tmp_path / "garbage.safetensors"
    garbage.write_text("not weights")
    with pytest.raises(TinyDecoderWeightsError, match=rf"'{garbage}' could not be read .*taew2_1 file as published"):
        read_decoder_weights(garbage)

    partial = tmp_path / "partial.safetensors"
    tensors = published_layout()
    del tensors["decoder.22.weight"]
    save_file(tensors, str(partial))
    with pytest.raises(
        TinyDecoderWeightsError, match=r"lack 1 of the decoder's \d+ tensors \(first: decoder.22.weight\)"
    ):
        read_decoder_weights(partial)

    other = tmp_path / "taew2_2.safetensors"  # Wan 2.2's: 48 latent channels
    tensors = published_layout()
    tensors["decoder.1.weight"] = torch.zeros(256, 48, 3, 3)
    save_file(tensors, str(other))
    with pytest.raises(TinyDecoderWeightsError, match=r"decoder.1.weight has shape \(256, 48, 3, 3\), the Wan 2.1"):
        read_decoder_weights(other)


# -- in the causal Wan pipeline ---------------------------------------------------


@pytest.fixture(scope="module")
def both():
    """The tiny preset with both decoders: its own VAE's, and a tiny one of random weights."""
    from rtvideo.workers.pipelines.causal_wan import build

    return build("tiny", device="cpu", tiny_decoder="random")


def denoised(pipeline, starts: list, chunks: int) -> tuple[ChunkDriver, list[list]]:
    """Open ``starts`` and run ``chunks`` chunks of each, committed and left to
    decode (as the decode stage finds them); each chunk's clean latent, per session."""
    driver = ChunkDriver(pipeline)
    driver.runner.sessions.defer_decode = True
    driver.open(*starts)
    sids = [start.session_id for start in starts]
    cleans: list[list] = [[] for _ in sids]
    for chunk in range(chunks):
        steps = driver.runner.states[sids[0]].geometry.num_inference_steps
        for step in range(steps):
            rows = [StepRow(sid, chunk, step, steps) for sid in sids]
            boundaries = [BoundaryTask(sid, chunk, None, 0) for sid in sids] if step == 0 else []
            driver.execute(MicroStep(number=0, boundaries=boundaries, ranks=[rows]))
        for row, sid in enumerate(sids):
            cleans[row].append(driver.runner.states[sid].chunks[chunk].clean.clone())
    return driver, cleans


def test_a_session_chooses_its_decoder_and_every_decode_path_gives_the_same_frames(both):
    start = dict(prompt="a red fox", seed=5, width=32, height=32, num_inference_steps=2)
    starts = [StartSession(session_id=sid, decoder="tiny", **start) for sid in ("alone", "spread", "split", "batched")]
    starts.append(StartSession(session_id="full", **start))  # the default: the model's own decoder
    driver, cleans = denoised(both, starts, chunks=3)
    states = driver.runner.states
    tiny = both.decoders["tiny"]
    assert states["alone"].geometry.first_chunk_frames == 9 and states["alone"].geometry.frames_per_chunk == 12
    difference = tiny.cache_bytes(4, 4) - both.decoder.cache_bytes(4, 4)  # each decoder's state at 32x32
    assert states["alone"].geometry.state_bytes - states["full"].geometry.state_bytes == difference

    expected_cache, made = tiny.new_cache(), []
    for index, clean in enumerate(cleans[0]):
        made.append(tiny.decode(clean.float(), expected_cache, first=index == 0))
    for index in range(3):
        alone = both.decode(states["alone"], index)
        spread = both.decode_latent(states["spread"], both.decode_input(states["spread"], index))
        parts = list(both.decode_front(states["split"], both.decode_input(states["split"], index), split=4))
        split = both.frames_of([both.decode_back(states["split"], header, pixels, 4) for header, pixels in parts])
        batched, full = both.decode_batch([states["batched"], states["full"]], [index, index])
        assert alone.num_frames == (9 if index == 0 else 12) and (alone.width, alone.height) == (32, 32)
        assert alone.payload == spread.payload == split.payload == batched.payload
        pixels = ((made[index][0].permute(1, 2, 3, 0) + 1.0) * 127.5).round().clamp(0, 255).to(torch.uint8)
        assert alone.payload == pixels.numpy().tobytes()  # the tiny decoder's frames of the chunk's latent
        assert full.payload != alone.payload and full.num_frames == alone.num_frames


def test_a_decoder_the_model_has_not_loaded_is_refused_naming_it():
    from rtvideo.workers.pipelines.causal_wan import build

    pipeline = build("tiny", device="cpu", warm_up_chunks=0)
    with pytest.raises(ValueError, match=r"decoder: the 'tiny' model has no tiny decoder loaded \(it has: full\)"):
        pipeline.describe(StartSession(session_id="s", prompt="p", decoder="tiny"))
    with pytest.raises(ValueError, match="decoder tiny: no tiny decoder weights were found"):
        build("tiny", device="cpu", decoder="tiny")
    with pytest.raises(TinyDecoderWeightsError, match="no such file"):
        build("tiny", device="cpu", tiny_decoder="/nowhere/taew2_1.safetensors")
