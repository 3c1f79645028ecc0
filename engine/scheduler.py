"""The chunk scheduler: which sessions get a row in the next micro-step.

Policy only (loop thread of worker rank 0). A micro-step carries up to
``max_rows`` rows, one per session: the next denoise step of its chunk, or
the first step of a new chunk (its boundary planned with it). Sessions take
turns round-robin, starting after the last one served, so no session waits
more than ``ceil(n / max_rows)`` micro-steps for its turn.

With grouping, a chunk once begun runs its steps back to back: the sessions
in the middle of a chunk take their rows first, and only the rows left over
begin other chunks. Without grouping every step is a turn of its own. Either
way a row never runs past the end of its chunk, and the next chunk's boundary
is planned only once the previous chunk came back (``EngineSession.plannable``).
"""

from __future__ import annotations

from collections.abc import Iterable

from engine.plan import StepRow
from engine.session import EngineSession


class ChunkScheduler:
    def __init__(self, grouping: bool, max_rows: int) -> None:
        if max_rows < 1:
            raise ValueError("max_rows must be >= 1")
        self.grouping = grouping
        self.max_rows = max_rows
        self._last_served: str | None = None

    def select(self, sessions: Iterable[EngineSession], held: set[str] = frozenset()) -> list[EngineSession]:
        """The sessions that get a row in the next micro-step; ``held`` sessions
        (paced) are skipped."""
        pool = list(sessions)
        ids = [s.session_id for s in pool]
        start = ids.index(self._last_served) + 1 if self._last_served in ids else 0
        ordered = [s for s in pool[start:] + pool[:start] if s.plannable() and s.session_id not in held]
        if not ordered:
            return []
        if self.grouping:
            begun = [s for s in ordered if s.in_mid_chunk()]
            ordered = begun + [s for s in ordered if s not in begun]
        chosen = ordered[: self.max_rows]
        self._last_served = chosen[-1].session_id
        return chosen

    # One rank: a micro-step's rows are all rank 0's, and none is ever in a ring.

    def place(self, entering: list[StepRow]) -> tuple[list[list[StepRow]], list[StepRow]]:
        return [entering], []

    def advance(self, entering: list[StepRow]) -> None:
        pass

    def in_flight(self, session_id: str) -> bool:
        return False

    def busy_chunks(self, session_id: str) -> frozenset[int]:
        return frozenset()

    def finishing_chunks(self, session_id: str) -> frozenset[int]:
        return frozenset()
