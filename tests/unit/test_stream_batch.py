"""The stream-batch scheduler's task lists, through the real engine loop, over a
scripted run in which sessions join and leave (in-process and pure: a ring
that answers each micro-step as the ranks would, with the rows that come back
round it; the ranks themselves are covered by tests/engine/test_pipeline_parallel.py)."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.control import ControlPlane
from engine.loop import EngineLoop
from engine.messages import (
    ChunkReady,
    Interaction,
    InteractionApplied,
    SessionDone,
    StartSession,
    StopSession,
    SubmitInteraction,
)
from engine.plan import ChunkOutput, MicroStep, StepResult
from engine.stream_batch import StreamBatchScheduler
from workers.pipelines.stub import StubPipeline


class SimulatedRing:
    """An executor whose micro-steps finish at once, with the results a ring
    would give: the rows in ``returning`` come back (their sampler step ran,
    or their commit finished and the chunk decoded)."""

    depth = 1

    def __init__(self) -> None:
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
            result.row(start.session_id)
        for task in step.boundaries:
            result.row(task.session_id)
        for row in step.returning:
            out = result.row(row.session_id)
            if row.commit:
                out.committed = True
                out.chunk = ChunkOutput(num_frames=1, width=2, height=2, payload=bytes(12))
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


def make_loop(ranks: int, max_rows: int):
    config = EngineConfig(max_sessions=8, pp=ranks, max_undelivered_seconds=1e9)  # no client reports delivery here
    sent: list = []
    control = ControlPlane(config, StubPipeline().describe, sent.append)
    ring = SimulatedRing()
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


def check_ring(plans: list[MicroStep], ranks: int) -> None:
    """Every micro-step: rank r runs what rank r-1 ran the micro-step before, the
    rows coming back are what the last rank ran, a session has one pass in the
    ring at a time, and a chunk's passes run in order: its steps, then its
    commit once every step came back, then the next chunk's boundary once the
    commit came back."""
    previous = MicroStep(number=0, ranks=[[] for _ in range(ranks)])
    back: dict[str, tuple[int, int]] = {}  # session -> (chunk, step) of its latest pass that came back
    for step in plans:
        assert len(step.ranks) == ranks
        assert step.number == previous.number + 1, "micro-steps are consecutive"
        for r in range(1, ranks):
            assert step.ranks[r] == previous.ranks[r - 1]
        assert step.returning == previous.ranks[ranks - 1]
        for row in step.returning:
            back[row.session_id] = (row.chunk_index, row.step)
        on_ranks = [row.session_id for rows in step.ranks for row in rows]
        assert len(on_ranks) == len(set(on_ranks)), f"a session has two passes in the ring at {step.number}"
        boundaries = {task.session_id: task.chunk_index for task in step.boundaries}
        for row in step.ranks[0]:
            latest = back.get(row.session_id)
            if row.session_id in boundaries:
                assert (row.chunk_index, row.step) == (boundaries[row.session_id], 0)
                assert latest is None or latest == (row.chunk_index - 1, row.steps_per_chunk), (
                    "next chunk before the commit came back"
                )
            else:
                assert latest == (row.chunk_index, row.step - 1), (
                    f"pass {row} entered before the one before it came back"
                )
        assert not set(step.release) & set(on_ranks), "a session released with a pass in the ring"
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
