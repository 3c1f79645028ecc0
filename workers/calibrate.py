"""Calibration: what a chunk costs on this machine, and the largest frame it serves in real time.

Worker rank 0, after the warm-up (``workers.warmup``), before READY, through
the worker's own path (``workers.chunk_driver``: micro-steps through the
``ModelRunner``), on throwaway sessions released at once. It measures
``ChunkCostSample``s (one denoise step; the rest of a chunk) at a few frame
areas of the default frame's shape, for ``engine.chunk_cost.ChunkCostModel``:

1. The default size, for as many chunks as fill the session's KV cache (sink
   plus window) and one more: the cost of a steady chunk, attending to a full
   cache. Its first chunk against that last one gives how much dearer a full
   cache makes a chunk (``fill``: each part's ratio, at least 1).
2. Larger frames, one chunk each, scaled by ``fill`` (a full cache at every
   size would take the cache's length in chunks, each up to a chunk's media
   time): first twice the default's sides, then, at most ``PROBES`` times, the
   frame the model so far says is the largest within ``load_limit`` of real
   time, until the answer lies between two measured frames (or at the model's
   largest). So the derived size is interpolated between measurements, and
   each probe costs about one chunk's media time at most.
3. Instead, half the default's sides, one chunk, when the default itself is
   past ``load_limit`` (the answer is the default then, and a larger frame
   would cost more than its media time for nothing) or twice its sides would
   not fit in memory: the cost model gets its slope from the cheaper side.

A frame is measured only where a session of it, and as much again for the
forward's activations, fits in what the pipeline says sessions may hold
(``session_memory_budget``): a GPU too small for a larger frame starts
without trying it (the 1.3B model's 832x480 session holds 7.1 GB; the first
larger frame, 1280x960 (twice its sides within the model's largest side),
about 22 GB).

The result: the samples, and ``realtime_pixels`` (``engine.chunk_cost``): the
largest frame area one session runs within ``load_limit`` of real time, never
below the default. Measured on the 2-core development machine, tiny preset
(docs/SERVER.md, Limits).
"""

from __future__ import annotations

import logging
import math
import time
from collections import defaultdict
from dataclasses import dataclass

from engine.chunk_cost import ChunkCostModel, chunk_media_s, realtime_pixels
from engine.messages import ChunkCostSample, SessionGeometry, StartSession
from workers.chunk_driver import ChunkDriver
from workers.pipelines.base import ChunkPipeline
from workers.runner import StageCall

log = logging.getLogger(__name__)

CALIBRATION_SESSION = "rtvideo.calibration"
PROBES = 3
"""Frames probed beyond the default and twice its sides, at most."""
STEP_STAGES = ("forward", "sampler_step")  # a denoise step
SKIPPED_STAGES = ("open", "encode_prompt")  # once per session, not per chunk


@dataclass(frozen=True)
class Calibration:
    samples: tuple[ChunkCostSample, ...]
    realtime_pixels: int | None  # the largest frame area within the load limit (None: nothing measured)
    seconds: float  # how long calibrating took


