"""The stream-batch scheduler: per micro-step, the rows of every pipeline rank.

Policy only (loop thread of worker rank 0), for a transformer split over
``ranks`` ranks (``EngineConfig.pp``). A pass (one denoise step of one chunk,
or its commit pass) enters rank 0 in micro-step m, runs on rank r in
micro-step m + r, and is back at rank 0 in micro-step m + ranks, which first
takes it back (the sampler step, or the end of the commit) and may then
start the chunk's next pass in the same micro-step. So the scheduler keeps
the rows that entered in each of the last ``ranks`` micro-steps: they are
the later ranks' task lists (``place``), and the oldest are the rows coming
back (``MicroStep.returning``).

Which sessions enter (``select``): those with a pass to plan
(``EngineSession.next_pass``, given the session's chunks in the ring), not
held back by pacing, up to ``rows`` (the SLO controller's choice, at most
``max_rows``) and never more than the working sessions (with a pass to plan
or in the ring) over the ranks, rounded up, so that they spread over the
ring's stages instead of entering together and leaving every rank idle in
all but one micro-step of ``ranks``; one row per session, round-robin from
the session after the last one served; with grouping, sessions in the
middle of a chunk go first.
A rank thus never holds two rows of one session (each rank's rows entered in
one micro-step), and a chunk has one pass in the ring at a time.

Exact (a session's ``lookahead`` 1): a session has one chunk in flight, so
rows of *different* sessions fill the ring (with at least ``ranks`` sessions
every rank has work in every micro-step), and a chunk begins only once the
chunk before it is in every rank's cache. **Stream batch** (``lookahead`` >
1, ``EngineConfig.stream_batch``): the session's next chunk may begin while
the chunk before is still in the ring, so one session fills the ring by
itself; its chunks then attend to their predecessors' latest, not yet final,
keys and values (``rtvideo.workers.pipelines.kv_cache``), which changes the output by
design.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from rtvideo.engine.plan import StepRow
from rtvideo.engine.session import EngineSession


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
        pool = [s for s in sessions if s.session_id not in held]
        ids = [s.session_id for s in pool]
        start = ids.index(self._last_served) + 1 if self._last_served in ids else 0
        ordered = [
            s
            for s in pool[start:] + pool[:start]
            if s.next_pass(self.busy_chunks(s.session_id), self.finishing_chunks(s.session_id)) is not None
        ]
        if not ordered:
            return []
        if self.grouping:
            begun = [s for s in ordered if s.in_mid_chunk()]
            ordered = begun + [s for s in ordered if s not in begun]
        # Spread the sessions over the ring's stages: with more rows allowed than
        # sessions / ranks, every session would enter in one micro-step and come
        # back together, and each rank would work one micro-step in ``ranks``.
        working = sum(1 for s in pool if s in ordered or self.in_flight(s.session_id))
        chosen = ordered[: min(self.rows, -(-working // self.ranks))]
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
        return any(row.session_id == session_id for rows in self._window for row in rows)

    def busy_chunks(self, session_id: str) -> frozenset[int]:
        """The session's chunks with a pass on a rank after the first in the next
        micro-step (not the ones coming back: those may enter again in it)."""
        window = list(self._window)[: self.ranks - 1]
        return frozenset(row.chunk_index for rows in window for row in rows if row.session_id == session_id)

    def finishing_chunks(self, session_id: str) -> frozenset[int]:
        """The session's chunks whose commit pass comes back in the next micro-step:
        rank 0 finishes their commit before that micro-step's boundaries, and
        every rank has them in its cache before a pass entering then reaches it."""
        returning = self._window[-1]
        return frozenset(r.chunk_index for r in returning if r.session_id == session_id and r.commit)
