"""The stream-batch scheduler: per micro-step, the rows of every pipeline rank.

Policy only (loop thread of worker rank 0), for a transformer split over
``ranks`` ranks (``EngineConfig.pp``). A pass (one denoise step of one chunk,
or its commit pass) enters rank 0 in micro-step m, runs on rank r in
micro-step m + r, and is back at rank 0 in micro-step m + ranks, which first
takes it back (the sampler step, or the end of the commit) and may then
start the session's next pass in the same micro-step. So the scheduler keeps
the rows that entered in each of the last ``ranks`` micro-steps: they are
the later ranks' task lists (``place``), and the oldest are the rows coming
back (``MicroStep.returning``).

Which sessions enter (``select``): those with a row to plan (``plannable``),
not held back by pacing, and not in the ring already, up to ``rows`` (the
SLO controller's choice, at most ``max_rows``), round-robin from the session
after the last one served; with grouping, sessions in the middle of a chunk
go first. Rows of *different* sessions fill the ring: with at least
``ranks`` sessions every rank has work in every micro-step. The output is
exact: a session has one pass in the ring at a time, and a chunk begins only
once the chunk before it is in every rank's cache (its boundary is planned
after the commit came back, as with one rank).

``stream_batch`` (``EngineConfig.stream_batch``) is not implemented by this
scheduler: the engine refuses the option until it is.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from engine.plan import StepRow
from engine.session import EngineSession


class StreamBatchScheduler:
    def __init__(self, ranks: int, grouping: bool, max_rows: int) -> None:
        if ranks < 2:
            raise ValueError(f"ranks must be >= 2 (one rank: ChunkScheduler), got {ranks}")
        if max_rows < 1:
            raise ValueError("max_rows must be >= 1")
        self.ranks = ranks
        self.grouping = grouping
        self.max_rows = max_rows
        self.rows = max_rows  # rows entering per micro-step (the SLO controller lowers it)
        self._window: deque[list[StepRow]] = deque([[] for _ in range(ranks)], maxlen=ranks)
        """Rows that entered rank 0 in each of the last ``ranks`` micro-steps, newest first."""
        self._last_served: str | None = None

    def select(self, sessions: Iterable[EngineSession], held: set[str] = frozenset()) -> list[EngineSession]:
        """The sessions whose next row enters rank 0 in the next micro-step."""
        pool = list(sessions)
        ids = [s.session_id for s in pool]
        start = ids.index(self._last_served) + 1 if self._last_served in ids else 0
        busy = self._in_ring(returning=False)
        ordered = [
            s
            for s in pool[start:] + pool[:start]
            if s.plannable() and s.session_id not in held and s.session_id not in busy
        ]
        if not ordered:
            return []
        if self.grouping:
            begun = [s for s in ordered if s.chunk is not None and s.chunk.begun]
            ordered = begun + [s for s in ordered if s not in begun]
        chosen = ordered[: self.rows]
        self._last_served = chosen[-1].session_id
        return chosen

    def place(self, entering: list[StepRow]) -> tuple[list[list[StepRow]], list[StepRow]]:
        """Every rank's rows for the next micro-step, given the rows entering rank
        0, and the rows coming back to rank 0."""
        window = list(self._window)
        return [entering, *window[: self.ranks - 1]], window[self.ranks - 1]

    def advance(self, entering: list[StepRow]) -> None:
        """The micro-step ``place`` laid out was submitted: the ring moves on."""
        self._window.appendleft(list(entering))

    def in_flight(self, session_id: str) -> bool:
        """Whether a pass of the session is in the ring (on a rank, or coming back)."""
        return session_id in self._in_ring(returning=True)

    def _in_ring(self, returning: bool) -> set[str]:
        """Sessions with a pass on a rank; with ``returning``, also the one coming
        back in the next micro-step (it may enter again in that micro-step)."""
        window = list(self._window) if returning else list(self._window)[: self.ranks - 1]
        return {row.session_id for rows in window for row in rows}
