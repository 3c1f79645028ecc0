"""Round-robin selection and step grants."""

from __future__ import annotations

from engine.messages import SessionGeometry
from engine.scheduler import ChunkScheduler
from engine.session import EngineSession, Phase

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


def test_grouping_grants_the_rest_of_the_chunk_and_ungrouped_one_step():
    [session] = sessions("a")
    session.step_in_chunk = 1
    assert ChunkScheduler(grouping=True, max_rows=1).steps_for(session) == 2
    assert ChunkScheduler(grouping=False, max_rows=1).steps_for(session) == 1
