"""Round-robin selection and step grants."""

from __future__ import annotations

import msgspec

from rtvideo.engine.messages import SessionGeometry
from rtvideo.engine.scheduler import ChunkScheduler
from rtvideo.engine.session import ChunkEvents, ChunkInFlight, EngineSession, Phase

GEOMETRY = SessionGeometry(
    width=8,
    height=8,
    fps=16.0,
    num_inference_steps=3,
    first_chunk_frames=4,
    frames_per_chunk=4,
    num_chunks=None,
    transition_chunks=0,
)


def sessions(*ids: str) -> list[EngineSession]:
    return [EngineSession(i, GEOMETRY, opened=True) for i in ids]


def test_round_robin_one_row_at_a_time():
    scheduler = ChunkScheduler(grouping=True, max_rows=1)
    pool = sessions("a", "b", "c")
    picks = [scheduler.select(pool)[0].session_id for _ in range(7)]
    assert picks == ["a", "b", "c", "a", "b", "c", "a"]


def test_round_robin_with_several_rows_and_a_finishing_session():
    scheduler = ChunkScheduler(grouping=True, max_rows=2)
    pool = sessions("a", "b", "c")
    assert [s.session_id for s in scheduler.select(pool)] == ["a", "b"]
    pool[0].stop_reason = lambda: "stopped"  # a stop came: it is finishing
    assert pool[0].phase is Phase.FINISHING
    assert [s.session_id for s in scheduler.select(pool)] == ["c", "b"]
    assert scheduler.select([]) == []


def _begin(session: EngineSession, planned: int) -> None:
    """Give ``session`` a chunk in flight with ``planned`` of its 3 steps planned."""
    session.next_chunk = 1
    session.chunks[0] = ChunkInFlight(
        index=0, steps=3, events=ChunkEvents(), boundary=None, boundary_step=1, planned=planned
    )


def test_grouping_runs_a_begun_chunk_back_to_back_and_ungrouped_takes_turns():
    grouped, ungrouped = ChunkScheduler(grouping=True, max_rows=1), ChunkScheduler(grouping=False, max_rows=1)
    for scheduler in (grouped, ungrouped):
        pool = sessions("a", "b")
        _begin(pool[0], planned=1)  # a's chunk has begun
        assert scheduler.select(pool)[0].session_id == "a"
        pool[0].chunks[0].planned += 1
        second = scheduler.select(pool)[0].session_id
        assert second == ("a" if scheduler.grouping else "b")


def test_a_chunk_whose_steps_are_all_planned_waits_for_its_results():
    pool = sessions("a")
    _begin(pool[0], planned=3)
    assert ChunkScheduler(grouping=True, max_rows=2).select(pool) == []  # its boundary waits for chunk 0 to return


def _simulate(scheduler: ChunkScheduler, pool: list[EngineSession], arrive: dict[str, int], micro_steps: int):
    """Drive ``scheduler`` as the loop does, one micro-step at a time (each
    micro-step's results back before the next is planned): a chosen session
    begins a chunk or plans its next step; a chunk whose steps are all planned
    commits in that micro-step. Sessions join at their ``arrive`` micro-step.
    Returns, per session, the micro-steps in which its chunks began and ended."""
    began: dict[str, list[int]] = {s.session_id: [] for s in pool}
    ended: dict[str, list[int]] = {s.session_id: [] for s in pool}
    for number in range(micro_steps):
        present = [s for s in pool if arrive[s.session_id] <= number]
        for session in scheduler.select(present):
            if not session.chunks:
                index = session.next_chunk
                session.next_chunk += 1
                session.chunks[index] = ChunkInFlight(
                    index=index, steps=3, events=ChunkEvents(), boundary=None, boundary_step=number
                )
                began[session.session_id].append(number)
            chunk = next(iter(session.chunks.values()))
            chunk.planned += 1
            if chunk.all_planned:
                del session.chunks[chunk.index]
                ended[session.session_id].append(number)
    return began, ended


def test_aligned_sessions_that_came_in_apart_end_their_chunks_together():
    """Four sessions, one a micro-step ahead of the rest: with ``align_chunks``
    the late ones begin their first chunk at once, the early one waits once (a
    step) to begin its second, and from then on every chunk of all four ends in
    the same micro-step; without it the early one stays a step ahead."""
    for align in (True, False):
        pool = sessions("a", "b", "c", "d")
        arrive = {"a": 0, "b": 1, "c": 1, "d": 1}
        began, ended = _simulate(ChunkScheduler(grouping=False, max_rows=4, align_chunks=align), pool, arrive, 20)
        assert began["a"][0] == 0 and all(began[sid][0] == 1 for sid in "bcd")  # a first chunk never waits
        later = [{sid: ended[sid][k] for sid in "abcd"} for k in range(1, 5)]
        if align:
            assert all(len(set(chunk.values())) == 1 for chunk in later)
            assert began["a"][1] - ended["a"][0] == 2  # waited one turn for the others' first chunks
        else:
            assert all(chunk["a"] == chunk["b"] - 1 for chunk in later)


def test_a_session_waits_for_its_partners_at_most_a_chunk_of_turns():
    """A session whose partner is stuck mid-chunk (never scheduled: paced, say)
    begins anyway after a chunk's steps of turns; nor does it wait for a
    partner that is ending, or of another frame size."""
    scheduler = ChunkScheduler(grouping=False, max_rows=4, align_chunks=True)
    a, stuck = sessions("a", "stuck")
    a.next_chunk = 1  # its first chunk is done: a boundary like any other
    _begin(stuck, planned=1)
    waits = 0
    while not scheduler.select([a, stuck], held={"stuck"}):
        waits += 1
    assert waits == GEOMETRY.num_inference_steps
    a2 = EngineSession("a2", GEOMETRY, opened=True, next_chunk=1)
    stuck.stop_reason = lambda: "stopped"
    assert scheduler.select([a2, stuck]) == [a2]
    other = EngineSession("other", msgspec.structs.replace(GEOMETRY, width=16), opened=True)
    other.chunks[0] = stuck.chunks[0]
    a3 = EngineSession("a3", GEOMETRY, opened=True, next_chunk=1)
    assert a3 in scheduler.select([a3, other])
    assert not ChunkScheduler(grouping=False, max_rows=1, align_chunks=True).align_chunks  # one row: nothing to batch
