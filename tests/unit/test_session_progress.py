"""One record per fact of a session's progress: the loop's ``EngineSession``
keeps the next chunk, the chunks in flight, decoding and delivered; its phase,
end reason and frames done are derived from them; the control plane keeps the
mailbox, the playhead and the stop flag, and answers where an interaction
lands from the loop's record. In process: the loop, the control plane, the
real runner over the stub, and an executor whose micro-steps and decodes
finish when the test says (``tests.unit.fakes.HeldExecutor``)."""

from __future__ import annotations

import pytest

from rtvideo.engine.config import EngineConfig
from rtvideo.engine.control import ControlPlane
from rtvideo.engine.loop import EngineLoop
from rtvideo.engine.messages import (
    ChunkReady,
    Interaction,
    InteractionQueued,
    InteractionRejected,
    SessionDone,
    SessionGeometry,
    StartSession,
    StopSession,
    SubmitInteraction,
)
from rtvideo.engine.plan import ChunkOutput, DecodeResult
from rtvideo.engine.session import ChunkEvents, ChunkInFlight, EngineSession, Phase, chunk_frames, first_frame
from rtvideo.workers.pipelines.stub import StubPipeline
from rtvideo.workers.runner import ModelRunner
from tests.unit.fakes import HeldExecutor

GEOMETRY = SessionGeometry(
    width=8,
    height=8,
    fps=16.0,
    num_inference_steps=1,
    first_chunk_frames=3,
    frames_per_chunk=5,
    num_chunks=3,
    transition_chunks=0,
)


class Engine:
    def __init__(self) -> None:
        self.sent: list = []
        config = EngineConfig()
        self.runner = ModelRunner(StubPipeline(frames_per_chunk=5, first_chunk_frames=3))
        self.control = ControlPlane(config, self.runner.describe, self.sent.append)
        self.runner.sessions.is_stopping = self.control.is_stopping
        self.executor = HeldExecutor(self.runner, defer_decodes=True)  # decodes as the decode stage takes them
        self.loop = EngineLoop(config, self.control, self.executor, self.sent.append, grouping=True, max_rows=1)

    def turn(self) -> None:
        """One loop iteration, without its wait."""
        seen, playheads = self.control.pacing_state()
        self.loop.collect()
        self.loop.drain_control()
        self.loop.submit(playheads)

    def step(self) -> None:
        self.executor.finish_oldest()
        self.turn()

    def of(self, kind: type) -> list:
        return [m for m in self.sent if isinstance(m, kind)]

    def interact(self, event_id: str) -> InteractionQueued:
        self.control.handle(SubmitInteraction(session_id="s", event_id=event_id, interaction=Interaction(prompt="q")))
        return self.of(InteractionQueued)[-1]

    def commit_every_chunk(self) -> EngineSession:
        """Start a 3-chunk session and run it until its last chunk is committed,
        every decode still out."""
        self.control.handle(StartSession(session_id="s", prompt="p", num_chunks=3, num_inference_steps=1))
        self.turn()
        session = self.loop.sessions["s"]
        while not session.committed_all:
            self.step()
        assert len(self.executor.decodes) == 3 and not self.executor.waiting
        return session


def test_frames_of_chunks_follow_from_the_first_frame_of_each():
    assert [first_frame(GEOMETRY, i) for i in range(4)] == [0, 3, 8, 13]
    assert [chunk_frames(GEOMETRY, i) for i in range(3)] == [3, 5, 5]
    assert sum(chunk_frames(GEOMETRY, i) for i in range(7)) == first_frame(GEOMETRY, 7)


def _chunk(index: int) -> ChunkInFlight:
    return ChunkInFlight(index, 1, ChunkEvents(), None, 0)


def test_phase_end_reason_and_frames_are_derived_from_the_records():
    stop: list[str] = []
    s = EngineSession("s", GEOMETRY, stop_reason=lambda: stop[0] if stop else None)
    assert (s.phase, s.end_reason, s.in_progress, s.frames_done) == (Phase.NEW, None, None, 0)
    s.opened = True
    assert s.phase is Phase.BOUNDARY
    s.chunks[0], s.next_chunk = _chunk(0), 1
    assert (s.phase, s.in_progress) == (Phase.DENOISING, 0)
    for index in range(3):  # each chunk committed, the next begun
        s.decoding[index] = s.chunks.pop(index)
        if index < 2:
            s.chunks[index + 1], s.next_chunk = _chunk(index + 1), index + 2
    assert (s.phase, s.end_reason, s.in_progress, s.frames_done) == (Phase.FINISHING, "completed", None, 13)
    del s.decoding[0]
    s.chunks_done = 1  # chunk 0 delivered
    assert s.frames_done == 13
    stop.append("stopped")  # a stop lands while chunks 1 and 2 decode: they may be cut, so it is stopped
    assert s.end_reason == "stopped"
    del s.decoding[1]  # chunk 1's decode cancelled: its frames count no more
    assert s.frames_done == 3 + 5
    del s.decoding[2]
    s.chunks_done = 1
    assert s.frames_done == 3
    s.chunks_done = 3  # had they all been delivered anyway, it completed
    assert s.end_reason == "completed"
    s.failure = "boom"
    assert s.end_reason == "failed"


