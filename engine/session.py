"""Per-session engine state, owned by the loop thread of worker rank 0.

One ``EngineSession`` per admitted session; nothing is global, so any number
of sessions share a worker. The pipeline's tensors live in the runner, keyed
by the same session id; this object only tracks where the session is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from engine.mailbox import PendingInteraction
from engine.messages import AppliedInteraction, SessionGeometry, StartSession
from engine.plan import StepRow


class Phase(Enum):
    NEW = "new"  # admitted; the runner has not encoded it yet
    BOUNDARY = "boundary"  # between chunks: the next boundary may run
    DENOISING = "denoising"  # chunk ``chunk_index`` is being denoised
    FINISHING = "finishing"  # ending; the runner frees it in the next plan


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
    applied, and what it cost. Plans refer to it by (session, chunk, step)."""

    index: int
    steps: int  # denoise steps of the chunk
    first_frame: int  # frame index of its first frame in the session
    events: ChunkEvents
    boundary: BoundaryTaken | None  # reported once the micro-step that crossed it came back
    boundary_step: int  # number of that micro-step
    passes: int = 0  # rows it takes: its steps, and its commit pass when that is a row of its own (0: steps)
    planned: int = 0  # rows (steps, then the commit pass) handed to the executor
    done: int = 0  # denoise steps whose result came back
    boundary_ms: float = 0.0
    denoise_ms: float = 0.0
    commit_ms: float = 0.0  # the commit pass (and the decode, when it ran in the same micro-step)
    micro_steps: list[int] = field(default_factory=list)  # number of the micro-step of each step run

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


@dataclass(frozen=True)
class BoundaryTaken:
    """What a chunk's boundary took from the mailbox, to report once it ran."""

    applied: PendingInteraction | None
    superseded: list[tuple[PendingInteraction, str]]
    taken_at: float  # time.monotonic() when taken


@dataclass
class EngineSession:
    session_id: str
    geometry: SessionGeometry
    start: StartSession | None = None  # the request, until the runner opened it
    phase: Phase = Phase.NEW
    chunk_index: int = 0  # the chunk in flight (DENOISING) or next to begin (BOUNDARY)
    chunk: ChunkInFlight | None = None  # the chunk in flight, DENOISING only
    chunks_done: int = 0
    frames_done: int = 0
    end_reason: str | None = None  # completed / stopped / shutdown, once FINISHING
    release_planned: bool = False  # FINISHING: the micro-step that frees its state was submitted
    decoding: dict[int, ChunkInFlight] = field(default_factory=dict)  # committed chunks the decode stage has
    failure: str | None = None  # why it failed; said (SessionFailed) once its decodes came back
    failure_said: bool = False
    decodes_dropped: bool = False  # a decode failed: later chunks would leave a gap, so none is emitted
    max_lead_seconds: float | None = None  # pacing budget; None: never held back for the playhead
    max_undelivered_seconds: float | None = None  # transport budget beyond what was written to the client
    first_emit_at: float | None = None  # time.monotonic() when chunk 0 was emitted
    events: EventTracker = field(default_factory=EventTracker)
    applied: list[AppliedInteraction] = field(default_factory=list)

    @property
    def steps_per_chunk(self) -> int:
        return self.geometry.num_inference_steps

    @property
    def media_seconds_done(self) -> float:
        return self.frames_done / self.geometry.fps

    def plannable(self) -> bool:
        """Whether a row of it may go into the next micro-step: it is new, between
        chunks, or has a step of its chunk left to plan. A chunk's boundary is
        planned only once the previous chunk came back (``chunk`` is None then)."""
        if self.phase in (Phase.NEW, Phase.BOUNDARY):
            return True
        return self.phase is Phase.DENOISING and self.chunk is not None and not self.chunk.all_planned

    def is_last_chunk(self, chunk: int) -> bool:
        total = self.geometry.num_chunks
        return total is not None and chunk >= total - 1

    def finish(self, reason: str) -> None:
        if self.phase is not Phase.FINISHING:
            self.phase = Phase.FINISHING
            self.end_reason = reason
