"""Video to video on the causal Wan pipeline, tiny preset, in process (fp32, CPU):
a session opened with an input takes each chunk's frames (``take_input``),
encodes them with its streaming VAE encoder and starts the chunk at the step of
the few-step schedule its strength maps to."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rtvideo.engine.messages import StartSession, VideoInput
from rtvideo.workers.chunk_driver import ChunkDriver
from rtvideo.workers.pipelines.base import ChunkOrderError
from rtvideo.workers.pipelines.causal_wan import CausalWanPipeline, build, self_forcing_timesteps
from rtvideo.workers.pipelines.causal_wan_state import CausalWanSession
from rtvideo.workers.pipelines.video_input import input_start_step


@pytest.fixture(scope="module")
def pipeline() -> CausalWanPipeline:
    return build("tiny", device="cpu")


@pytest.fixture
def driver(pipeline):
    return ChunkDriver(pipeline)


def camera(frames: int, seed: int = 0, size: int = 64) -> np.ndarray:
    """A moving gradient with a little noise: uint8 [frames, size, size, 3]."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:size, 0:size]
    out = []
    for f in range(frames):
        base = np.stack([(x + 2 * f) % size, (y + f) % size, (x + y) % size], axis=-1) * (255 / size)
        out.append(np.clip(base + rng.normal(0, 8, base.shape), 0, 255))
    return np.asarray(out, dtype=np.uint8)


def chunk_frames(stream: np.ndarray, index: int) -> np.ndarray:
    return stream[:9] if index == 0 else stream[9 + 12 * (index - 1) : 21 + 12 * (index - 1)]


def video_start(sid: str, strength: float, **start) -> StartSession:
    given = VideoInput(strength=strength, format="raw", width=64, height=64, fps=16.0)
    return StartSession(session_id=sid, **{"prompt": "a watercolour fox", "seed": 7, "input": given, **start})


def run(driver: ChunkDriver, state: CausalWanSession, stream: np.ndarray, chunks: int) -> list[bytes]:
    """``chunks`` chunks of a session with an input, through the worker's path:
    each chunk's frames taken, then its boundary, steps, commit and decode."""
    frames = []
    for _ in range(chunks):
        index = driver.next_chunk[state.session_id]
        driver.pipeline.take_input(state, index, chunk_frames(stream, index))
        frames.append(driver.run_chunk(state.session_id).payload)
    return frames


def test_strength_maps_to_the_nearest_level_of_the_schedule():
    four = self_forcing_timesteps(4)  # levels 1, 0.9375, 0.8333, 0.625, then clean
    expected = {1.0: 0, 0.97: 0, 0.95: 1, 0.9: 1, 0.88: 2, 0.8: 2, 0.72: 3, 0.5: 3, 0.3125: 3, 0.3: 4, 0.0: 4}
    assert {s: input_start_step(s, four) for s in expected} == expected
    two = self_forcing_timesteps(2)  # levels 1, 0.8333, then clean
    assert [input_start_step(s, two) for s in (1.0, 0.95, 0.9, 0.5, 0.4, 0.0)] == [0, 0, 1, 1, 2, 2]
    with pytest.raises(ValueError, match="input.strength"):
        input_start_step(1.5, four)


def test_a_size_or_rate_taken_from_the_input_is_refused_naming_the_inputs_field(pipeline):
    odd = VideoInput(strength=0.5, format="raw", width=24, height=64, fps=16.0)
    with pytest.raises(ValueError, match=r"^input.width must be a multiple of 16 up to"):
        pipeline.describe(StartSession(session_id="w", prompt="p", input=odd))
    slow = VideoInput(strength=0.5, format="raw", width=64, height=64, fps=0.5)
    with pytest.raises(ValueError, match=r"^input.fps must be between 1 and 60, got 0.5"):
        pipeline.describe(StartSession(session_id="f", prompt="p", input=slow))
    with pytest.raises(ValueError, match=r"^width must be a multiple of 16"):  # the request's own
        pipeline.describe(StartSession(session_id="r", prompt="p", width=24))


@pytest.mark.parametrize(("strength", "steps"), [(1.0, 4), (0.9, 3), (0.8, 2), (0.5, 1), (0.0, 0)])
def test_the_geometry_says_the_steps_each_chunk_runs(pipeline, strength, steps):
    geometry = pipeline.describe(video_start("g", strength))
    assert geometry.num_inference_steps == steps
    assert (geometry.width, geometry.height, geometry.fps) == (64, 64, 16.0)  # the input's
    assert (geometry.first_chunk_frames, geometry.frames_per_chunk) == (9, 12)
    text_only = pipeline.describe(StartSession(session_id="t", prompt="p"))
    assert geometry.state_bytes > text_only.state_bytes  # the encoder's cache and a chunk's input
    two_steps = {1.0: 2, 0.9: 1, 0.8: 1, 0.5: 1, 0.0: 0}[strength]  # levels 1, 0.8333, then clean
    assert pipeline.describe(video_start("g2", strength, num_inference_steps=2)).num_inference_steps == two_steps


