"""Per-session engine state, owned by the loop thread of worker rank 0.

One ``EngineSession`` per admitted session; nothing is global, so any number
of sessions share a worker. The pipeline's tensors live in the runner, keyed
by the same session id; this object only tracks where the session is.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

from rtvideo.engine.mailbox import PendingInteraction
from rtvideo.engine.messages import AppliedInteraction, SessionGeometry, StartSession
from rtvideo.engine.plan import ChunkOutput, StepRow


class Phase(Enum):
    """Where a session is (``EngineSession.phase``, derived from its records, never stored)."""

    NEW = "new"  # admitted; the micro-step that opens it is not planned yet
    BOUNDARY = "boundary"  # between chunks (none in flight): the next boundary may run
    DENOISING = "denoising"  # chunks are in flight (``chunks``): one, or with stream batch up to ``lookahead``
    FINISHING = "finishing"  # ending (``end_reason``); the runner frees it once nothing of it runs


def first_frame(geometry: SessionGeometry, index: int) -> int:
    """The frame index, in the session's stream, of chunk ``index``'s first frame:
    the frames of chunks 0 .. index - 1 (chunk 0 has ``first_chunk_frames``, every
    later one ``frames_per_chunk``). The one statement of that rule."""
    return 0 if index <= 0 else geometry.first_chunk_frames + (index - 1) * geometry.frames_per_chunk


def chunk_frames(geometry: SessionGeometry, index: int) -> int:
    """The frames chunk ``index`` decodes to."""
    return first_frame(geometry, index + 1) - first_frame(geometry, index)


def unsendable(output: object) -> str | None:
    """What keeps a decode's output from travelling as frames (None: nothing): it
    must be a ``ChunkOutput`` of integer sizes and a non-empty bytes payload.
    What a follower rank checks before it replies (``DecodeServer``); rank 0
    checks the rest against the session (``output_fault``)."""
    if not isinstance(output, ChunkOutput):
        return f"a {type(output).__name__}, not a ChunkOutput"
    sizes = (output.num_frames, output.width, output.height)
    if not all(type(size) is int for size in sizes):
        return f"sizes {sizes!r}, not integers"
    if not isinstance(output.payload, bytes):
        return f"a payload of {type(output.payload).__name__}, not bytes"
    if not output.payload:
        return "an empty payload"
    return None


def output_fault(output: object, geometry: SessionGeometry, index: int) -> str | None:
    """What is wrong with a decode's output for chunk ``index`` of a session of
    ``geometry`` (None: nothing): it must travel as frames (``unsendable``), at
    the session's size, of the chunk's frames (``chunk_frames``), its payload
    exactly that many uint8 RGB frames. The engine checks every chunk before it
    is sent, so a pipeline's fault fails its session instead of reaching the
    wire (where it could not be encoded, or not be read)."""
    frames = chunk_frames(geometry, index)
    want = f"{frames} frames of {geometry.width}x{geometry.height}"
    if (fault := unsendable(output)) is not None:
        return f"{fault} ({want})" if isinstance(output, ChunkOutput) else f"{fault} of {want}"
    got = (output.num_frames, output.width, output.height)
    if got != (frames, geometry.width, geometry.height):
        return f"{output.num_frames} frames of {output.width}x{output.height}, not {want}"
    size = frames * geometry.width * geometry.height * 3
    if len(output.payload) != size:
        return f"{len(output.payload)} payload bytes, not {size} ({want}, uint8 RGB)"
    return None


def _not_stopped() -> str | None:
    return None


@dataclass(frozen=True)
class ChunkEvents:
    """Interaction ids attached to one chunk's metadata."""

    started: tuple[str, ...] = ()
    active: tuple[str, ...] = ()
    completed: tuple[str, ...] = ()


class EventTracker:
    """Derives the started / active / completed event ids of each chunk.

    An interaction starts at the chunk it applies to and stays active while
    its transition runs (N chunks; one for a hard cut); it completes with the
    transition's last chunk, or earlier when a newer interaction cuts in.
    A superseded interaction completes, without starting, at the next chunk.
    """

    def __init__(self) -> None:
        self._current: tuple[str, int] | None = None  # (event id, last chunk of its transition)

    def begin_chunk(self, chunk: int, applied: tuple[str, int] | None, superseded: list[str]) -> ChunkEvents:
        completed = list(superseded)
        started: list[str] = []
        if applied is not None:
            event_id, transition_chunks = applied
            if self._current is not None:
                completed.append(self._current[0])  # interrupted mid-transition
            self._current = (event_id, chunk + max(transition_chunks, 1) - 1)
            started.append(event_id)
        active: list[str] = []
        if self._current is not None:
            active.append(self._current[0])
            if self._current[1] == chunk:
                completed.append(self._current[0])
                self._current = None
        return ChunkEvents(tuple(started), tuple(active), tuple(completed))