def calibrate(pipeline: ChunkPipeline, load_limit: float) -> Calibration:
    """Measure, derive, release (module docstring). Pipelines that ask for no
    warm-up (``warm_up_chunks`` 0: arithmetic, or a model too slow on this
    device to run a chunk at start) are not measured."""
    began = time.perf_counter()
    if getattr(pipeline, "warm_up_chunks", 0) <= 0:
        return Calibration((), None, 0.0)
    defaults = pipeline.describe(StartSession(session_id=CALIBRATION_SESSION, prompt="calibration"))
    limits = pipeline.limits() if hasattr(pipeline, "limits") else None
    largest = limits.max_size**2 if limits is not None else defaults.width * defaults.height
    multiple = limits.size_multiple if limits is not None else 1
    timer = _ChunkTimer(pipeline)
    try:
        first, full = timer.measure(defaults.width, defaults.height, _chunks_to_fill(pipeline))
        fill = (max(1.0, full.step_s / first.step_s), max(1.0, full.chunk_s / first.chunk_s))
        samples = {full.pixels: full}

        def probe(pixels: int) -> bool:
            """One chunk measured at about ``pixels``; False (nothing measured) when a
            session of that frame would not fit in the memory sessions may hold."""
            width, height = _frame(defaults, pixels, multiple, limits.max_size if limits else defaults.width)
            if width * height in samples:
                return True
            if not _fits(pipeline, width, height):
                log.info("calibration: a %dx%d session would not fit in memory; not measured", width, height)
                return False
            (chunk,) = timer.measure(width, height, 1)
            samples[chunk.pixels] = _scaled(chunk, fill)
            return True

        default_cost = ChunkCostModel([full]).area_cost(full.pixels, defaults.num_inference_steps)
        in_real_time = default_cost <= load_limit * chunk_media_s(defaults)
        if in_real_time and probe(4 * full.pixels):
            for _ in range(PROBES):
                model = ChunkCostModel(samples.values())
                target = realtime_pixels(model, defaults, load_limit, largest)
                if target is None or target <= max(samples) or max(samples) >= largest:
                    break  # between two measured frames (or below the first): interpolated
                if not probe(target):
                    break
        else:  # the answer is the default (over the limit already) or nothing larger fits: a smaller frame's cost
            probe(full.pixels // 4)  # gives the model its slope, cheaper than a larger one
    finally:
        timer.close()
    model = ChunkCostModel(samples.values())
    ordered = tuple(sorted(samples.values(), key=lambda s: s.pixels))
    return Calibration(ordered, realtime_pixels(model, defaults, load_limit, largest), time.perf_counter() - began)


def _fits(pipeline: ChunkPipeline, width: int, height: int) -> bool:
    """Whether a session of ``width`` x ``height`` has room to be measured: its state,
    and as much again for the forward's activations and roped keys (a 832x480
    session of the 1.3B model on a GPU peaked at about 0.8 times its state beyond
    the weights), within what the pipeline says sessions may hold now. A
    pipeline that says nothing (no ``session_memory_budget``, or None) fits."""
    budget = pipeline.session_memory_budget() if hasattr(pipeline, "session_memory_budget") else None
    if budget is None:
        return True
    state = pipeline.describe(
        StartSession(session_id=CALIBRATION_SESSION, prompt="calibration", width=width, height=height)
    )
    return 2 * state.state_bytes <= budget


def _chunks_to_fill(pipeline: ChunkPipeline) -> int:
    """Chunks that fill a session's KV cache (sinks and window), plus one."""
    latent = getattr(pipeline, "latent_frames", 0)
    span = getattr(pipeline, "sink_frames", 0) + getattr(pipeline, "window_frames", 0)
    return span // latent + 1 if latent else 2


def _frame(defaults: SessionGeometry, pixels: int, multiple: int, max_size: int) -> tuple[int, int]:
    """The frame of the default's shape with about ``pixels`` pixels, its sides
    multiples of ``multiple`` (rounded down) within the model's largest side."""
    scale = math.sqrt(pixels / (defaults.width * defaults.height))

    def side(value: int) -> int:
        return min(max_size, max(multiple, int(value * scale) // multiple * multiple))

    return side(defaults.width), side(defaults.height)


def _scaled(sample: ChunkCostSample, fill: tuple[float, float]) -> ChunkCostSample:
    return ChunkCostSample(
        width=sample.width,
        height=sample.height,
        pixels=sample.pixels,
        step_s=sample.step_s * fill[0],
        chunk_s=sample.chunk_s * fill[1],
    )


class _ChunkTimer:
    """Runs a throwaway session's chunks and times each from the runner's stage calls."""

    def __init__(self, pipeline: ChunkPipeline) -> None:
        self._pipeline = pipeline
        self._calls: list[StageCall] = []
        sync = getattr(pipeline, "synchronize", None)
        self._driver = ChunkDriver(
            pipeline,
            max_rows=1,
            synchronize=None if sync is None else (lambda _stage: sync()),
            on_stage=self._calls.append,
        )

    def measure(self, width: int, height: int, chunks: int) -> tuple[ChunkCostSample, ...]:
        """The first and the last of ``chunks`` chunks of a fresh session (one
        sample when ``chunks`` is 1)."""
        start = StartSession(session_id=CALIBRATION_SESSION, prompt="calibration", width=width, height=height)
        self._calls.clear()
        timed = []
        try:
            (state,) = self._driver.open(start)
            steps = state.geometry.num_inference_steps
            for index in range(chunks):
                self._calls.clear()
                self._driver.run([CALIBRATION_SESSION], 1)
                if index in (0, chunks - 1):
                    timed.append(self._sample(width, height, steps))
        finally:
            self._driver.release(CALIBRATION_SESSION)
        return tuple(timed)

    def _sample(self, width: int, height: int, steps: int) -> ChunkCostSample:
        seconds: dict[str, float] = defaultdict(float)
        for call in self._calls:
            seconds[call.stage] += call.ms / 1000
        step_s = sum(seconds[stage] for stage in STEP_STAGES) / steps
        rest = sum(value for stage, value in seconds.items() if stage not in STEP_STAGES + SKIPPED_STAGES)
        return ChunkCostSample(width=width, height=height, pixels=width * height, step_s=step_s, chunk_s=rest)

    def close(self) -> None:
        self._driver.close()
