"""started / active / completed event ids per chunk."""

from __future__ import annotations

from rtvideo.engine.session import ChunkEvents, EventTracker


def test_hard_cut_starts_and_completes_in_one_chunk():
    t = EventTracker()
    assert t.begin_chunk(0, None, []) == ChunkEvents()
    assert t.begin_chunk(1, ("cut", 0), []) == ChunkEvents(("cut",), ("cut",), ("cut",))
    assert t.begin_chunk(2, None, []) == ChunkEvents()


def test_transition_is_active_over_its_chunks():
    t = EventTracker()
    assert t.begin_chunk(3, ("t", 3), []) == ChunkEvents(("t",), ("t",), ())
    assert t.begin_chunk(4, None, []) == ChunkEvents((), ("t",), ())
    assert t.begin_chunk(5, None, []) == ChunkEvents((), ("t",), ("t",))
    assert t.begin_chunk(6, None, []) == ChunkEvents()


def test_a_new_interaction_completes_the_one_it_interrupts():
    t = EventTracker()
    t.begin_chunk(0, ("slow", 4), [])
    assert t.begin_chunk(1, ("fast", 1), ["dropped"]) == ChunkEvents(("fast",), ("fast",), ("dropped", "slow", "fast"))
