"""The stream-batch scheduler's task lists, through the real engine loop, over a
scripted run in which sessions join and leave (in-process and pure: a ring
that answers each micro-step as the ranks would, with the rows that come back
round it; the ranks themselves are covered by tests/engine/test_pipeline_parallel.py)."""

from __future__ import annotations

import pytest

from rtvideo.engine.config import EngineConfig
from rtvideo.engine.control import ControlPlane
from rtvideo.engine.loop import EngineLoop
from rtvideo.engine.messages import (
    ChunkReady,
    Interaction,
    InteractionApplied,
    InteractionQueued,
    Playback,
    SessionDone,
    StartSession,
    StopSession,
    SubmitInteraction,
)
from rtvideo.engine.pacing import Playhead
from rtvideo.engine.plan import ChunkOutput, MicroStep, StepResult
from rtvideo.engine.session import chunk_frames
from rtvideo.engine.stream_batch import StreamBatchScheduler
from rtvideo.workers.pipelines.stub import StubPipeline


class SimulatedRing:
    """An executor whose micro-steps finish at once, with the results a ring
    would give: the rows in ``returning`` come back (their sampler step ran,
    or their commit finished and the chunk decoded: blank frames at the size
    ``describe`` gives the session)."""

    depth = 1

    def __init__(self, describe) -> None:
        self.describe = describe
        self.geometry: dict = {}
        self.plans: list[MicroStep] = []
        self._done: list[StepResult] = []
        self.open: set[str] = set()
        self.wake = lambda: None  # the control plane's, as the executor's on_result

    def submit(self, step: MicroStep) -> None:
        self.plans.append(step)
        result = StepResult(step.number)
        for sid in step.release:
            self.open.discard(sid)
            result.released.append(sid)
        for start in step.open:
            self.open.add(start.session_id)
            self.geometry[start.session_id] = self.describe(start)
            result.row(start.session_id, 0)
        for task in step.boundaries:
            result.row(task.session_id, task.chunk_index)
        for row in step.returning:
            out = result.row(row.session_id, row.chunk_index)
            if row.commit:
                out.committed = True
                g = self.geometry[row.session_id]
                frames = chunk_frames(g, row.chunk_index)
                out.chunk = ChunkOutput(frames, g.width, g.height, bytes(frames * g.width * g.height * 3))
            else:
                out.stepped = True
        self._done.append(result)
        self.wake()

    def results(self):
        done, self._done = self._done, []
        return done

    def in_flight(self) -> int:
        return len(self._done)

    def executing_s(self) -> float:
        return 0.0

    def held_sessions(self):
        return tuple(self.open), tuple(self.open)

    def rank_figures(self):
        return ()

    def close(self) -> None:
        pass


def make_loop(ranks: int, max_rows: int, **options):
    # no client reports delivery here: an unbounded undelivered budget
    config = EngineConfig(max_sessions=8, pp=ranks, max_undelivered_seconds=1e9, **options)
    sent: list = []
    describe = StubPipeline().describe
    control = ControlPlane(config, describe, sent.append)
    ring = SimulatedRing(describe)
    ring.wake = control.wake
    loop = EngineLoop(config, control, ring, sent.append, grouping=True, max_rows=max_rows)
    return loop, control, ring, sent


def run_until_done(loop, control, limit: int = 5000, each=None) -> None:
    for number in range(limit):
        if each is not None:
            each(number)
        loop.run_once()
        if not loop.sessions and not control.open_sessions():
            return
    raise AssertionError("the sessions never ended")


