"""The mailbox rules, without threads or processes."""

from __future__ import annotations

from engine.mailbox import InteractionMailbox, OfferStatus
from engine.messages import Interaction, ScheduledInteraction


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
