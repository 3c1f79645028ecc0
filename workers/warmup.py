"""Warm-up: a throwaway session through the pipeline before the worker says READY.

Worker process. The first forward of a model pays one-time costs (kernel
selection and loading, allocator growth, lazy initialisation in the libraries)
that would otherwise land on the first user's first chunk. ``warm_up`` runs
``pipeline.warm_up_chunks`` chunks of a session at the pipeline's default
geometry through the same protocol calls the runner makes, then releases it,
so nothing of it stays held. A pipeline with nothing to warm says 0.
"""

from __future__ import annotations

import time

from engine.messages import StartSession
from engine.plan import ChunkOutput
from workers.pipelines.base import BatchRow, ChunkPipeline, PipelineState, StepBatch

WARM_UP_SESSION = "rtvideo.warm-up"


def run_one_chunk(pipeline: ChunkPipeline, state: PipelineState) -> ChunkOutput:
    """Boundary, every denoise step (one row), ``post_decode``; the state moves to the next chunk."""
    pipeline.prepare_next_chunk(state)
    for step in range(state.geometry.num_inference_steps):
        batch = StepBatch((BatchRow(state.session_id, state.chunk_index, step),))
        [prediction] = pipeline.denoise_step(batch, [state])
        pipeline.step_scheduler(state, prediction)
    output = pipeline.post_decode(state)
    state.chunk_index += 1
    return output


def warm_up(pipeline: ChunkPipeline, width: int | None = None, height: int | None = None) -> float:
    """Run and release the warm-up session, at the pipeline's default size or
    the one given; returns the seconds it took (0 when the pipeline asks for
    no warm-up). Exceptions propagate: a pipeline that cannot make a chunk
    should not say READY."""
    chunks = getattr(pipeline, "warm_up_chunks", 0)
    if chunks <= 0:
        return 0.0
    began = time.perf_counter()
    start = StartSession(session_id=WARM_UP_SESSION, prompt="warm-up", width=width, height=height)
    state = PipelineState(WARM_UP_SESSION, start, pipeline.describe(start))
    pipeline.prepare_encode(state)
    try:
        for _ in range(chunks):
            run_one_chunk(pipeline, state)
    finally:
        pipeline.release(state)
    return time.perf_counter() - began
