"""Round-robin selection and step grants."""

from __future__ import annotations

from engine.messages import SessionGeometry
from engine.scheduler import ChunkScheduler
from engine.session import ChunkEvents, ChunkInFlight, EngineSession, Phase

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
    return [EngineSession(i, GEOMETRY, phase=Phase.BOUNDARY) for i in ids]


def test_round_robin_one_row_at_a_time():
    scheduler = ChunkScheduler(grouping=True, max_rows=1)
    pool = sessions("a", "b", "c")
    picks = [scheduler.select(pool)[0].session_id for _ in range(7)]
    assert picks == ["a", "b", "c", "a", "b", "c", "a"]


def test_round_robin_with_several_rows_and_a_finishing_session():
    scheduler = ChunkScheduler(grouping=True, max_rows=2)
    pool = sessions("a", "b", "c")
    assert [s.session_id for s in scheduler.select(pool)] == ["a", "b"]
    pool[0].phase = Phase.FINISHING
    assert [s.session_id for s in scheduler.select(pool)] == ["c", "b"]
    assert scheduler.select([]) == []


def _begin(session: EngineSession, planned: int) -> None:
    """Give ``session`` a chunk in flight with ``planned`` of its 3 steps planned."""
    session.phase = Phase.DENOISING
    session.next_chunk = 1
    session.chunks[0] = ChunkInFlight(
        index=0, steps=3, first_frame=0, events=ChunkEvents(), boundary=None, boundary_step=1, planned=planned
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
