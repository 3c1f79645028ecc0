"""The step plan: what one loop iteration asks the runner to do, and what comes back.

The engine loop (``engine.loop``) builds one ``StepPlan`` per iteration, after
draining the control queue; the runner (``workers.runner.ModelRunner``)
executes it in one invocation, in field order: release, open, boundaries,
rows. Plain dataclasses; they stay inside the worker process.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from engine.messages import SessionGeometry, StartSession


@dataclass(frozen=True)
class BoundaryTask:
    """Begin chunk ``chunk_index`` of a session: apply ``prompt`` (if any), then
    prepare the chunk. Always computed after the latest control drain."""

    session_id: str
    chunk_index: int
    prompt: str | None  # None: no interaction applies here
    transition_chunks: int  # 0/1 hard cut; N >= 2 blend over N chunks


@dataclass(frozen=True)
class PlanRow:
    """Denoise steps ``first_step .. first_step + num_steps - 1`` of one session's
    current chunk. When the last of them is the chunk's last step, the runner
    also runs ``post_decode`` and returns the chunk."""

    session_id: str
    chunk_index: int
    first_step: int  # step_in_chunk before this invocation
    num_steps: int  # steps this invocation may run (1 ungrouped; the rest of the chunk grouped)
    steps_per_chunk: int


@dataclass
class StepPlan:
    """One loop iteration's work for the runner."""

    invocation: int  # increasing runner invocation number
    release: list[str] = field(default_factory=list)  # session ids whose state the runner frees
    open: list[StartSession] = field(default_factory=list)  # sessions to encode (prepare_encode)
    boundaries: list[BoundaryTask] = field(default_factory=list)
    rows: list[PlanRow] = field(default_factory=list)

    def is_empty(self) -> bool:
        return not (self.release or self.open or self.boundaries or self.rows)


@dataclass(frozen=True)
class ChunkOutput:
    """A decoded chunk: ``num_frames`` frames of uint8 RGB, frame-major."""

    num_frames: int
    width: int
    height: int
    payload: bytes


@dataclass
class RowResult:
    """What happened to one session in an invocation."""

    session_id: str
    steps_run: int = 0
    step_calls: list[int] = field(default_factory=list)  # invocation number per step run
    chunk: ChunkOutput | None = None  # set when the chunk finished in this invocation
    boundary_ms: float = 0.0
    denoise_ms: float = 0.0
    decode_ms: float = 0.0
    cancelled: bool = False  # stopped between steps; the partial chunk is discarded
    error: str | None = None  # the session failed; the runner already released it


@dataclass
class PlanResult:
    """Per-session results of one invocation, and the time spent inside the pipeline."""

    rows: dict[str, RowResult] = field(default_factory=dict)
    pipeline_s: float = 0.0

    def row(self, session_id: str) -> RowResult:
        if session_id not in self.rows:
            self.rows[session_id] = RowResult(session_id)
        return self.rows[session_id]


class Runner(Protocol):
    """The mechanism side of the loop; implemented by ``workers.runner.ModelRunner``."""

    def describe(self, start: StartSession) -> SessionGeometry:
        """Effective geometry of ``start``; raises ``ValueError`` naming the bad field.
        Called on the control-receiver thread: must not touch session state."""
        ...

    def execute(self, plan: StepPlan, is_cancelled: Callable[[str], bool]) -> PlanResult:
        """Run ``plan``; between two denoise steps of a row, a row whose session
        ``is_cancelled`` stops early. Errors are caught per session."""
        ...

    def held_sessions(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(sessions the runner holds state for, sessions the pipeline holds state for)."""
        ...
