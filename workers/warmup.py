"""Warm-up: throwaway sessions through the pipeline before the worker says READY.

Worker process. The first forward of a model pays one-time costs (kernel
selection and loading, allocator growth, lazy initialisation in the libraries)
that would otherwise land on the first user's first chunk. ``warm_up`` runs
``pipeline.warm_up_chunks`` chunks of a session at the pipeline's default
geometry through the worker's own path (``workers.chunk_driver``: micro-steps
through the ``ModelRunner``), then, when the pipeline takes batched forwards
(``max_batch_rows`` > 1), as many chunks of ``max_batch_rows`` sessions in
lockstep, so that the batched forward's shapes are warm too, and the commit
and the decode of their chunks in one batch each (the memory peak the
budget reads is a full batch's). Every warm-up session is released:
nothing of it stays held. A pipeline with nothing to warm says 0.
"""

from __future__ import annotations

import time

from engine.messages import StartSession
from workers.chunk_driver import ChunkDriver
from workers.pipelines.base import ChunkPipeline

WARM_UP_SESSION = "rtvideo.warm-up"


def warm_up(pipeline: ChunkPipeline, width: int | None = None, height: int | None = None) -> float:
    """Run and release the warm-up sessions, at the pipeline's default size or
    the one given; returns the seconds it took (0 when the pipeline asks for
    no warm-up). Exceptions propagate: a pipeline that cannot make a chunk
    should not say READY."""
    chunks = pipeline.warm_up_chunks
    if chunks <= 0:
        return 0.0
    began = time.perf_counter()
    driver = ChunkDriver(pipeline)
    shapes = [[WARM_UP_SESSION]]  # one row a forward
    if pipeline.max_batch_rows > 1:
        shapes.append([f"{WARM_UP_SESSION}.{row}" for row in range(pipeline.max_batch_rows)])
    for session_ids in shapes:
        starts = [StartSession(session_id=sid, prompt="warm-up", width=width, height=height) for sid in session_ids]
        try:
            driver.open(*starts)
            driver.run(session_ids, chunks)
        finally:
            driver.release(*session_ids)
    return time.perf_counter() - began
