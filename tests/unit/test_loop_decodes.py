"""The engine loop and the decode stage's results, through a real threaded
executor and the stub: a decode comes back abandoned only because its
session is stopping; one abandoned while nothing stopped the session fails
it, naming the chunk, instead of leaving it making chunks nobody gets."""

from __future__ import annotations

import threading

from rtvideo.engine.config import EngineConfig
from rtvideo.engine.control import ControlPlane
from rtvideo.engine.loop import EngineLoop
from rtvideo.engine.messages import ChunkReady, SessionDone, SessionFailed, Shutdown, StartSession
from rtvideo.engine.pacing import DECODE_RUN_AHEAD, max_chunks_decoding
from rtvideo.engine.plan import DecodeResult
from rtvideo.workers.executor import LocalExecutor
from rtvideo.workers.pipelines.stub import StubPipeline
from rtvideo.workers.runner import ModelRunner
from rtvideo.workers.runner_sessions import RunnerSessions
from tests.unit.fakes import QuietStage


class AbandoningStage(QuietStage):
    """A decode stage that answers every chunk from ``abandon_from`` on as
    abandoned (cancelled) and decodes the ones before it."""

    def __init__(self, sessions: RunnerSessions, done, abandon_from: int) -> None:
        self.sessions, self.done, self.abandon_from = sessions, done, abandon_from
        self.decodes = ()

    def submit(self, session_id: str, chunk_index: int) -> None:
        if chunk_index >= self.abandon_from:
            self.sessions.decode_returned(session_id)
            self.done(DecodeResult(session_id, chunk_index, None, 0.0, cancelled=True))
        else:
            self.done(self.sessions.decode(session_id, chunk_index))


def stub_loop(send, decode_stage) -> tuple[ControlPlane, LocalExecutor, EngineLoop]:
    """A loop over the stub with a threaded executor whose decode stage is
    ``decode_stage(runner.sessions, done)``; not yet running."""
    config = EngineConfig()
    runner = ModelRunner(StubPipeline())
    control = ControlPlane(config, runner.describe, send)
    executor = LocalExecutor(runner, control.is_stopping, control.wake, decode_stage=decode_stage)
    return control, executor, EngineLoop(config, control, executor, send, grouping=True, max_rows=1)


def run_one(start: StartSession, abandon_from: int) -> list:
    """Run ``start`` alone on a threaded loop over the stub; every message sent."""
    sent: list = []
    ended = threading.Event()

    def send(message) -> None:
        sent.append(message)
        if isinstance(message, SessionDone | SessionFailed):
            ended.set()

    control, _, loop = stub_loop(send, lambda sessions, done: AbandoningStage(sessions, done, abandon_from))
    thread = threading.Thread(target=loop.run, name="loop")
    thread.start()
    try:
        control.handle(start)
        assert ended.wait(30), sent
    finally:
        control.handle(Shutdown())
        thread.join(30)
    assert not thread.is_alive()
    return [m for m in sent if getattr(m, "session_id", None) == start.session_id]


def test_a_decode_abandoned_while_nothing_stopped_the_session_fails_it_naming_the_chunk():
    sent = run_one(StartSession(session_id="s", prompt="p", num_chunks=4), abandon_from=1)
    assert [m.generation_chunk_index for m in sent if isinstance(m, ChunkReady)] == [0]
    end = sent[-1]
    assert isinstance(end, SessionFailed) and end.code == "pipeline_error"
    assert "the decode of chunk 1 was abandoned, but the session was not stopping" in end.message


def test_an_open_ended_session_whose_decodes_are_abandoned_ends_instead_of_running_on():
    sent = run_one(StartSession(session_id="s", prompt="p"), abandon_from=0)
    assert not [m for m in sent if isinstance(m, ChunkReady)]
    assert isinstance(sent[-1], SessionFailed) and "chunk 0 was abandoned" in sent[-1].message


class GatedStage(QuietStage):
    """A decode stage that holds every chunk until the test lets the oldest go."""

    def __init__(self, sessions: RunnerSessions, done) -> None:
        self.sessions, self.done = sessions, done
        self.decodes = ()
        self.waiting: list[tuple[str, int]] = []
        self._lock = threading.Lock()

    def submit(self, session_id: str, chunk_index: int) -> None:
        with self._lock:
            self.waiting.append((session_id, chunk_index))

    def release_oldest(self) -> None:
        with self._lock:
            session_id, chunk_index = self.waiting.pop(0)
        self.done(self.sessions.decode(session_id, chunk_index))


def test_a_session_whose_decodes_lag_stops_at_its_limit_and_begins_one_more_as_each_comes_back():
    """Decode backpressure through the loop and a threaded executor: an
    open-ended exact session that nothing paces (a job) stops beginning chunks
    once ``max_chunks_decoding`` wait for the decode stage, and begins exactly
    one more as each comes back; its chunks come out in order. (Before the bound, a
    session whose denoise outran its decode queued chunks for the decode stage
    without end: on two ranks, 256 decode requests on a follower's connection
    broke it, and the session hung.)"""
    sent: list = []
    stages: list[GatedStage] = []

    def gated(sessions, done) -> GatedStage:
        stages.append(GatedStage(sessions, done))
        return stages[-1]

    control, executor, loop = stub_loop(sent.append, gated)
    (stage,) = stages

    def until_idle_with(waiting: int) -> None:
        """Turn the loop (as ``run_once`` does, each wait bounded) until that many
        chunks wait for the decode stage and no micro-step is in flight; then the
        plan the loop would make must be empty: the session is held."""
        for _ in range(1000):
            seen, playheads = control.pacing_state()
            loop.collect()
            loop.drain_control()
            loop.submit(playheads)
            if len(stage.waiting) == waiting and not executor.in_flight():
                loop.collect()
                assert loop.plan(control.pacing_state()[1])[0].is_empty()
                return
            assert len(stage.waiting) <= waiting, stage.waiting
            if executor.in_flight():
                assert control.wait(seen, 30), "no micro-step came back in 30 s"
        raise AssertionError(f"{stage.waiting} wait for the decode stage, {executor.in_flight()} in flight")

    try:
        control.handle(StartSession(session_id="s", prompt="p", num_inference_steps=2))
        loop.drain_control()
        limit = max_chunks_decoding(loop.sessions["s"])
        assert limit == 1 + DECODE_RUN_AHEAD  # exact: one chunk in flight at a time
        until_idle_with(limit)
        assert stage.waiting == [("s", i) for i in range(limit)] and loop.sessions["s"].next_chunk == limit
        for released in range(1, 4):
            stage.release_oldest()
            until_idle_with(limit)
            assert stage.waiting == [("s", i) for i in range(released, released + limit)]
            assert loop.sessions["s"].next_chunk == released + limit
        assert [m.generation_chunk_index for m in sent if isinstance(m, ChunkReady)] == [0, 1, 2]
    finally:
        executor.close()
