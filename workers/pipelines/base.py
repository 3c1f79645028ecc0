"""The ``ChunkPipeline`` contract: what a model implements so the runner can
drive it one denoise step at a time.

Runs in a worker process. The runner (``workers.runner.ModelRunner``) owns one
``PipelineState`` per session and calls, for each session:

    prepare_encode                               once, when the session opens
    [apply_interaction_at_chunk_boundary]        at a boundary, if one applies
    prepare_next_chunk                           at every boundary
    denoise_step + step_scheduler  x steps       the chunk's denoise steps
    post_decode                                  after the chunk's last step
    release                                      when the session ends, always

Boundaries (apply + prepare) always run in a runner invocation of their own
loop iteration, after the control queue was drained; with grouping, one
invocation runs several denoise steps of one chunk, never steps of two.

Everything a pipeline allocates for a session lives in ``state.extra`` or in
a pool keyed by the session id, and is gone after ``release``;
``held_sessions`` lets the worker prove it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple, Protocol, runtime_checkable

from engine.messages import SessionGeometry, StartSession
from engine.plan import ChunkOutput


@dataclass
class PipelineState:
    """One session's state as the runner and pipeline see it."""

    session_id: str
    start: StartSession
    geometry: SessionGeometry
    chunk_index: int = 0  # chunk being prepared or denoised
    step_in_chunk: int = 0  # denoise steps done in this chunk; step_scheduler advances it
    extra: dict[str, Any] = field(default_factory=dict)  # pipeline-owned (latents, caches, ...)


class BatchRow(NamedTuple):
    session_id: str
    chunk_index: int
    step: int  # the step_in_chunk this forward computes


class StepBatch(NamedTuple):
    """The rows of one ``denoise_step`` forward, in the order of ``states``.
    (Named tuples: built once per denoise step, so cheap to make.)"""

    rows: tuple[BatchRow, ...]


def refuse_negative_prompt(start: StartSession, model: str) -> None:
    """For a pipeline that samples without classifier-free guidance (``describe``
    calls it): a negative prompt could change nothing, so it is refused with a
    ``ValueError`` naming the field, never accepted and ignored. Blank is fine."""
    if start.negative_prompt.strip():
        raise ValueError(
            f"negative_prompt: the {model!r} model samples without classifier-free guidance, "
            "so a negative prompt would have no effect; leave it out"
        )


@runtime_checkable
class ChunkPipeline(Protocol):
    name: ClassVar[str]
    supports_chunk_step_grouping: ClassVar[bool]
    """Whether several denoise steps of a chunk may run in one runner invocation."""
    supports_micro_step_execution: ClassVar[bool]
    """Whether the pipeline implements temporal-PP micro-steps (not yet used)."""
    max_batch_rows: int
    """How many session rows one ``denoise_step`` forward may carry. A worker builds
    its pipeline with ``EngineConfig.max_batch_rows`` (``--max-batch-rows``), the one
    knob for it; sizes that depend on it (attention buffers, memory) follow."""
    warm_up_chunks: int
    """Chunks of a throwaway session the worker runs before READY (``workers.warmup``); 0: none."""

    def describe(self, start: StartSession) -> SessionGeometry:
        """The effective geometry of ``start``, defaults filled in. Raises
        ``ValueError`` naming the offending field. Pure: called from the
        control thread while the loop thread runs other sessions."""
        ...

    def prepare_encode(self, state: PipelineState) -> None:
        """Once per session: encode the prompt, allocate caches, seed noise."""
        ...

    def apply_interaction_at_chunk_boundary(self, state: PipelineState, prompt: str, transition_chunks: int) -> None:
        """Switch to ``prompt`` from chunk ``state.chunk_index`` on: a hard cut for
        0 or 1, else a linear blend over ``transition_chunks`` chunks."""
        ...

    def prepare_next_chunk(self, state: PipelineState) -> None:
        """Set up chunk ``state.chunk_index`` (its noise, its conditioning);
        ``state.step_in_chunk`` is 0 afterwards."""
        ...

    def denoise_step(self, batch: StepBatch, states: Sequence[PipelineState]) -> Sequence[Any]:
        """One forward over the rows of ``batch``; one prediction per row. Must not
        change any state (the runner may rerun a row alone to isolate a failure);
        the sampler update belongs to ``step_scheduler``."""
        ...

    def step_scheduler(self, state: PipelineState, noise_pred: Any) -> None:
        """One sampler update of one row; advances ``state.step_in_chunk`` by one."""
        ...

    def post_decode(self, state: PipelineState) -> ChunkOutput:
        """After the chunk's last step: commit it to the caches and decode its frames."""
        ...

    def release(self, state: PipelineState) -> None:
        """The session ended: free everything held for it. Must not raise twice."""
        ...

    def held_sessions(self) -> tuple[str, ...]:
        """Session ids the pipeline still holds allocations for."""
        ...

    def session_memory_budget(self) -> int | None:
        """Device memory, in bytes, that open sessions' state may hold together,
        as found after the warm-up (``SessionGeometry.state_bytes`` is what one
        session holds); None: not limited (a CPU). Called once, before READY."""
        ...
