"""Video to video under pipeline ranks, through real worker processes over the
tiny model: the first rank takes each chunk's input frames (``take_input``,
its VAE encoder) and crosses the chunk's boundary as one rank does, the
chunk's latent goes round the ring as the blocks' hidden states, and the
frames are bit for bit those of one rank: decoded in line or on the decode
stage, with an interaction mid-stream, at strength 0 (a chunk of no denoise
step: its commit pass alone). With stream batch (chunks of a session
overlapping in the ring) chunk 0 is still one rank's. Frames the worker does
not take fail their session only; a pipeline whose split takes no input is
refused at start, naming it."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import numpy as np
import pytest
import pytest_asyncio

from rtvideo.engine.client.engine_client import EngineClient
from rtvideo.engine.client.errors import SessionRejectedError
from rtvideo.engine.client.session_handle import SessionHandle
from rtvideo.engine.config import EngineConfig, PipelineSpec
from rtvideo.engine.messages import (
    ChunkReady,
    Interaction,
    InteractionApplied,
    InteractionQueued,
    SessionDone,
    SessionFailed,
    StartSession,
    VideoInput,
)
from tests.conftest import PINNED_LIMITS
from tests.support import Collected, collect, free_ports, read_until

SIDE = 32
SHARED = pytest.mark.asyncio(loop_scope="module")  # the tests that run on the module's engines


def config(pp: int, **fields) -> EngineConfig:
    spec = PipelineSpec(fields.pop("pipeline", "tiny"), {"device": "cpu", "warm_up_chunks": 1})
    return EngineConfig(
        pipeline=spec, pp=pp, max_batch_rows=2, max_sessions=4, startup_timeout_s=120, **PINNED_LIMITS, **fields
    )


async def started(pp: int, **fields) -> EngineClient:
    engine = EngineClient(config(pp, **fields))
    await engine.start()
    return engine


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def one_rank():
    """One rank deciding everything in line: the reference."""
    engine = await started(1)
    yield engine
    await engine.shutdown()


def video(sid: str, strength: float, seed: int, chunks: int | None) -> StartSession:
    given = VideoInput(strength=strength, format="raw", width=SIDE, height=SIDE, fps=16.0)
    return StartSession(session_id=sid, prompt="a calm sea", seed=seed, num_chunks=chunks, input=given)


def camera(handle: SessionHandle, index: int, seed: int) -> np.ndarray:
    """Chunk ``index``'s input frames: random, different for every chunk and seed."""
    g = handle.geometry
    count = g.first_chunk_frames if index == 0 else g.frames_per_chunk
    return np.random.default_rng([seed, index]).integers(0, 256, (count, SIDE, SIDE, 3), dtype=np.uint8)


async def steered(engine: EngineClient, sid: str, chunks: int = 3) -> tuple[Collected, InteractionApplied]:
    """A session at strength 0.85 (two of the four steps) whose prompt changes
    at chunk 1: chunk 0's frames go alone, and the prompt once chunk 0 is out,
    so chunk 1, still waiting for its frames, takes it wherever it runs."""
    handle = await engine.start_session(video(sid, 0.85, seed=21, chunks=chunks))
    assert handle.geometry.num_inference_steps == 2
    seen = Collected()
    await handle.send_input(0, camera(handle, 0, seed=5))
    await read_until(handle, ChunkReady, seen, timeout=120)
    await handle.interact("e1", Interaction(prompt="a storm"))
    queued = await read_until(handle, InteractionQueued, seen, timeout=120)
    assert queued.expected_chunk_index == 1
    for index in range(1, chunks):
        await handle.send_input(index, camera(handle, index, seed=5))
    result = await collect(handle, seen, timeout=120)
    [applied] = result.of(InteractionApplied)
    return result, applied


async def still(engine: EngineClient, sid: str, chunks: int = 3) -> Collected:
    """A session at strength 0: every chunk its commit pass alone."""
    handle = await engine.start_session(video(sid, 0.0, seed=22, chunks=chunks))
    assert handle.geometry.num_inference_steps == 0
    for index in range(chunks):
        await handle.send_input(index, camera(handle, index, seed=6))
    return await collect(handle, timeout=120)


async def both(engine: EngineClient, tag: str) -> tuple[Collected, InteractionApplied, Collected]:
    """The steered session and the strength-0 one side by side."""
    (steer, applied), zero = await asyncio.gather(steered(engine, f"{tag}-v"), still(engine, f"{tag}-z"))
    return steer, applied, zero