@pytest.mark.parametrize(("strength", "steps"), [(0.9, 3), (0.8, 2), (0.5, 1)])
def test_a_chunk_runs_the_steps_its_strength_leaves(pipeline, driver, monkeypatch, strength, steps):
    forwards = []
    real = pipeline.forward
    monkeypatch.setattr(pipeline, "forward", lambda batch, *a, **k: forwards.append(batch.rows) or real(batch, *a, **k))
    [state] = driver.open(video_start(f"steps-{strength}", strength))
    stream = camera(21)
    try:
        run(driver, state, stream, 2)
    finally:
        driver.release(state.session_id)
    assert len(forwards) == 2 * steps
    assert [row.step for rows in forwards for row in rows] == [*range(steps)] * 2
    start = 4 - steps
    assert state.input is not None and state.input.start_step == start


def test_a_chunk_starts_from_its_input_noised_to_the_first_steps_level(pipeline, driver):
    [state] = driver.open(video_start("start", 0.8))
    stream = camera(9)
    pipeline.take_input(state, 0, stream)
    encoded = state.input.latents[0].clone()
    pipeline.boundary(state, 0)
    chunk = state.chunks[0]
    sigma = self_forcing_timesteps(4)[2] / 1000.0
    assert state.timesteps == self_forcing_timesteps(4)[2:]
    assert torch.equal(chunk.latent, (1.0 - sigma) * encoded + sigma * chunk.noise[0])
    driver.release(state.session_id)


def test_strength_0_gives_the_inputs_vae_reconstruction(pipeline, driver):
    [state] = driver.open(video_start("zero", 0.0))
    assert state.geometry.num_inference_steps == 0 and state.timesteps == []
    stream = camera(9 + 12 * 2, seed=3)
    frames = []
    for index in range(3):  # no denoise step: take the frames, cross the boundary, commit, decode
        pipeline.take_input(state, index, chunk_frames(stream, index))
        pipeline.boundary(state, index)
        assert state.chunks[index].denoised
        pipeline.commit(state, index)
        out = pipeline.decode(state, index)
        assert (out.num_frames, out.width, out.height) == (9 if index == 0 else 12, 64, 64)
        frames.append(np.frombuffer(out.payload, np.uint8).reshape(-1, 64, 64, 3))
    driver.release(state.session_id)
    got = np.concatenate(frames)
    # The same VAE one-shot, through diffusers' own encode and decode of every frame.
    pixels = torch.from_numpy(stream).permute(3, 0, 1, 2).unsqueeze(0).float() / 127.5 - 1.0
    latents = pipeline.encoder.reference_encode(pixels)
    decoded = pipeline.decoder.reference_decode(latents).clamp(-1.0, 1.0)
    expected = ((decoded[0].permute(1, 2, 3, 0) + 1.0) * 127.5).round().clamp(0, 255).to(torch.uint8).numpy()
    assert got.shape == expected.shape == stream.shape
    difference = np.abs(got.astype(int) - expected.astype(int))
    assert difference.max() <= 1 and (difference > 0).mean() < 1e-3  # a rounding's flip at most
    assert np.abs(got.astype(int) - stream.astype(int)).mean() > 1  # random weights: not the input itself


def test_the_same_seed_and_input_give_the_same_frames(pipeline, driver):
    stream = camera(21, seed=5)
    outputs = []
    for sid in ("same-a", "same-b"):
        [state] = driver.open(video_start(sid, 0.8))
        outputs.append(run(driver, state, stream, 2))
        driver.release(sid)
    assert outputs[0] == outputs[1]
    [state] = driver.open(video_start("other-input", 0.8))
    other = run(driver, state, camera(21, seed=6), 2)
    driver.release("other-input")
    assert other[0] != outputs[0][0]  # the input shapes the frames


def test_strength_1_is_text_to_video(pipeline, driver):
    [state] = driver.open(video_start("full", 1.0))
    with_input = run(driver, state, camera(21), 2)
    driver.release("full")
    [state] = driver.open(StartSession(session_id="text", prompt="a watercolour fox", seed=7))
    text = [driver.run_chunk("text").payload for _ in range(2)]
    driver.release("text")
    assert with_input == text