@dataclass
class ChunkInFlight:
    """The engine's one record of a chunk being made: which, how far, what it
    applied, and what it cost. Plans refer to it by (session, chunk, step); its
    first frame follows from its index (``first_frame``)."""

    index: int
    steps: int  # denoise steps of the chunk
    events: ChunkEvents
    boundary: BoundaryTaken | None  # reported once the micro-step that crossed it came back
    boundary_step: int  # number of that micro-step
    passes: int = 0  # rows it takes: its steps, and its commit pass when that is a row of its own (``passes_for``)
    planned: int = 0  # rows (steps, then the commit pass) handed to the executor
    done: int = 0  # denoise steps whose result came back
    boundary_ms: float = 0.0
    encode_ms: float = 0.0  # video to video: of ``boundary_ms``, its input frames' encode
    denoise_ms: float = 0.0
    commit_ms: float = 0.0  # the commit pass (and the decode, when it ran in the same micro-step)
    micro_steps: list[int] = field(default_factory=list)  # number of the micro-step of each step run
    batch_rows: int = 0  # the most rows (sessions) in one forward that ran a step of it
    batch_exact: bool = True  # every forward of it computed what one alone computes (RowResult.batch_exact)
    chunks_in_flight: int = 1  # the session's chunks in flight once it began, itself included (> 1: stream batch)

    def next_row(self, session_id: str) -> StepRow:
        """The row of this chunk's next step to plan."""
        return StepRow(session_id, self.index, self.planned, self.steps)

    @property
    def begun(self) -> bool:
        """A step of it was planned: grouping runs the rest back to back."""
        return self.planned > 0

    @property
    def all_planned(self) -> bool:
        return self.planned >= (self.passes or self.steps)


def passes_for(steps: int, split: bool) -> int:
    """The rows a chunk of ``steps`` denoise steps takes: one per step, and its
    commit as a row of its own when the blocks are split over ranks (``split``)
    or when it has no step (the commit then follows its boundary alone)."""
    return steps + 1 if split or steps == 0 else steps


@dataclass(frozen=True)
class BoundaryTaken:
    """What a chunk's boundary took from the mailbox, to report once it ran."""

    applied: PendingInteraction | None
    superseded: list[tuple[PendingInteraction, str]]
    taken_at: float  # time.monotonic() when taken


