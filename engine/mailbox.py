"""The interaction mailbox of one session.

Owned by the worker's ``ControlPlane``: ``offer`` runs on the control-receiver
thread the moment a ``SubmitInteraction`` arrives, ``take`` runs on the loop
thread at the session's next chunk boundary; the control plane's lock guards
both. Pure Python, no I/O.

Rules:
- last write wins per boundary: a newer offer replaces the pending one, which
  is returned as superseded so the caller reports it;
- ``event_id`` is an idempotency key for the whole session: the same id with
  the same body is a duplicate (no change), with another body a conflict;
- scheduled interactions (request mode, replay) wait for their chunk; a live
  offer pending at that boundary wins over them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum

from engine.messages import Interaction, ScheduledInteraction


@dataclass(frozen=True)
class PendingInteraction:
    """An accepted interaction waiting for a boundary."""

    event_id: str
    prompt: str
    transition_chunks: int  # resolved: the session default filled in
    queued_at: float  # time.monotonic() at acceptance


class OfferStatus(Enum):
    QUEUED = "queued"
    DUPLICATE = "duplicate"
    CONFLICT = "conflict"


@dataclass(frozen=True)
class OfferResult:
    status: OfferStatus
    superseded: PendingInteraction | None = None  # replaced by this offer


@dataclass(frozen=True)
class TakeResult:
    """What a boundary takes: at most one interaction to apply; the ones this
    take replaced (each with the event id that replaced it, to be reported);
    and the ids of every interaction superseded since the previous take,
    reported or not (they complete, without starting, at this boundary)."""

    applied: PendingInteraction | None
    superseded: list[tuple[PendingInteraction, str]] = field(default_factory=list)
    retired: list[str] = field(default_factory=list)


class InteractionMailbox:
    def __init__(
        self,
        default_transition_chunks: int,
        scheduled: Iterable[ScheduledInteraction] = (),
        now: float = 0.0,
    ) -> None:
        self._default_transition = default_transition_chunks
        self._seen: dict[str, Interaction] = {}
        self._pending: PendingInteraction | None = None
        self._retired: list[str] = []  # superseded since the last take
        self._scheduled: dict[int, PendingInteraction] = {}
        for item in scheduled:
            self._seen[item.event_id] = item.interaction
            self._scheduled[item.at_chunk] = self._resolve(item.event_id, item.interaction, now)

    def offer(self, event_id: str, interaction: Interaction, now: float) -> OfferResult:
        """Accept ``interaction`` for the next boundary (last write wins)."""
        known = self._seen.get(event_id)
        if known is not None:
            status = OfferStatus.DUPLICATE if known == interaction else OfferStatus.CONFLICT
            return OfferResult(status)
        self._seen[event_id] = interaction
        superseded, self._pending = self._pending, self._resolve(event_id, interaction, now)
        if superseded is not None:
            self._retired.append(superseded.event_id)
        return OfferResult(OfferStatus.QUEUED, superseded)

    def take(self, chunk_index: int) -> TakeResult:
        """Remove what applies at the boundary before ``chunk_index``."""
        scheduled = self._scheduled.pop(chunk_index, None)
        pending, self._pending = self._pending, None
        retired, self._retired = self._retired, []
        if pending is None:
            return TakeResult(scheduled, [], retired)
        if scheduled is None:
            return TakeResult(pending, [], retired)
        return TakeResult(pending, [(scheduled, pending.event_id)], [*retired, scheduled.event_id])

    def drain(self) -> list[PendingInteraction]:
        """Remove everything not yet applied (the session is ending)."""
        left = list(self._scheduled.values())
        if self._pending is not None:
            left.append(self._pending)
        self._pending = None
        self._scheduled.clear()
        return left

    def _resolve(self, event_id: str, interaction: Interaction, now: float) -> PendingInteraction:
        transition = interaction.transition_chunks
        return PendingInteraction(
            event_id=event_id,
            prompt=interaction.prompt,
            transition_chunks=self._default_transition if transition is None else transition,
            queued_at=now,
        )
