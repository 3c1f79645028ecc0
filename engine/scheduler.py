"""The chunk scheduler: which sessions run in the next plan, and for how many steps.

Policy only (loop thread of worker rank 0). Sessions take turns round-robin:
each plan carries up to ``max_rows`` sessions, starting after the last one
served, so no session waits more than ``ceil(n / max_rows)`` plans. With
grouping a row runs every remaining step of its chunk (one chunk per turn);
without, one step (one step per turn). A row never runs past the end of its
chunk, so the boundary always falls between two plans.
"""

from __future__ import annotations

from collections.abc import Iterable

from engine.session import EngineSession, Phase

RUNNABLE = (Phase.NEW, Phase.BOUNDARY, Phase.DENOISING)


class ChunkScheduler:
    def __init__(self, grouping: bool, max_rows: int) -> None:
        if max_rows < 1:
            raise ValueError("max_rows must be >= 1")
        self.grouping = grouping
        self.max_rows = max_rows
        self._last_served: str | None = None

    def select(self, sessions: Iterable[EngineSession], held: set[str] = frozenset()) -> list[EngineSession]:
        """The sessions that run next, in round-robin order after the last served;
        ``held`` sessions (paced) are skipped."""
        runnable = [s for s in sessions if s.phase in RUNNABLE and s.session_id not in held]
        if not runnable:
            return []
        ids = [s.session_id for s in runnable]
        start = ids.index(self._last_served) + 1 if self._last_served in ids else 0
        ordered = runnable[start:] + runnable[:start]
        chosen = ordered[: self.max_rows]
        self._last_served = chosen[-1].session_id
        return chosen

    def steps_for(self, session: EngineSession) -> int:
        """Denoise steps the session's row may run in this plan (>= 1)."""
        remaining = session.steps_per_chunk - session.step_in_chunk
        return remaining if self.grouping else 1
