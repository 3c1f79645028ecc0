"""Video to video through real worker processes (stub pipeline): a session opened
with an ``input`` gets each chunk's frames (``SessionHandle.send_input``), each
chunk begins once its frames came, and its frames come out of it (the stub's are
its input blended toward its pattern by its steps over the schedule's, byte for
byte the input at strength 0, where a chunk runs no step). A prompt still lands
at the next chunk; a sender that falls silent fails its own session only
(``input_timeout``); frames the worker does not take fail that session only
(``invalid_input``, naming the fault)."""

from __future__ import annotations

import numpy as np
import pytest

from rtvideo.engine.messages import (
    ChunkReady,
    Interaction,
    InteractionApplied,
    InteractionQueued,
    SessionDone,
    SessionFailed,
    StartSession,
    SubmitInput,
    VideoInput,
)
from tests.support import Collected, collect, expected_row, frames, make_gate, read_until, wait_reached

W, H, FIRST, LATER = 16, 12, 5, 4  # the stub's size here, and its frames in chunk 0 and after


def stub(**options) -> dict:
    return {"width": W, "height": H, "first_chunk_frames": FIRST, "frames_per_chunk": LATER, **options}


def video(sid: str, strength: float, **start) -> StartSession:
    given = VideoInput(strength=strength, format="raw", width=W, height=H, fps=16.0)
    return StartSession(session_id=sid, **{"prompt": "a red fox", "input": given, **start})


def camera(index: int, seed: int = 0) -> np.ndarray:
    """Chunk ``index``'s input frames: random, different for every chunk and seed."""
    count = FIRST if index == 0 else LATER
    return np.random.default_rng([seed, index]).integers(0, 256, (count, H, W, 3), dtype=np.uint8)


def assert_made_from(chunk: ChunkReady, given: np.ndarray, weight: float, prompt: str) -> None:
    """The stub's chunk of ``given`` at ``weight`` (its steps over its schedule's):
    every pixel below row 0 within ``weight x 255`` (+1) of ``(1 - weight) x input``,
    row 0 the prompt's conditioning."""
    out = frames(chunk).astype(float)
    assert out.shape == given.shape
    assert np.all(np.abs(out[:, 1:] - (1.0 - weight) * given[:, 1:]) <= weight * 255 + 1)
    assert all(np.array_equal(out[f, 0], expected_row(prompt, W)) for f in range(len(out)))


async def test_frames_in_chunks_out_made_from_their_input(make_engine):
    engine = await make_engine(**stub())
    handle = await engine.start_session(video("s", 0.25, num_chunks=3))
    assert handle.geometry.num_inference_steps == 1  # a quarter of the stub's 4 steps
    for index in range(3):
        await handle.send_input(index, camera(index))
    result = await collect(handle)
    assert isinstance(result.end, SessionDone) and result.end.reason == "completed"
    assert [c.generation_chunk_index for c in result.chunks] == [0, 1, 2]
    for chunk in result.chunks:
        assert chunk.timing.steps == 1
        assert_made_from(chunk, camera(chunk.generation_chunk_index), 0.25, "a red fox")
    with pytest.raises(AssertionError):  # the check can fail: another chunk's input is not this one's
        assert_made_from(result.chunks[1], camera(2), 0.25, "a red fox")


async def test_strength_0_runs_no_step_and_returns_the_input_itself(make_engine):
    engine = await make_engine(**stub())
    handle = await engine.start_session(video("s", 0.0, num_chunks=3))
    assert handle.geometry.num_inference_steps == 0
    for index in range(3):
        await handle.send_input(index, camera(index, seed=4))
    result = await collect(handle)
    assert isinstance(result.end, SessionDone) and result.end.reason == "completed"
    assert [c.timing.steps for c in result.chunks] == [0, 0, 0]
    assert [c.payload for c in result.chunks] == [camera(i, seed=4).tobytes() for i in range(3)]
    assert (await engine.probe()).steps == 0


