"""Warm-up: throwaway sessions through the pipeline before the worker says READY.

Worker process. The first forward of a model pays one-time costs (kernel
selection and loading, allocator growth, lazy initialisation in the libraries)
that would otherwise land on the first user's first chunk. ``warm_up`` runs,
at the pipeline's default geometry and through the worker's own path
(``rtvideo.workers.chunk_driver``: micro-steps through the ``ModelRunner``):

- when the pipeline takes batched forwards (``max_batch_rows`` > 1),
  ``pipeline.warm_up_chunks`` chunks of ``max_batch_rows`` sessions in
  lockstep, so that the batched forward's shapes are warm too, and the
  commit and the decode of their chunks in one batch each (the memory peak
  the budget reads is a full batch's);
- then one session alone, one row a forward: ``warm_up_chunks`` chunks, or
  with captured steps (``capture_chunks``, ``cuda_graphs``) as many as it
  takes to fill the window and capture its denoise and commit graphs. It is
  released last, so the cache kept for the next session of its size (and
  with it the graphs) is its: the first session of the default size
  replays from its first full-window chunk, with no capture mid-stream.

Every warm-up session is released: nothing of it stays held (a kept cache
holds no session). A pipeline with nothing to warm says 0; with
``warm_up_chunks`` 0 nothing is captured either.
"""

from __future__ import annotations

import time

from rtvideo.engine.messages import StartSession
from rtvideo.workers.chunk_driver import ChunkDriver
from rtvideo.workers.pipelines.base import ChunkPipeline

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
    runs = []  # (sessions, chunks): the batched ones first, the one released last is the one alone
    if pipeline.max_batch_rows > 1:
        runs.append(([f"{WARM_UP_SESSION}.{row}" for row in range(pipeline.max_batch_rows)], chunks))
    runs.append(([WARM_UP_SESSION], max(chunks, pipeline.capture_chunks)))  # one row a forward
    for session_ids, count in runs:
        starts = [StartSession(session_id=sid, prompt="warm-up", width=width, height=height) for sid in session_ids]
        try:
            driver.open(*starts)
            driver.run(session_ids, count)
        finally:
            driver.release(*session_ids)
    return time.perf_counter() - began
