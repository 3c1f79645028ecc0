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

With ``align_chunks`` (the worker sets it where chunks that end in one
micro-step decode as one batch), sessions of one frame size begin their
chunks together: a session about to begin a chunk (not its first) waits
while another of its size has a chunk under way, for at most a chunk's steps
of its turns. Sessions that came in apart (one opened a micro-step after
another) so fall into step within a chunk and then stay there, each chunk of
theirs ending in the same micro-step; a session's first chunk never waits
(its time to first frame is not traded), and a session waits for no one
that is ending.
"""

from __future__ import annotations

from collections.abc import Iterable

from rtvideo.engine.plan import StepRow
from rtvideo.engine.session import EngineSession, Phase


class ChunkScheduler:
    def __init__(self, grouping: bool, max_rows: int, align_chunks: bool = False) -> None:
        if max_rows < 1:
            raise ValueError("max_rows must be >= 1")
        self.grouping = grouping
        self.max_rows = max_rows
        self.align_chunks = align_chunks and max_rows > 1
        self._last_served: str | None = None
        self._waited: dict[str, int] = {}  # align_chunks: turns a session has waited to begin its next chunk

    def select(self, sessions: Iterable[EngineSession], held: set[str] = frozenset()) -> list[EngineSession]:
        """The sessions that get a row in the next micro-step; ``held`` sessions
        (paced) are skipped."""
        pool = list(sessions)
        ids = [s.session_id for s in pool]
        start = ids.index(self._last_served) + 1 if self._last_served in ids else 0
        ordered = [s for s in pool[start:] + pool[:start] if s.plannable() and s.session_id not in held]
        if self.align_chunks:
            self._waited = {sid: n for sid, n in self._waited.items() if sid in ids}  # sessions gone: forgotten
            ordered = [s for s in ordered if not self._waits(s, pool)]
        if not ordered:
            return []
        if self.grouping:
            begun = [s for s in ordered if s.in_mid_chunk()]
            ordered = begun + [s for s in ordered if s not in begun]
        chosen = ordered[: self.max_rows]
        self._last_served = chosen[-1].session_id
        return chosen

    def _waits(self, session: EngineSession, pool: list[EngineSession]) -> bool:
        """Whether ``session``, about to begin a chunk, waits this turn for others
        of its frame size whose chunks are under way (``align_chunks``)."""
        sid = session.session_id
        if session.chunks or session.next_chunk == 0:
            self._waited.pop(sid, None)  # mid-chunk, or its first chunk (a new session's too): never waits
            return False
        under_way = any(
            other is not session
            and other.chunks
            and other.phase is not Phase.FINISHING
            and _decode_size(other) == _decode_size(session)
            for other in pool
        )
        waited = self._waited.get(sid, 0)
        if not under_way or waited >= session.steps_per_chunk:
            self._waited.pop(sid, None)
            return False
        self._waited[sid] = waited + 1
        return True

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


def _decode_size(session: EngineSession) -> tuple[int, int, int]:
    """What sessions' chunks share to decode in one batch: frame size and frames a chunk."""
    g = session.geometry
    return g.width, g.height, g.frames_per_chunk
