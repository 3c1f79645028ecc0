"""Micro-step plans: what the engine asks for one forward, and what comes back.

The engine loop (``rtvideo.engine.loop``) plans one ``MicroStep`` at a time, after
draining the control queue, and hands it to an executor (``Executor``); the
executor runs it on the workers (``rtvideo.workers.executor.LocalExecutor``: one rank,
in process, on a thread of its own) and returns a ``StepResult`` later, while
the loop goes on draining control and planning. A micro-step is executed in
field order: release, open, boundaries, then one forward over its rows; a
row's last step commits its chunk, and the decode follows in the same
micro-step or, with the decode stage, on a thread of its own while the next
micro-steps run (``DecodeResult``).
Plain dataclasses; they stay inside the worker process.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from rtvideo.engine.messages import RankFigures, SessionGeometry, StartSession, SubmitInput


@dataclass(frozen=True)
class BoundaryTask:
    """Begin chunk ``chunk_index`` of a session: apply ``prompt`` (if any), then
    prepare the chunk. Always planned after the latest control drain. Exact
    (``lookahead`` 1), only once the session's previous chunk is committed (it
    may still be decoding); with stream batch, once fewer than ``lookahead``
    of its chunks are in flight and each of them has begun
    (``EngineSession.next_pass``)."""

    session_id: str
    chunk_index: int
    prompt: str | None  # None: no interaction applies here
    transition_chunks: int  # 0/1 hard cut; N >= 2 blend over N chunks
    input: SubmitInput | None = None
    """Video to video: the chunk's input frames, handed to the pipeline
    (``take_input``) before its boundary; None for a session without an input."""


@dataclass(frozen=True)
class StepRow:
    """One row of a forward: chunk ``chunk_index`` of one session at denoise step
    ``step`` (0-based). After the chunk's last step the executor also commits
    the chunk and decodes it, and the row's result carries the frames. A chunk
    of no denoise step (``steps_per_chunk`` 0: video to video at strength 0,
    its clean latent the encoded input) has one row, its commit (``commit``),
    which runs no forward: the boundary, then the commit and the decode."""

    session_id: str
    chunk_index: int
    step: int
    steps_per_chunk: int

    @property
    def last(self) -> bool:
        """The chunk's last denoise step: commit and decode follow."""
        return self.step == self.steps_per_chunk - 1

    @property
    def commit(self) -> bool:
        """The chunk's commit pass (``step == steps_per_chunk``): planned as a row of
        its own when the blocks are split over ranks (with one rank the last
        denoise step's row commits), or when the chunk has no denoise step."""
        return self.step == self.steps_per_chunk


@dataclass
class MicroStep:
    """One forward's worth of work for the executor."""

    number: int  # increasing per worker; results come back in this order
    release: list[str] = field(default_factory=list)  # session ids whose state is freed
    open: list[StartSession] = field(default_factory=list)  # sessions to open (prompt encode, allocate)
    boundaries: list[BoundaryTask] = field(default_factory=list)
    ranks: list[list[StepRow]] = field(default_factory=lambda: [[]])
    """Per rank, the rows it runs in this micro-step: rank r runs the rows that
    entered rank 0 r micro-steps ago (``rtvideo.engine.stream_batch``)."""
    cancelled: list[StepRow] = field(default_factory=list)
    """Rows entering rank 0 that the executor took out before running the
    micro-step: their session was stopping (reported ``RowResult.cancelled``)."""
    returning: list[StepRow] = field(default_factory=list)
    """Split over ranks: the rows the last rank ran in the micro-step before, back
    at rank 0, which runs their sampler step (or finishes their commit) first."""

    @property
    def rows(self) -> list[StepRow]:
        """Every row of the micro-step, rank by rank."""
        return [row for rank in self.ranks for row in rank]

    def is_empty(self) -> bool:
        return not (self.release or self.open or self.boundaries or any(self.ranks) or self.returning)

    def sessions(self) -> set[str]:
        """The sessions whose state the micro-step uses: a row on any rank or
        coming back, an open or a boundary (a release frees state, it does not
        use it)."""
        ids = {row.session_id for row in (*self.rows, *self.returning)}
        return ids | {start.session_id for start in self.open} | {task.session_id for task in self.boundaries}


@dataclass(frozen=True)
class ChunkOutput:
    """A decoded chunk: ``num_frames`` frames of uint8 RGB, frame-major."""

    num_frames: int
    width: int
    height: int
    payload: bytes