def check_ring(plans: list[MicroStep], ranks: int, lookahead: int = 1) -> None:
    """Every micro-step: rank r runs what rank r-1 ran the micro-step before, the
    rows coming back are what the last rank ran, a rank never holds two rows of
    one session, a chunk has one pass in the ring at a time, and a chunk's
    passes run in order: its steps, then its commit once every step came back.
    Exact (``lookahead`` 1): a session has one pass in the ring, and its next
    chunk's boundary comes once the commit came back. Stream batch: at most
    ``lookahead`` chunks of a session in flight, and a chunk's passes never
    overtake the chunk's before it (so chunks commit in order)."""
    previous = MicroStep(number=0, ranks=[[] for _ in range(ranks)])
    back: dict[tuple[str, int], int] = {}  # (session, chunk) -> step of its latest pass that came back
    entered: dict[tuple[str, int], int] = {}  # (session, chunk) -> passes that entered
    committed: dict[str, int] = {}  # session -> its latest chunk whose commit came back
    for step in plans:
        assert len(step.ranks) == ranks
        assert step.number == previous.number + 1, "micro-steps are consecutive"
        for r in range(1, ranks):
            assert step.ranks[r] == previous.ranks[r - 1]
        assert step.returning == previous.ranks[ranks - 1]
        for row in step.returning:
            back[row.session_id, row.chunk_index] = row.step
            if row.commit:
                assert committed.get(row.session_id, -1) == row.chunk_index - 1, "chunks commit in order"
                committed[row.session_id] = row.chunk_index
        for rows in step.ranks:
            on_rank = [row.session_id for row in rows]
            assert len(on_rank) == len(set(on_rank)), f"a rank holds two rows of a session at {step.number}"
        in_ring = [(row.session_id, row.chunk_index) for rows in step.ranks for row in rows]
        assert len(in_ring) == len(set(in_ring)), f"a chunk has two passes in the ring at {step.number}"
        if lookahead == 1:
            sessions = [sid for sid, _ in in_ring]
            assert len(sessions) == len(set(sessions)), f"a session has two passes in the ring at {step.number}"
        boundaries = {task.session_id: task.chunk_index for task in step.boundaries}
        for row in step.ranks[0]:
            sid, chunk = row.session_id, row.chunk_index
            if sid in boundaries:
                assert (chunk, row.step) == (boundaries[sid], 0)
                in_flight = chunk - committed.get(sid, -1)  # this one included
                assert in_flight <= lookahead, f"{in_flight} chunks of {sid} in flight at {step.number}"
            else:
                assert back.get((sid, chunk)) == row.step - 1, f"pass {row} entered before the one before it came back"
            ahead = entered.get((sid, chunk - 1))
            if chunk - 1 > committed.get(sid, -1):  # the chunk before is still in flight
                assert ahead is not None and ahead > row.step, f"pass {row} overtook chunk {chunk - 1}"
            entered[sid, chunk] = row.step + 1
        assert not set(step.release) & {sid for sid, _ in in_ring}, "a session released with a pass in the ring"
        previous = step


@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("max_rows", [1, 2, 4])
def test_task_lists_over_a_run_with_sessions_joining_and_leaving(ranks, max_rows):
    loop, control, ring, sent = make_loop(ranks, max_rows)
    control.handle(StartSession(session_id="a", prompt="a", num_chunks=3, num_inference_steps=2))
    control.handle(StartSession(session_id="b", prompt="b", num_chunks=4, num_inference_steps=3))

    def script(number: int) -> None:
        if number == 7:  # joins while a and b are in the ring
            control.handle(StartSession(session_id="c", prompt="c", num_chunks=2, num_inference_steps=1))
        if number == 12:
            control.handle(StartSession(session_id="d", prompt="d", num_chunks=None, num_inference_steps=4))
        if number == 40:  # leaves mid-chunk, with a pass in the ring
            control.handle(StopSession(session_id="d"))

    run_until_done(loop, control, each=script)
    check_ring(ring.plans, ranks)
    done = {m.session_id: m for m in sent if isinstance(m, SessionDone)}
    assert {sid: d.chunks for sid, d in done.items() if d.reason == "completed"} == {"a": 3, "b": 4, "c": 2}
    assert done["d"].reason == "stopped"
    chunks = [(m.session_id, m.generation_chunk_index) for m in sent if isinstance(m, ChunkReady)]
    for sid, count in (("a", 3), ("b", 4), ("c", 2)):
        assert [c for s, c in chunks if s == sid] == list(range(count))
    assert ring.open == set()