async def test_a_prompt_sent_mid_stream_applies_at_the_next_chunk(make_engine):
    gate = make_gate(chunk=1, step=0)
    engine = await make_engine(gates=[gate], **stub())
    handle = await engine.start_session(video("s", 0.5, num_chunks=4))
    await handle.send_input(0, camera(0))
    await handle.send_input(1, camera(1))
    await wait_reached(gate)  # chunk 1 is being denoised
    seen = Collected()
    await handle.interact("e", Interaction(prompt="a blue whale"))
    queued = await read_until(handle, InteractionQueued, seen)
    assert (queued.in_progress_chunk_index, queued.expected_chunk_index) == (1, 2)
    gate.release.set()
    await handle.send_input(2, camera(2))
    await handle.send_input(3, camera(3))
    result = await collect(handle, seen)
    assert isinstance(result.end, SessionDone) and result.end.reason == "completed"
    [applied] = result.of(InteractionApplied)
    assert applied.generation_chunk_index == 2
    prompts = ["a red fox", "a red fox", "a blue whale", "a blue whale"]
    for chunk, prompt in zip(result.chunks, prompts, strict=True):
        assert_made_from(chunk, camera(chunk.generation_chunk_index), 0.5, prompt)


async def test_a_silent_sender_fails_its_session_only(make_engine):
    engine = await make_engine(input_timeout_s=1.0, **stub())
    slow = await engine.start_session(video("slow", 0.5))
    steady = await engine.start_session(video("steady", 0.5, num_chunks=3))
    await slow.send_input(0, camera(0))  # then nothing: chunk 1's frames never come
    for index in range(3):
        await steady.send_input(index, camera(index, seed=1))
    failed = await collect(slow)
    assert [c.generation_chunk_index for c in failed.chunks] == [0]
    assert isinstance(failed.end, SessionFailed) and failed.end.code == "input_timeout"
    assert failed.end.message == "session slow: the input frames of chunk 1 did not come within 1 s (input_timeout_s)"
    done = await collect(steady)
    assert isinstance(done.end, SessionDone) and done.end.reason == "completed" and len(done.chunks) == 3
    after = await engine.probe()
    assert after.sessions == after.runner_sessions == after.pipeline_sessions == ()


def _bytes_short(index: int) -> SubmitInput:
    data = camera(index).tobytes()[:-3]
    return SubmitInput(session_id="bad", chunk_index=index, count=FIRST, height=H, width=W, frames=data)


@pytest.mark.parametrize(
    ("send", "says"),
    [
        (lambda h: h.send_input(0, camera(1)), f"chunk 0 takes {FIRST} input frames of {W}x{H}"),
        (lambda h: h.send_input(0, camera(0)[:, :, :8]), f"got {FIRST} of 8x{H}"),
        (lambda h: h.send_input(1, camera(1)), "input frames for chunk 1 came out of order: chunk 0's come next"),
        (lambda h: h._client._send(_bytes_short(0)), f"chunk 0's input frames are {FIRST * H * W * 3 - 3} bytes"),
    ],
    ids=["count", "size", "order", "bytes"],
)
async def test_frames_it_does_not_take_fail_that_session_only_naming_the_fault(make_engine, send, says):
    engine = await make_engine(**stub())
    bad = await engine.start_session(video("bad", 0.5))
    good = await engine.start_session(video("good", 0.5, num_chunks=2))
    await send(bad)
    for index in range(2):
        await good.send_input(index, camera(index))
    failed = await collect(bad)
    assert isinstance(failed.end, SessionFailed) and failed.end.code == "invalid_input"
    assert failed.end.message.startswith("session bad: ") and says in failed.end.message
    done = await collect(good)
    assert isinstance(done.end, SessionDone) and done.end.reason == "completed"
    assert [c.payload != b"" for c in done.chunks] == [True, True]


