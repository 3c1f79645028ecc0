"""The engine loop and the decode stage's results, through a real threaded
executor and the stub: a decode comes back abandoned only because its
session is stopping; one abandoned while nothing stopped the session fails
it, naming the chunk, instead of leaving it making chunks nobody gets."""

from __future__ import annotations

import threading

from engine.config import EngineConfig
from engine.control import ControlPlane
from engine.loop import EngineLoop
from engine.messages import ChunkReady, SessionDone, SessionFailed, Shutdown, StartSession
from engine.plan import DecodeResult
from workers.executor import LocalExecutor
from workers.pipelines.stub import StubPipeline
from workers.runner import ModelRunner


class AbandoningStage:
    """A decode stage that answers every chunk from ``abandon_from`` on as
    abandoned (cancelled) and decodes the ones before it."""

    def __init__(self, runner: ModelRunner, done, abandon_from: int) -> None:
        self.runner, self.done, self.abandon_from = runner, done, abandon_from
        self.decodes = ()

    def submit(self, session_id: str, chunk_index: int) -> None:
        if chunk_index >= self.abandon_from:
            self.runner.decode_returned(session_id)
            self.done(DecodeResult(session_id, chunk_index, None, 0.0, cancelled=True))
        else:
            self.done(self.runner.decode(session_id, chunk_index))

    def forget(self, session_id: str) -> None:
        pass

    def close(self) -> None:
        pass


def run_one(start: StartSession, abandon_from: int) -> list:
    """Run ``start`` alone on a threaded loop over the stub; every message sent."""
    sent: list = []
    ended = threading.Event()

    def send(message) -> None:
        sent.append(message)
        if isinstance(message, SessionDone | SessionFailed):
            ended.set()

    config = EngineConfig()
    runner = ModelRunner(StubPipeline())
    control = ControlPlane(config, runner.describe, send)
    executor = LocalExecutor(
        runner,
        control.is_stopping,
        control.wake,
        decode_stage=lambda runner, done: AbandoningStage(runner, done, abandon_from),
    )
    loop = EngineLoop(config, control, executor, send, grouping=True, max_rows=1)
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
