"""Video to video in the engine loop, in process (control plane, loop, the real
runner over the stub, an executor that runs each micro-step inline): a chunk
of no denoise step goes from its boundary straight to its commit and decode;
a chunk begins only once its input frames came; a session whose frames do not
come within ``input_timeout_s`` (the loop's clock, set by the test) fails with
``input_timeout`` while another session goes on; one whose frames the control
plane refused fails with ``invalid_input``."""

from __future__ import annotations

import numpy as np

from rtvideo.engine.config import EngineConfig
from rtvideo.engine.control import ControlPlane
from rtvideo.engine.messages import ChunkReady, SessionDone, SessionFailed, StartSession, SubmitInput, VideoInput
from rtvideo.engine.plan import StepRow
from rtvideo.engine.session import ChunkEvents, ChunkInFlight, passes_for
from rtvideo.workers.pipelines.stub import StubPipeline
from rtvideo.workers.runner import ModelRunner
from tests.support import inline_loop

W, H = 8, 6


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _engine(timeout_s: float = 2.0):
    sent: list = []
    config = EngineConfig(input_timeout_s=timeout_s)
    runner = ModelRunner(StubPipeline(width=W, height=H, frames_per_chunk=2, first_chunk_frames=3))
    control = ControlPlane(config, runner.describe, sent.append)
    clock = Clock()
    loop = inline_loop(config, control, runner, sent.append, grouping=True, max_rows=4, clock=clock)
    return loop, control, sent, clock


def _turn(loop) -> None:
    """One loop iteration without its wait (the inline executor ran what it planned)."""
    seen, playheads = loop.control.pacing_state()
    loop.collect()
    loop.drain_control()
    loop.submit(playheads)
    loop.collect()


def _input(strength: float) -> VideoInput:
    return VideoInput(strength=strength, format="raw", width=W, height=H, fps=16.0)


def _frames(sid: str, index: int, seed: int) -> tuple[SubmitInput, np.ndarray]:
    count = 3 if index == 0 else 2
    frames = np.random.default_rng(seed).integers(0, 256, (count, H, W, 3), dtype=np.uint8)
    message = SubmitInput(session_id=sid, chunk_index=index, count=count, height=H, width=W, frames=frames.tobytes())
    return message, frames


def _of(sent: list, kind: type, sid: str) -> list:
    return [m for m in sent if isinstance(m, kind) and m.session_id == sid]


def test_a_chunk_of_no_step_takes_one_row_its_commit():
    assert passes_for(0, split=False) == 1 and passes_for(4, split=False) == 4 and passes_for(4, split=True) == 5
    chunk = ChunkInFlight(index=2, steps=0, events=ChunkEvents(), boundary=None, boundary_step=1, passes=1)
    row = chunk.next_row("s")
    assert row == StepRow("s", 2, 0, 0) and row.commit and not row.last
    assert not chunk.all_planned
    chunk.planned += 1
    assert chunk.all_planned


def test_strength_zero_runs_no_step_and_returns_the_input():
    loop, control, sent, _ = _engine()
    control.handle(StartSession(session_id="s", prompt="p", num_chunks=3, input=_input(0.0)))
    assert loop.control.geometry("s").num_inference_steps == 0
    given = {}
    for index in range(3):
        message, given[index] = _frames("s", index, seed=index)
        control.handle(message)
    for _ in range(20):
        _turn(loop)
        if _of(sent, SessionDone, "s"):
            break
    chunks = _of(sent, ChunkReady, "s")
    assert [c.generation_chunk_index for c in chunks] == [0, 1, 2]
    for chunk in chunks:
        assert chunk.timing.steps == 0
        assert chunk.payload == given[chunk.generation_chunk_index].tobytes()  # the input, byte for byte
    assert _of(sent, SessionDone, "s")[0].reason == "completed"


def test_a_chunk_waits_for_its_frames_and_the_wait_times_out_for_that_session_only():
    loop, control, sent, clock = _engine(timeout_s=2.0)
    control.handle(StartSession(session_id="v", prompt="p", input=_input(0.5)))
    control.handle(StartSession(session_id="t", prompt="q", num_chunks=2))  # text to video beside it
    _turn(loop)
    assert not _of(sent, ChunkReady, "v")  # no frames: not even opened
    control.handle(_frames("v", 0, seed=1)[0])
    for _ in range(10):
        _turn(loop)
    assert [c.generation_chunk_index for c in _of(sent, ChunkReady, "v")] == [0]  # chunk 1 waits for its frames
    assert loop.sessions["v"].input_wait is not None
    clock.now += 1.9
    _turn(loop)
    assert not _of(sent, SessionFailed, "v")
    clock.now += 0.2
    _turn(loop)
    _turn(loop)
    failed = _of(sent, SessionFailed, "v")
    assert failed and failed[0].code == "input_timeout"
    assert failed[0].message == "session v: the input frames of chunk 1 did not come within 2 s (input_timeout_s)"
    assert _of(sent, SessionDone, "t")[0].reason == "completed"  # the other session went on


def test_frames_the_control_plane_refused_fail_the_session_as_invalid_input():
    loop, control, sent, _ = _engine()
    control.handle(StartSession(session_id="v", prompt="p", input=_input(0.5)))
    control.handle(_frames("v", 1, seed=1)[0])  # chunk 1 before chunk 0
    _turn(loop)
    _turn(loop)
    failed = _of(sent, SessionFailed, "v")
    assert [(f.code, f.message) for f in failed] == [
        ("invalid_input", "session v: input frames for chunk 1 came out of order: chunk 0's come next")
    ]
    assert not loop.sessions and loop.executor.held_sessions() == ((), ())