def test_wrong_input_is_refused_naming_what_is_wrong(pipeline, driver, monkeypatch):
    with pytest.raises(ValueError, match=r"input\.width must equal the session's width \(128\), got 64"):
        pipeline.describe(video_start("w", 0.5, width=128, height=128))
    with pytest.raises(ValueError, match=r"input\.fps must equal the session's fps \(8\.0\), got 16\.0"):
        pipeline.describe(video_start("f", 0.5, fps=8.0))
    [state] = driver.open(video_start("bad", 0.5))
    with pytest.raises(ChunkOrderError, match="chunk 0 has no input frames yet"):
        pipeline.boundary(state, 0)
    with pytest.raises(ValueError, match=r"chunk 0 takes 9 input frames, uint8 \[9, 64, 64, 3\], got torch.uint8 \[12"):
        pipeline.take_input(state, 0, camera(12))
    with pytest.raises(ValueError, match=r"takes 9 input frames.*got torch.uint8 \[9, 32, 32, 3\]"):
        pipeline.take_input(state, 0, camera(9, size=32))
    with pytest.raises(ValueError, match=r"got torch.float32"):
        pipeline.take_input(state, 0, camera(9).astype(np.float32))
    with pytest.raises(ChunkOrderError, match="input frames for chunk 1 came early"):
        pipeline.take_input(state, 1, camera(12))
    pipeline.take_input(state, 0, camera(9))  # the refusals left the input as it was
    with pytest.raises(ChunkOrderError, match="input frames for chunk 0 were already taken"):
        pipeline.take_input(state, 0, camera(9))
    driver.release("bad")
    [text] = driver.open(StartSession(session_id="no-input", prompt="p"))
    with pytest.raises(ValueError, match="opened without an input"):
        pipeline.take_input(text, 0, camera(9))
    driver.release("no-input")
    monkeypatch.setattr(pipeline, "encoder", None)
    with pytest.raises(ValueError, match="input: the 'tiny' model's VAE has no encoder"):
        pipeline.describe(video_start("none", 0.5))


def test_release_frees_the_input(pipeline, driver):
    [state] = driver.open(video_start("free", 0.5))
    pipeline.take_input(state, 0, camera(9))
    assert state.input.latents and any(slot is not None for slot in state.input.encoder_cache)
    driver.release("free")
    assert not state.input.latents and not state.input.encoder_cache
    assert "free" not in pipeline.held_sessions()


def test_the_stub_refuses_an_input_that_is_not_the_sessions_size():
    from rtvideo.workers.pipelines.stub import StubPipeline

    with pytest.raises(ValueError, match=r"input\.width must equal the session's width \(32\), got 64"):
        StubPipeline().describe(video_start("stub", 0.5, width=32, height=32))


def reconstruction(pipeline: CausalWanPipeline, stream: np.ndarray) -> np.ndarray:
    """``stream`` through diffusers' own one-shot encode and decode of every frame."""
    pixels = torch.from_numpy(stream).permute(3, 0, 1, 2).unsqueeze(0).float() / 127.5 - 1.0
    latents = pipeline.encoder.reference_encode(pixels)
    decoded = pipeline.decoder.reference_decode(latents).clamp(-1.0, 1.0)
    return ((decoded[0].permute(1, 2, 3, 0) + 1.0) * 127.5).round().clamp(0, 255).to(torch.uint8).numpy()


@pytest.mark.parametrize("overlap_decode", [False, True])
def test_strength_0_through_the_runner_returns_the_inputs_vae_reconstruction(pipeline, overlap_decode):
    """The worker's path: the runner takes each chunk's frames from its boundary
    task (``BoundaryTask.input``, as the engine loop hands them), and a chunk of
    no denoise step is one commit row (no forward), then its decode, in line or
    on the decode stage."""
    driver = ChunkDriver(pipeline, overlap_decode=overlap_decode)
    stream = camera(9 + 12 * 2, seed=3)
    forwards = []
    real = pipeline.forward
    pipeline.forward = lambda *a, **k: forwards.append(a) or real(*a, **k)
    try:
        driver.open(video_start("runner-zero", 0.0))
        chunks = driver.run(["runner-zero"], 3, inputs={"runner-zero": [chunk_frames(stream, i) for i in range(3)]})
        driver.release("runner-zero")
    finally:
        del pipeline.forward
        driver.close()
    assert forwards == []  # no denoise step ran
    outputs = chunks["runner-zero"]
    assert [(c.num_frames, c.width, c.height) for c in outputs] == [(9, 64, 64), (12, 64, 64), (12, 64, 64)]
    got = np.concatenate([np.frombuffer(c.payload, np.uint8).reshape(-1, 64, 64, 3) for c in outputs])
    expected = reconstruction(pipeline, stream)
    difference = np.abs(got.astype(int) - expected.astype(int))
    assert difference.max() <= 1 and (difference > 0).mean() < 1e-3  # a rounding's flip at most
    assert "runner-zero" not in pipeline.held_sessions()