@dataclass
class EngineSession:
    """The loop's record of one session's progress: one record per fact, what
    follows from them derived (properties), never kept beside them.

    Kept: whether it was opened, the next chunk to begin, the chunks in flight
    (begun, not committed), the chunks decoding (committed, their decode not
    back), the chunks delivered, and a failure. Derived: its ``phase``, its
    ``end_reason``, the chunk ``in_progress``, ``frames_done`` and the media
    begun. A stop is not kept here: the control plane's stop flag is its one
    record (``stop_reason``, read lock-free, as the executor reads it)."""

    session_id: str
    geometry: SessionGeometry
    start: StartSession | None = None  # the request: planned in the micro-step that opens the session
    opened: bool = False  # the micro-step that opens it was planned (before: ``Phase.NEW``)
    next_chunk: int = 0
    """The index of the next chunk to begin. Advanced by the loop only while it
    holds the control plane's lock, with the mailbox's take at that chunk's
    boundary (``ControlPlane.boundary``); the control plane reads it there to
    say where an interaction lands (``InteractionQueued``)."""
    chunks: dict[int, ChunkInFlight] = field(default_factory=dict)
    """The chunks begun and not yet committed, oldest first: chunks begin and
    commit in order, so these are ``next_chunk - len(chunks)`` .. ``next_chunk - 1``."""
    lookahead: int = 1
    """Chunks it may have in flight at once: 1 is exact (a chunk begins once the
    one before it is committed); more is stream batch (``EngineConfig.stream_batch``)."""
    chunks_done: int = 0
    """Chunks delivered (``ChunkReady`` sent): 0 .. ``chunks_done - 1``, in order."""
    release_planned: bool = False  # FINISHING: the micro-step that frees its state was submitted
    decoding: dict[int, ChunkInFlight] = field(default_factory=dict)  # committed chunks the decode stage has
    failure: str | None = None  # why it failed; said (SessionFailed) once its state was released
    failure_code: str = "pipeline_error"  # SessionFailed.code of ``failure`` (invalid_input, input_timeout too)
    input_wait: tuple[int, float] | None = None
    """Video to video: (chunk, since) while the chunk about to begin waits for its
    input frames and nothing else holds it back (the loop's clock); None otherwise."""
    decodes_dropped: bool = False  # a decode failed or was cancelled: the chunks after it are not emitted
    stop_reason: Callable[[], str | None] = _not_stopped
    """The control plane's stop flag for it (``ControlPlane.stop_reason``): the
    stop's or the shutdown's reason, None while none came."""
    max_lead_seconds: float | None = None  # pacing budget; None: never held back for the playhead
    max_undelivered_seconds: float | None = None  # transport budget beyond what was written to the client
    first_emit_at: float | None = None  # time.monotonic() when chunk 0 was emitted
    events: EventTracker = field(default_factory=EventTracker)
    applied: list[AppliedInteraction] = field(default_factory=list)

    @property
    def steps_per_chunk(self) -> int:
        return self.geometry.num_inference_steps

    @property
    def takes_input(self) -> bool:
        """Opened with an input (video to video): a chunk begins once its frames came."""
        return self.start is not None and self.start.input is not None

    @property
    def committed_all(self) -> bool:
        """Its last chunk is committed (never, for an open-ended session)."""
        total = self.geometry.num_chunks
        return total is not None and self.next_chunk >= total and not self.chunks

    @property
    def delivered_all(self) -> bool:
        """Every chunk of it was delivered (never, for an open-ended session)."""
        total = self.geometry.num_chunks
        return total is not None and self.chunks_done >= total

    @property
    def end_reason(self) -> str | None:
        """Why it ends; None while it runs. ``failed`` once a pipeline call failed
        it; else a stop's (or the shutdown's) reason when one came and not every
        chunk was delivered; else ``completed`` once its last chunk is committed
        (a stop that lands while its last decodes are out, and cuts them, makes it
        stopped: ``SessionDone`` never says completed with chunks missing)."""
        if self.failure is not None:
            return "failed"
        stop = self.stop_reason()
        if stop is not None and not self.delivered_all:
            return stop
        return "completed" if self.committed_all else stop

    @property
    def phase(self) -> Phase:
        if self.end_reason is not None:
            return Phase.FINISHING
        if not self.opened:
            return Phase.NEW
        return Phase.DENOISING if self.chunks else Phase.BOUNDARY

    @property
    def in_progress(self) -> int | None:
        """The newest chunk begun while it is not committed yet, else None (between
        chunks): with stream batch, older chunks may be in flight behind it."""
        return self.next_chunk - 1 if self.chunks else None

    @property
    def frames_done(self) -> int:
        """Frames of the chunks delivered and of the chunks committed whose decode is
        not back yet (counted for pacing and for ``SessionDone``; a chunk whose
        decode is dropped leaves ``decoding`` and so stops counting)."""
        g = self.geometry
        return first_frame(g, self.chunks_done) + sum(chunk_frames(g, index) for index in self.decoding)

    @property
    def media_seconds_done(self) -> float:
        return self.frames_done / self.geometry.fps

    @property
    def media_seconds_begun(self) -> float:
        """Media committed and under way (the chunks in flight at their full length)."""
        g = self.geometry
        under_way = sum(chunk_frames(g, index) for index in self.chunks)
        return (self.frames_done + under_way) / g.fps

    def next_pass(self, busy: frozenset[int] = frozenset(), finishing: frozenset[int] = frozenset()) -> int | None:
        """The chunk whose next pass may enter the next micro-step, given the
        chunks with a pass in the pipeline (``busy``) and those whose commit
        finishes at the start of that micro-step (``finishing``: split over
        ranks, the commit pass coming back): the oldest chunk in flight with a
        pass left to plan, not busy, and behind the chunk before it (a chunk's
        passes never overtake those of the chunk before, so chunks commit in
        order); else the next chunk, when it may begin (``next_chunk``: its
        boundary is planned with the pass); else None.

        A chunk may begin when fewer than ``lookahead`` chunks are in flight (a
        finishing one not counted) and each of them has begun: with
        ``lookahead`` 1, only once the chunk before is committed, so it sees
        only final chunks before it."""
        if self.phase is Phase.FINISHING:
            return None
        ahead: ChunkInFlight | None = None  # the chunk before, still in flight
        for index, chunk in self.chunks.items():
            if index not in busy and not chunk.all_planned and (ahead is None or chunk.planned < ahead.planned):
                return index
            ahead = chunk
        in_flight = sum(1 for index in self.chunks if index not in finishing)
        if in_flight >= self.lookahead or (ahead is not None and not ahead.begun):
            return None
        total = self.geometry.num_chunks
        return self.next_chunk if total is None or self.next_chunk < total else None

    def plannable(self) -> bool:
        """Whether a row of it may go into the next micro-step (nothing of it in a pipeline)."""
        return self.next_pass() is not None

    def in_mid_chunk(self) -> bool:
        """A chunk of it has begun and has passes left: grouping runs them back to back."""
        return any(chunk.begun and not chunk.all_planned for chunk in self.chunks.values())