def payloads(result: Collected) -> list[bytes]:
    assert isinstance(result.end, SessionDone) and result.end.reason == "completed", result.end
    assert [c.generation_chunk_index for c in result.chunks] == list(range(len(result.chunks)))
    return [chunk.payload for chunk in result.chunks]


MODES = {
    "inline": {"overlap_decode": False},
    "decode-stage": {"overlap_decode": True},
    "decode-stage-split": {"overlap_decode": True, "pp_decode": "split"},
}


@SHARED
@pytest.mark.parametrize("mode", MODES)
async def test_two_ranks_make_what_one_rank_makes_from_the_same_input(one_rank: EngineClient, mode: str):
    engine = await started(2, pp_port=free_ports(2), **MODES[mode])
    try:
        steer, applied, zero = await both(engine, mode)
        after = await engine.probe()
    finally:
        await engine.shutdown()
    assert after.sessions == after.runner_sessions == after.pipeline_sessions == ()
    assert applied.generation_chunk_index == 1 and applied.chunks_in_flight == 1
    assert [c.timing.steps for c in steer.chunks] == [2, 2, 2]
    assert [c.timing.steps for c in zero.chunks] == [0, 0, 0]
    ref_steer, ref_applied, ref_zero = await both(one_rank, f"{mode}-ref")
    assert ref_applied.generation_chunk_index == 1
    assert payloads(steer) == payloads(ref_steer)
    assert payloads(zero) == payloads(ref_zero)
    assert payloads(steer)[1] != payloads(steer)[2]  # the check can fail: chunks differ


@SHARED
async def test_stream_batch_takes_an_input_and_its_first_chunk_is_one_ranks(one_rank: EngineClient):
    """Stream batch: a session's next chunk begins while the one before is in the
    ring; its frames still come in order, chunk 0 is one rank's, the prompt lands
    at the chunk still waiting for its frames."""
    engine = await started(2, overlap_decode=True, stream_batch=True)
    try:
        steer, applied, zero = await both(engine, "stream-batch")
    finally:
        await engine.shutdown()
    assert applied.generation_chunk_index == 1
    ref_steer, _, ref_zero = await both(one_rank, "stream-batch-ref")
    assert payloads(steer)[0] == payloads(ref_steer)[0]
    assert payloads(zero) == payloads(ref_zero)  # no step: nothing provisional to attend to
    assert len(payloads(steer)) == 3


@SHARED
async def test_a_bad_input_frame_under_two_ranks_fails_only_its_session():
    engine = await started(2)
    try:
        bad = await engine.start_session(video("bad", 0.85, seed=1, chunks=None))
        good = await engine.start_session(video("good", 0.85, seed=2, chunks=3))
        seen = Collected()
        await bad.send_input(0, camera(bad, 0, seed=1))
        await read_until(bad, ChunkReady, seen, timeout=120)  # its state is open on both ranks
        await bad.send_input(1, camera(bad, 0, seed=1))  # chunk 0's count of frames for chunk 1
        for index in range(3):
            await good.send_input(index, camera(good, index, seed=2))
        failed = await collect(bad, seen, timeout=120)
        done = await collect(good, timeout=120)
        after = await engine.probe()
    finally:
        await engine.shutdown()
    assert isinstance(failed.end, SessionFailed) and failed.end.code == "invalid_input"
    count = bad.geometry.frames_per_chunk
    assert failed.end.message.startswith(f"session bad: chunk 1 takes {count} input frames of {SIDE}x{SIDE}")
    assert len(payloads(done)) == 3
    assert after.sessions == after.runner_sessions == after.pipeline_sessions == ()


def no_input_split(**options):
    """The tiny model, its split declared unable to take input frames."""
    from rtvideo.workers.pipelines.causal_wan import build

    pipeline = build(**options)
    pipeline.capabilities = replace(pipeline.capabilities, video_input=False)
    return pipeline


async def test_a_pipeline_whose_split_takes_no_input_refuses_one_under_two_ranks():
    engine = await started(2, pipeline=f"{__name__}:no_input_split")
    try:
        with pytest.raises(SessionRejectedError) as refused:
            await engine.start_session(video("s", 0.5, seed=1, chunks=2))
        text = await engine.start_session(StartSession(session_id="t", prompt="p", num_chunks=1, width=32, height=32))
        done = await collect(text, timeout=120)
    finally:
        await engine.shutdown()
    assert refused.value.code == "invalid_request"
    said = "input: the 'tiny' pipeline split over 2 pipeline ranks takes no input video"
    assert refused.value.message.startswith(said), refused.value.message
    assert isinstance(done.end, SessionDone)