def test_sessions_of_their_own_fill_every_rank():
    """With as many sessions as ranks, both ranks have a row in all but the
    micro-steps around a chunk boundary (the next chunk begins once the commit
    came back: one micro-step per chunk and session), each a different session's."""
    loop, control, ring, _ = make_loop(ranks=2, max_rows=1)
    for sid in ("a", "b"):
        control.handle(StartSession(session_id=sid, prompt=sid, num_chunks=1000, num_inference_steps=4))
    for _ in range(200):
        loop.run_once()
    check_ring(ring.plans, 2)
    steady = ring.plans[2:]
    for rank in (0, 1):
        busy = sum(bool(step.ranks[rank]) for step in steady) / len(steady)
        assert busy >= 0.8, f"rank {rank} busy {busy:.2f}"


@pytest.mark.parametrize("max_rows", [2, 4])
def test_rows_to_spare_do_not_herd_the_sessions_into_one_micro_step(max_rows):
    """Four sessions on two ranks, up to ``max_rows`` rows a micro-step: they
    enter two at a time, alternating, so both ranks work in every micro-step.
    (Entering all four at once, they came back together and each rank worked
    every other micro-step: measured, rank 0's bubble 43 %.)"""
    loop, control, ring, _ = make_loop(ranks=2, max_rows=max_rows)
    for sid in ("a", "b", "c", "d"):
        control.handle(StartSession(session_id=sid, prompt=sid, num_chunks=1000, num_inference_steps=4))
    for _ in range(200):
        loop.run_once()
    check_ring(ring.plans, 2)
    steady = ring.plans[2:]
    assert max(len(step.ranks[0]) for step in steady) == 2
    for rank in (0, 1):
        busy = sum(bool(step.ranks[rank]) for step in steady) / len(steady)
        assert busy >= 0.95, f"rank {rank} busy {busy:.2f}"


def test_one_session_alone_enters_every_ranks_micro_steps():
    """Exact: one session has one pass in the ring, so it enters rank 0 once per
    ``ranks`` micro-steps (the bubble that sessions of their own, or stream
    batch, fill)."""
    loop, control, ring, _ = make_loop(ranks=3, max_rows=4)
    control.handle(StartSession(session_id="a", prompt="a", num_chunks=2, num_inference_steps=2))
    run_until_done(loop, control)
    check_ring(ring.plans, 3)
    entries = [step.number for step in ring.plans if step.ranks[0]]
    gaps = {b - a for a, b in zip(entries, entries[1:], strict=False)}
    assert min(gaps) == 3  # never sooner than round the ring


def test_an_interaction_applies_at_the_next_chunk_that_enters_rank_0():
    loop, control, ring, sent = make_loop(ranks=2, max_rows=1)
    control.handle(StartSession(session_id="a", prompt="a", num_chunks=5, num_inference_steps=2))
    for _ in range(4):
        loop.run_once()  # chunk 0 is in the ring
    control.handle(SubmitInteraction(session_id="a", event_id="e", interaction=Interaction(prompt="new")))
    run_until_done(loop, control)
    applied = [m for m in sent if isinstance(m, InteractionApplied)]
    assert [m.generation_chunk_index for m in applied] == [1]
    entering = [b for step in ring.plans for b in step.boundaries if b.prompt == "new"]
    assert [b.chunk_index for b in entering] == [1]


def test_the_scheduler_refuses_a_single_rank():
    with pytest.raises(ValueError, match="ranks must be >= 2"):
        StreamBatchScheduler(1, grouping=True, max_rows=1)


@pytest.mark.parametrize("ranks", [2, 3])
def test_stream_batch_fills_every_rank_with_one_session(ranks):
    """Stream batch: one session's next chunk enters while the chunk before is
    still in the ring, so one session keeps every rank busy; chunks still commit
    and arrive in order, never more than ``ranks`` in flight."""
    loop, control, ring, sent = make_loop(ranks, max_rows=1, stream_batch=True)
    control.handle(StartSession(session_id="a", prompt="a", num_chunks=12, num_inference_steps=3))
    run_until_done(loop, control)
    check_ring(ring.plans, ranks, lookahead=ranks)
    chunks = [m.generation_chunk_index for m in sent if isinstance(m, ChunkReady)]
    assert chunks == list(range(12))
    steady = ring.plans[ranks : len(ring.plans) - 4 * ranks]
    for rank in range(ranks):
        busy = sum(bool(step.ranks[rank]) for step in steady) / len(steady)
        assert busy >= 0.9, f"rank {rank} busy {busy:.2f}"


