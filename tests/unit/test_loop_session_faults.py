"""A session the loop fails on its own (input frames refused, input timed out, a
decode's output not a chunk of the session's) ends in the very loop iteration
that failed it, and no chunk of it goes out malformed: in-process, the loop over
the stub through the unthreaded local executor, the control plane's ``wait``
recording instead of blocking (a loop that went to sleep with the session
failed but not released would be woken by nothing)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from rtvideo.engine.config import EngineConfig
from rtvideo.engine.control import ControlPlane
from rtvideo.engine.messages import (
    ChunkReady,
    SessionDone,
    SessionFailed,
    StartSession,
    SubmitInput,
    VideoInput,
)
from rtvideo.engine.plan import ChunkOutput
from rtvideo.workers.pipelines.stub import StubPipeline
from rtvideo.workers.runner import ModelRunner
from tests.support import inline_loop

W, H = 16, 12


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Engine:
    """The loop, its control plane and what it sent; ``iterate`` is one
    ``run_once`` whose closing wait returns at once, its timeout recorded."""

    def __init__(self, pipeline: StubPipeline, **config) -> None:
        self.sent: list = []
        self.waits: list[float | None] = []
        self.clock = Clock()
        self.config = EngineConfig(**config)
        self.runner = ModelRunner(pipeline)
        self.control = ControlPlane(self.config, self.runner.describe, self.sent.append)
        self.control.wait = lambda seen, timeout=None: self.waits.append(timeout) or True
        self.loop = inline_loop(
            self.config, self.control, self.runner, self.sent.append, grouping=True, max_rows=1, clock=self.clock
        )

    def iterate(self, times: int = 1) -> None:
        for _ in range(times):
            self.loop.run_once()

    def of(self, kind: type, sid: str) -> list:
        return [m for m in self.sent if isinstance(m, kind) and m.session_id == sid]

    def holds_nothing(self) -> bool:
        return not self.loop.sessions and self.control.open_sessions() == () and self.runner.states == {}


def video_start(sid: str) -> StartSession:
    given = VideoInput(strength=0.5, format="raw", width=W, height=H, fps=16.0)
    return StartSession(session_id=sid, prompt="p", width=W, height=H, input=given)


def test_input_frames_the_control_plane_refuses_end_the_session_in_that_iteration():
    engine = Engine(StubPipeline(width=W, height=H))
    engine.control.handle(video_start("v"))
    engine.iterate(2)  # opened; chunk 0 waits for its frames
    assert engine.of(SessionFailed, "v") == [] and "v" in engine.loop.sessions
    first = engine.runner.describe(video_start("v")).first_chunk_frames
    engine.control.handle(
        SubmitInput(
            session_id="v", chunk_index=0, count=first - 1, height=H, width=W, frames=bytes((first - 1) * H * W * 3)
        )
    )
    engine.iterate()
    [failed] = engine.of(SessionFailed, "v")
    assert failed.code == "invalid_input"
    assert engine.holds_nothing()


def test_a_timed_out_input_ends_the_session_in_the_iteration_that_times_it_out():
    engine = Engine(StubPipeline(width=W, height=H), input_timeout_s=0.5)
    engine.control.handle(video_start("v"))
    engine.iterate(2)
    assert engine.waits[-1] == pytest.approx(0.5)  # the loop sleeps until the wait times out
    engine.clock.now += 0.5
    engine.iterate()
    [failed] = engine.of(SessionFailed, "v")
    assert failed.code == "input_timeout" and "did not come within 0.5 s" in failed.message
    assert engine.holds_nothing()


class MalformedDecode(StubPipeline):
    """The stub, whose decode of session ``bad``'s chunk ``bad_chunk`` returns ``damage(output)``."""

    def __init__(self, bad_chunk: int, damage, **options) -> None:
        super().__init__(**options)
        self.bad_chunk, self.damage = bad_chunk, damage

    def decode(self, state, chunk_index):
        output = super().decode(state, chunk_index)
        return self.damage(output) if (state.session_id, chunk_index) == ("bad", self.bad_chunk) else output


DAMAGES = {
    "an array, not bytes": (
        lambda out: dataclasses.replace(out, payload=np.frombuffer(out.payload, np.uint8).copy()),
        "a payload of ndarray, not bytes",
    ),
    "five bytes short": (
        lambda out: dataclasses.replace(out, payload=out.payload[:-5]),
        "payload bytes, not",
    ),
    "another size": (
        lambda out: ChunkOutput(out.num_frames, W * 2, H, out.payload + out.payload),
        f"of {W * 2}x{H}, not",
    ),
    "a frame missing": (
        lambda out: ChunkOutput(out.num_frames - 1, W, H, out.payload[: (out.num_frames - 1) * W * H * 3]),
        "frames of",
    ),
    "not a chunk at all": (lambda out: out.payload, "a bytes, not a ChunkOutput"),
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_decode_output_not_a_chunk_of_the_session_fails_it_and_no_later_chunk_goes_out(damage):
    change, named = DAMAGES[damage]
    engine = Engine(MalformedDecode(1, change, width=W, height=H))
    engine.control.handle(StartSession(session_id="bad", prompt="p", num_chunks=3))
    engine.control.handle(StartSession(session_id="good", prompt="q", num_chunks=3))
    for _ in range(200):
        engine.iterate()
        if engine.holds_nothing():
            break
    assert [c.generation_chunk_index for c in engine.of(ChunkReady, "bad")] == [0]
    [failed] = engine.of(SessionFailed, "bad")
    assert failed.code == "pipeline_error" and failed.message.startswith("the decode of chunk 1 returned ")
    assert named in failed.message
    assert engine.of(SessionDone, "bad") == []
    [done] = engine.of(SessionDone, "good")  # the other session, decoded by the same pipeline, is whole
    assert done.reason == "completed" and len(engine.of(ChunkReady, "good")) == 3
    assert engine.holds_nothing()