def test_a_stop_that_lands_after_the_last_commit_and_cuts_the_decodes_ends_the_session_stopped():
    """The last chunk committed (the session finishing as completed), then a stop
    cut the decodes still out: the session ends stopped, not completed with
    chunks missing. (With the stop kept apart from the loop's record of the
    ending, ``SessionDone`` said completed with none of the 3 chunks.)"""
    engine = Engine()
    session = engine.commit_every_chunk()
    assert (session.phase, session.end_reason) == (Phase.FINISHING, "completed")
    engine.control.handle(StopSession(session_id="s"))
    assert session.end_reason == "stopped"  # the stop flag is read, not copied at the next drain
    while engine.executor.decodes:
        engine.executor.decode()  # the runner cancels a stopping session's decode
    engine.turn()
    engine.step()  # the release
    (done,) = engine.of(SessionDone)
    assert (done.stopped, done.reason, done.chunks, done.frames) == (True, "stopped", 0, 0)
    assert engine.runner.held_sessions() == ((), ())


def test_a_stop_after_every_chunk_was_delivered_leaves_the_session_completed():
    engine = Engine()
    engine.commit_every_chunk()
    while engine.executor.decodes:
        engine.executor.decode()
    engine.turn()
    engine.control.handle(StopSession(session_id="s"))  # lands before the release came back
    engine.step()
    (done,) = engine.of(SessionDone)
    assert (done.stopped, done.reason, done.chunks, done.frames) == (False, "completed", 3, 13)


def test_frames_done_counts_only_the_chunks_delivered_once_a_decode_was_abandoned():
    """Chunk 0 delivered; a stop; chunk 1's decode abandoned; chunk 2's decode came
    back whole (it was past its last abandon point), and is not delivered after
    the gap. ``SessionDone.frames`` are the delivered chunks' frames. (Kept by
    ``+=`` at commit and ``-=`` at a cancelled decode, they counted chunk 2's.)"""
    engine = Engine()
    engine.commit_every_chunk()
    engine.executor.decode()
    engine.turn()
    engine.control.handle(StopSession(session_id="s"))
    engine.executor.decode()  # cancelled: the session is stopping
    (delivered,) = engine.of(ChunkReady)
    frames = ChunkOutput(num_frames=5, width=8, height=8, payload=bytes(5 * 8 * 8 * 3))
    engine.executor.answer(DecodeResult("s", 2, frames, 1.0))
    engine.turn()
    engine.step()
    (done,) = engine.of(SessionDone)
    assert [c.generation_chunk_index for c in engine.of(ChunkReady)] == [0]
    assert (done.stopped, done.chunks, done.frames) == (True, 1, delivered.num_frames)


@pytest.mark.parametrize("steps", [1, 2])
def test_where_an_interaction_lands_is_read_from_the_loops_record(steps):
    """``InteractionQueued`` says the loop's next chunk at every point: before the
    loop took the session, with a chunk's boundary planned, mid-chunk, and once
    the next boundary is taken in the turn that collects the commit."""
    engine = Engine()
    engine.control.handle(StartSession(session_id="s", prompt="p", num_chunks=3, num_inference_steps=steps))
    queued = engine.interact("before")
    assert (queued.in_progress_chunk_index, queued.expected_chunk_index) == (None, 0)
    engine.turn()  # chunk 0's boundary is taken, its first step submitted
    session = engine.loop.sessions["s"]
    marks = []
    while session.next_chunk < 3:
        queued = engine.interact(f"e{len(marks)}")
        marks.append((queued.in_progress_chunk_index, queued.expected_chunk_index))
        assert marks[-1] == (session.in_progress, session.next_chunk)
        engine.step()
    assert marks == [(k, k + 1) for k in range(2) for _ in range(steps)]
    engine.control.handle(SubmitInteraction(session_id="s", event_id="late", interaction=Interaction(prompt="q")))
    rejected = engine.of(InteractionRejected)[-1]
    assert (rejected.event_id, rejected.code) == ("late", "interaction_too_late")