def test_exact_one_session_leaves_ranks_idle_that_stream_batch_fills():
    """The same run without stream batch: one pass in the ring, so each rank is
    busy only one micro-step in ``ranks`` (the bubble stream batch fills)."""
    loop, control, ring, _ = make_loop(2, max_rows=1)
    control.handle(StartSession(session_id="a", prompt="a", num_chunks=12, num_inference_steps=3))
    run_until_done(loop, control)
    check_ring(ring.plans, 2)
    busy = sum(bool(step.ranks[0]) for step in ring.plans) / len(ring.plans)
    assert busy <= 0.55


def test_stream_batch_bounds_chunks_in_flight_and_reports_them_with_an_interaction():
    """With ``max_chunks_in_flight`` 2 on 3 ranks, no more than 2 chunks of the
    session are in flight; an interaction lands at the chunk its queued answer
    promised, and its applied answer says 2 chunks were under way."""
    loop, control, ring, sent = make_loop(3, max_rows=1, stream_batch=True, max_chunks_in_flight=2)
    control.handle(StartSession(session_id="a", prompt="a", num_chunks=10, num_inference_steps=2))
    for _ in range(12):
        loop.run_once()  # chunks under way
    control.handle(SubmitInteraction(session_id="a", event_id="e", interaction=Interaction(prompt="new")))
    run_until_done(loop, control)
    check_ring(ring.plans, 3, lookahead=2)
    queued = next(m for m in sent if isinstance(m, InteractionQueued))
    applied = next(m for m in sent if isinstance(m, InteractionApplied))
    assert applied.generation_chunk_index == queued.expected_chunk_index
    assert applied.chunks_in_flight == 2
    assert [m.generation_chunk_index for m in sent if isinstance(m, ChunkReady)] == list(range(10))


def test_a_session_that_resets_on_a_prompt_change_runs_exact_under_stream_batch():
    loop, control, ring, _ = make_loop(2, max_rows=1, stream_batch=True)
    control.handle(StartSession(session_id="a", prompt="a", num_chunks=4, num_inference_steps=2, prompt_change="reset"))
    run_until_done(loop, control)
    check_ring(ring.plans, 2, lookahead=1)


def test_stream_batch_needs_pipeline_ranks():
    with pytest.raises(ValueError, match="stream_batch needs pp >= 2"):
        EngineConfig(stream_batch=True)


def test_pacing_holds_a_stream_batch_session_before_it_begins_a_chunk_never_in_one():
    """A session ahead of its viewer is held before its next chunk begins (the
    chunks under way count as made), while the chunk it has in the ring goes on."""
    loop, control, ring, _ = make_loop(2, max_rows=1, stream_batch=True)
    control.handle(StartSession(session_id="a", prompt="a", num_chunks=10, num_inference_steps=2, max_lead_seconds=0.2))
    loop.run_once()  # chunk 0 (the stub's 4 frames: 0.25 s at 16 fps) entered rank 0
    session = loop.sessions["a"]
    assert session.next_pass(loop.scheduler.busy_chunks("a")) == 1  # chunk 1 could begin now
    viewer_at_start = {"a": Playhead(reported=0.0, delivered=None)}
    assert loop._paced(viewer_at_start)[0] == {"a"}
    caught_up = {"a": Playhead(reported=0.1, delivered=None)}  # lead 0.15 s < 0.2 s
    assert loop._paced(caught_up)[0] == set()
    control.handle(Playback(session_id="a", position_seconds=0.0))  # the viewer has seen nothing yet
    for _ in range(4):
        loop.run_once()
    entered = [(row.chunk_index, row.step) for step in ring.plans for row in step.ranks[0]]
    assert entered == [(0, 0), (0, 1), (0, 2)]  # chunk 0 ran to its commit; chunk 1 never began
