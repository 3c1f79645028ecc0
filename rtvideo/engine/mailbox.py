"""The interaction mailbox of one session.

Owned by the worker's ``ControlPlane``: ``offer`` runs on the control-receiver
thread the moment a ``SubmitInteraction`` arrives, ``take`` runs on the loop
thread at the session's next chunk boundary; the control plane's lock guards
both. Pure Python, no I/O.

Rules:
- last write wins per boundary: a newer offer replaces the pending one, which
  is returned as superseded so the caller reports it;
- ``event_id`` is an idempotency key within a window: the same id with the
  same body is a duplicate (no change), with another body a conflict, while
  it is one of the session's last ``EVENT_ID_WINDOW`` live ids (or one of its
  scheduled ones, kept for the session's life). An id older than that is
  forgotten: sent again, it is a new interaction. So a session's record of
  ids stays bounded however long it runs;
- scheduled interactions (request mode, replay) wait for their chunk; a live
  offer pending at that boundary wins over them.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import Generic, TypeVar

from rtvideo.engine.messages import Interaction, ScheduledInteraction

EVENT_ID_WINDOW = 1024
"""How many of a session's newest event ids are remembered: by the mailbox,
to deduplicate, and by the API process, to say which controller sent one."""

V = TypeVar("V")


class IdWindow(Generic[V]):
    """The newest ``size`` ids, each with a value, in the order first seen; a
    new id past ``size`` makes the oldest one forgotten. Not thread-safe (its
    owner's lock guards it)."""

    def __init__(self, size: int = EVENT_ID_WINDOW) -> None:
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        self.size = size
        self._items: OrderedDict[str, V] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: str) -> bool:
        return key in self._items

    def get(self, key: str, default: V | None = None) -> V | None:
        return self._items.get(key, default)

    def setdefault(self, key: str, value: V) -> V:
        """The value kept for ``key``, or ``value``, kept as the newest id when it was not known."""
        if key in self._items:
            return self._items[key]
        self._items[key] = value
        if len(self._items) > self.size:
            self._items.popitem(last=False)
        return value


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
    reported or not (they complete, without starting, at this boundary; the
    newest ``EVENT_ID_WINDOW`` of them, each already reported superseded)."""

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
        self._seen: IdWindow[Interaction] = IdWindow(EVENT_ID_WINDOW)  # live offers, the newest ids
        self._scheduled_ids: dict[str, Interaction] = {}  # bounded by the request's interactions
        self._pending: PendingInteraction | None = None
        # Superseded since the last take: the newest EVENT_ID_WINDOW of them (a held session may gather many).
        self._retired: deque[str] = deque(maxlen=EVENT_ID_WINDOW)
        self._scheduled: dict[int, PendingInteraction] = {}
        for item in scheduled:
            self._scheduled_ids[item.event_id] = item.interaction
            self._scheduled[item.at_chunk] = self._resolve(item.event_id, item.interaction, now)

    @property
    def remembered_ids(self) -> int:
        """How many event ids it knows now: at most ``EVENT_ID_WINDOW`` live ones, and the scheduled ones."""
        return len(self._seen) + len(self._scheduled_ids)

    def offer(self, event_id: str, interaction: Interaction, now: float) -> OfferResult:
        """Accept ``interaction`` for the next boundary (last write wins), unless
        ``event_id`` is known (a duplicate or a conflict: nothing changes). The
        pending offer is always the newest id, so never forgotten while it waits."""
        known = self._scheduled_ids.get(event_id)
        if known is None:
            known = self._seen.get(event_id)
        if known is not None:
            status = OfferStatus.DUPLICATE if known == interaction else OfferStatus.CONFLICT
            return OfferResult(status)
        self._seen.setdefault(event_id, interaction)
        superseded, self._pending = self._pending, self._resolve(event_id, interaction, now)
        if superseded is not None:
            self._retired.append(superseded.event_id)
        return OfferResult(OfferStatus.QUEUED, superseded)

    def take(self, chunk_index: int) -> TakeResult:
        """Remove what applies at the boundary before ``chunk_index``."""
        scheduled = self._scheduled.pop(chunk_index, None)
        pending, self._pending = self._pending, None
        retired = list(self._retired)
        self._retired.clear()
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
