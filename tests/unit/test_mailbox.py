"""The mailbox rules, without threads or processes."""

from __future__ import annotations

import pytest

from rtvideo.engine.mailbox import EVENT_ID_WINDOW, IdWindow, InteractionMailbox, OfferStatus
from rtvideo.engine.messages import Interaction, ScheduledInteraction


def test_last_write_wins_and_returns_the_superseded_one():
    box = InteractionMailbox(default_transition_chunks=0)
    assert box.offer("a", Interaction(prompt="A"), now=1.0).superseded is None
    second = box.offer("b", Interaction(prompt="B"), now=2.0)
    assert second.status is OfferStatus.QUEUED and second.superseded.event_id == "a"
    taken = box.take(0)
    assert taken.applied.event_id == "b" and taken.applied.queued_at == 2.0
    assert taken.superseded == [] and taken.retired == ["a"]
    empty = box.take(1)
    assert empty.applied is None and empty.retired == []


def test_event_ids_are_idempotency_keys_for_the_whole_session():
    box = InteractionMailbox(default_transition_chunks=0)
    box.offer("a", Interaction(prompt="A"), now=0.0)
    assert box.offer("a", Interaction(prompt="A"), now=1.0).status is OfferStatus.DUPLICATE
    assert box.offer("a", Interaction(prompt="other"), now=1.0).status is OfferStatus.CONFLICT
    assert box.offer("a", Interaction(prompt="A", transition_chunks=3), now=1.0).status is OfferStatus.CONFLICT
    box.take(0)
    # Still known after it applied: a replayed message does not apply twice.
    assert box.offer("a", Interaction(prompt="A"), now=2.0).status is OfferStatus.DUPLICATE
    assert box.take(1).applied is None


def test_the_session_default_transition_fills_in():
    box = InteractionMailbox(default_transition_chunks=3)
    box.offer("a", Interaction(prompt="A"), now=0.0)
    assert box.take(0).applied.transition_chunks == 3
    box.offer("b", Interaction(prompt="B", transition_chunks=0), now=0.0)
    assert box.take(1).applied.transition_chunks == 0


def test_scheduled_interactions_wait_for_their_chunk_and_yield_to_live_ones():
    scheduled = [
        ScheduledInteraction(at_chunk=2, event_id="s2", interaction=Interaction(prompt="two")),
        ScheduledInteraction(at_chunk=4, event_id="s4", interaction=Interaction(prompt="four")),
    ]
    box = InteractionMailbox(default_transition_chunks=0, scheduled=scheduled)
    assert box.take(0).applied is None and box.take(1).applied is None
    assert box.take(2).applied.event_id == "s2"
    box.offer("live", Interaction(prompt="live"), now=0.0)
    taken = box.take(4)
    assert taken.applied.event_id == "live"
    assert [(old.event_id, by) for old, by in taken.superseded] == [("s4", "live")]
    assert taken.retired == ["s4"]
    assert box.offer("s2", Interaction(prompt="two"), now=0.0).status is OfferStatus.DUPLICATE


def test_drain_returns_everything_unapplied():
    box = InteractionMailbox(
        default_transition_chunks=0,
        scheduled=[ScheduledInteraction(at_chunk=9, event_id="later", interaction=Interaction(prompt="x"))],
    )
    box.offer("live", Interaction(prompt="y"), now=0.0)
    assert sorted(p.event_id for p in box.drain()) == ["later", "live"]
    assert box.drain() == [] and box.take(9).applied is None


def test_a_repeat_inside_the_window_is_still_a_duplicate_and_the_record_stays_bounded():
    """10,000 ids: the mailbox remembers the newest EVENT_ID_WINDOW of them (and the
    scheduled ones, for the whole session); a repeat of one of those is a duplicate
    or a conflict as before; an id older than the window is forgotten, so sent
    again it is a new interaction."""
    scheduled = [ScheduledInteraction(at_chunk=10**6, event_id="s", interaction=Interaction(prompt="S"))]
    box = InteractionMailbox(default_transition_chunks=0, scheduled=scheduled)
    for i in range(10_000):
        assert box.offer(f"e{i}", Interaction(prompt=f"p{i}"), now=float(i)).status is OfferStatus.QUEUED
        if i % 7 == 0:
            box.take(i)
    assert box.remembered_ids == EVENT_ID_WINDOW + 1  # the window and the one scheduled id
    newest = 10_000 - EVENT_ID_WINDOW
    assert box.offer(f"e{newest}", Interaction(prompt=f"p{newest}"), now=0.0).status is OfferStatus.DUPLICATE
    assert box.offer("e9999", Interaction(prompt="p9999"), now=0.0).status is OfferStatus.DUPLICATE
    assert box.offer("e9999", Interaction(prompt="other"), now=0.0).status is OfferStatus.CONFLICT
    assert box.offer("s", Interaction(prompt="S"), now=0.0).status is OfferStatus.DUPLICATE  # scheduled: kept
    forgotten = box.offer(f"e{newest - 1}", Interaction(prompt="again"), now=0.0)
    assert forgotten.status is OfferStatus.QUEUED and forgotten.superseded.event_id == "e9999"
    assert box.remembered_ids == EVENT_ID_WINDOW + 1


def test_the_ids_superseded_while_a_session_is_held_are_bounded_too():
    box = InteractionMailbox(default_transition_chunks=0)
    for i in range(3 * EVENT_ID_WINDOW):  # a held session: no boundary meanwhile
        box.offer(f"e{i}", Interaction(prompt="p"), now=0.0)
    taken = box.take(0)
    assert taken.applied.event_id == f"e{3 * EVENT_ID_WINDOW - 1}"
    assert taken.retired == [f"e{i}" for i in range(2 * EVENT_ID_WINDOW - 1, 3 * EVENT_ID_WINDOW - 1)]


def test_an_id_window_forgets_its_oldest_id_first():
    window: IdWindow[str] = IdWindow(3)
    for key in "abcd":
        assert window.setdefault(key, key.upper()) == key.upper()
    assert len(window) == 3 and "a" not in window and window.get("a") is None
    assert window.setdefault("b", "other") == "B"  # known: kept, not moved
    window.setdefault("e", "E")
    assert "b" not in window and [window.get(k) for k in "cde"] == ["C", "D", "E"]
    with pytest.raises(ValueError, match="size must be >= 1"):
        IdWindow(0)