@dataclass
class RowResult:
    """What happened to one chunk of one session in a micro-step (its open and
    boundary count as chunk 0's and the boundary's chunk's)."""

    session_id: str
    chunk_index: int
    stepped: bool = False  # its denoise step ran
    committed: bool = False  # its chunk's last step ran and the chunk is in the cache (decode follows)
    chunk: ChunkOutput | None = None  # its chunk's frames, when decoded in this micro-step
    boundary_ms: float = 0.0  # open and boundary calls (the input frames' encode included)
    encode_ms: float = 0.0  # video to video: of ``boundary_ms``, the input frames' encode (``take_input``)
    denoise_ms: float = 0.0  # its share of the forward, and its sampler update
    decode_ms: float = 0.0  # commit and decode
    cancelled: bool = False  # its session was stopping: the step did not run, or was abandoned part-way
    batch_rows: int = 0  # rows of the forward that ran its step (1: alone; 0: no forward ran)
    batch_exact: bool = True  # False: that forward had other rows, and the pipeline is not batch-invariant
    error: str | None = None  # the session failed; the runner already released it


@dataclass
class StepResult:
    """Per-chunk results of one micro-step, and the time spent inside the pipeline.
    With stream batch a session may have several chunks in one micro-step (one
    coming back, another entering), so results are keyed by (session, chunk)."""

    number: int  # the micro-step's number
    rows: dict[tuple[str, int], RowResult] = field(default_factory=dict)
    released: list[str] = field(default_factory=list)  # sessions whose state it freed
    decodes: list[tuple[str, int]] = field(default_factory=list)  # (session, chunk) committed, decode deferred
    pipeline_s: float = 0.0
    wall_s: float = 0.0  # the micro-step's wall time on rank 0 (split over ranks: waits for the ring included)
    step_graphs: dict[str, int] | None = None  # the pipeline's captured-step counts after it, where it has them

    def row(self, session_id: str, chunk_index: int) -> RowResult:
        key = (session_id, chunk_index)
        if key not in self.rows:
            self.rows[key] = RowResult(session_id, chunk_index)
        return self.rows[key]

    def of_session(self, session_id: str) -> list[RowResult]:
        """The session's results in this micro-step, in chunk order."""
        return sorted((r for (sid, _), r in self.rows.items() if sid == session_id), key=lambda r: r.chunk_index)


@dataclass
class DecodeResult:
    """A chunk decoded by the decode stage, after the micro-step that committed it
    (``RowResult.committed``); a session's chunks come back in order."""

    session_id: str
    chunk_index: int
    chunk: ChunkOutput | None  # None: the decode failed (``error``) or was cancelled
    decode_ms: float
    error: str | None = None
    cancelled: bool = False  # its session was stopping: not decoded (or abandoned part-way); not a failure


class Runner(Protocol):
    """The mechanism that runs one micro-step; implemented by ``rtvideo.workers.runner.ModelRunner``."""

    def describe(self, start: StartSession) -> SessionGeometry:
        """Effective geometry of ``start``; raises ``ValueError`` naming the bad field.
        Called on the control-receiver thread: must not touch session state."""
        ...

    def execute(self, step: MicroStep) -> StepResult:
        """Run ``step``; errors are caught per session (that session fails, the
        others go on)."""
        ...

    def held_sessions(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(sessions the runner holds state for, sessions the pipeline holds state for)."""
        ...


class Executor(Protocol):
    """Where micro-steps run, asynchronously to the loop: ``submit`` returns at
    once; results come back in submission order through ``results``, and the
    executor wakes the loop (the ``on_result`` callback it was built with) each
    time one is ready. Rows of a session that is stopping by the time its
    micro-step starts are not run, and a forward (commit, decode) whose rows'
    sessions are all stopping is abandoned part-way (``RowResult.cancelled``,
    ``DecodeResult.cancelled``)."""

    depth: int
    """Micro-steps it holds at once (running and queued); the loop plans ahead up to it."""

    def submit(self, step: MicroStep) -> None: ...

    def results(self) -> list[StepResult | DecodeResult]:
        """The results finished since the last call: micro-steps in submission
        order, and the decodes they deferred (each after its micro-step, a
        session's in chunk order). Raises what the runner itself raised (a bug:
        the loop fails with it)."""
        ...

    def in_flight(self) -> int:
        """Micro-steps submitted whose result ``results`` has not returned yet."""
        ...

    def executing_s(self) -> float:
        """How long the micro-step now running has been running (0 when idle)."""
        ...

    def held_sessions(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The runner's and the pipeline's held sessions, as of the latest micro-step."""
        ...

    def rank_figures(self) -> tuple[RankFigures, ...]:
        """Split over ranks: each rank's figures (busy and wall seconds, chunks
        decoded), cumulative, rank 0 first; () with one rank."""
        ...

    def close(self) -> None:
        """Finish what was submitted, then stop the executor."""
        ...