async def test_frames_for_a_session_opened_without_an_input_fail_it(make_engine):
    engine = await make_engine(**stub())
    handle = await engine.start_session(StartSession(session_id="text", prompt="p"))
    with pytest.raises(ValueError, match=r"input frames must be uint8 \[frames, height, width, 3\], got float64"):
        await handle.send_input(0, camera(0).astype(float))  # not sent: it cannot be described on the wire
    await handle.send_input(0, camera(0))
    result = await collect(handle)
    assert isinstance(result.end, SessionFailed) and result.end.code == "invalid_input"
    assert "session text: input frames for chunk 0, but the session was opened without an input" in result.end.message


@pytest.mark.parametrize(("overlap_decode", "rows"), [(False, 1), (False, 2), (True, 1), (True, 2)])
async def test_sessions_of_both_kinds_side_by_side_in_every_decode_and_batch_mode(make_engine, overlap_decode, rows):
    """A session of no step (strength 0: commit rows), one of two steps and a text
    session share the worker, its forwards batched or not, decodes in line or on
    the decode stage: each gets its own chunks, in order."""
    engine = await make_engine(overlap_decode=overlap_decode, max_batch_rows=rows, **stub())
    zero = await engine.start_session(video("zero", 0.0, num_chunks=3))
    half = await engine.start_session(video("half", 0.5, num_chunks=3))
    text = await engine.start_session(StartSession(session_id="text", prompt="a red fox", num_chunks=3))
    for index in range(3):
        await zero.send_input(index, camera(index, seed=7))
        await half.send_input(index, camera(index, seed=8))
    results = {handle.session_id: await collect(handle) for handle in (zero, half, text)}
    for result in results.values():
        assert isinstance(result.end, SessionDone) and result.end.reason == "completed"
        assert [c.generation_chunk_index for c in result.chunks] == [0, 1, 2]
    assert [c.payload for c in results["zero"].chunks] == [camera(i, seed=7).tobytes() for i in range(3)]
    for chunk in results["half"].chunks:
        assert chunk.timing.steps == 2
        assert_made_from(chunk, camera(chunk.generation_chunk_index, seed=8), 0.5, "a red fox")
    assert [c.timing.steps for c in results["text"].chunks] == [4, 4, 4]


async def test_a_stop_while_a_chunk_waits_for_its_frames_ends_the_session(make_engine):
    engine = await make_engine(**stub())
    handle = await engine.start_session(video("s", 0.5))
    await handle.send_input(0, camera(0))
    seen = Collected()
    await read_until(handle, ChunkReady, seen)  # chunk 1 now waits for frames that never come
    await handle.stop()
    result = await collect(handle, seen)
    assert isinstance(result.end, SessionDone) and result.end.reason == "stopped" and result.end.chunks == 1
    after = await engine.probe()
    assert after.sessions == after.runner_sessions == after.pipeline_sessions == ()


async def test_frames_more_than_the_chunks_that_may_wait_fail_the_session(make_engine):
    """Chunk 0 is held mid-denoise (so chunk 1 is the one about to begin): the
    frames of chunks 1 to 4 may wait, chunk 5's are a chunk too many."""
    gate = make_gate(chunk=0, step=0)
    engine = await make_engine(gates=[gate], **stub())
    handle = await engine.start_session(video("s", 0.5))
    await handle.send_input(0, camera(0))
    await wait_reached(gate)
    for index in range(1, 6):
        await handle.send_input(index, camera(index))
    # The control receiver takes messages in order and acknowledges an interaction
    # at once: its acknowledgement means the frames before it were judged while
    # chunk 0 was still held.
    await handle.interact("e", Interaction(prompt="a blue whale"))
    result = Collected()
    await read_until(handle, InteractionQueued, result)
    gate.release.set()
    await collect(handle, result)
    assert isinstance(result.end, SessionFailed) and result.end.code == "invalid_input"
    assert result.end.message == (
        "session s: input frames for chunk 5 came 4 chunks ahead of the chunk about to begin (1); "
        "at most 4 chunks of input may wait"
    )
    after = await engine.probe()
    assert after.sessions == after.runner_sessions == after.pipeline_sessions == ()
