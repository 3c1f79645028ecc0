"""What one chunk costs the worker, and what the worker can keep at real time.

Pure Python, shared by both processes' views of the worker: rank 0 builds a
``ChunkCostModel`` from the chunks it measured at start (``rtvideo.workers.calibrate``)
and refines it with every chunk it makes; its control plane asks it what a new
session would cost (``realtime_load``) and the worker derives from it the
largest frame it serves in real time (``realtime_pixels``).

The model, per frame area (pixels = width x height) and denoise steps:

    seconds per chunk = steps x step_s(pixels) + chunk_s(pixels)

``step_s`` is one denoise step's forward and sampler step, ``chunk_s`` what a
chunk costs beyond them (its boundary, the commit pass, the decode). A session
with an input (video to video) costs its input frames' encode on top,
``encode_s(pixels)`` a chunk (``estimate(..., encode=True)``): the VAE
encoder's time, measured at start where the other costs are
(``rtvideo.workers.calibrate``: the default frame's, scaled by area to the other frames
measured, the encoder's convolutions costing in proportion to the pixels), 0
for a pipeline that takes no input. Each is measured at a few frame areas
(``ChunkCostSample``) and interpolated between them on log-log axes (a power law per segment: fixed overheads make the
exponent small at small frames, attention, quadratic in tokens, makes it grow
at large ones). Beyond the largest measured area the last segment's exponent
carries on, never below 1 (a frame's cost grows at least linearly once the
overheads vanish); below the smallest one, never above 1. The worker measures
near the answer (``rtvideo.workers.calibrate`` probes the area it predicts), so the
size it derives is interpolated, not extrapolated far.

A chunk measured by the running worker (``observe``) replaces the model at its
frame area, smoothed: the estimate follows what this machine really does under
its real load.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from rtvideo.engine.messages import ChunkCostSample, ChunkReady, SessionGeometry

OBSERVED_WEIGHT = 0.3
"""Weight of each newly observed chunk in the smoothed cost at its frame area."""


class ChunkCostModel:
    """Seconds one chunk of one session costs, by frame area and steps. Thread-safe:
    the loop thread observes while the control thread estimates."""

    def __init__(self, samples: Iterable[ChunkCostSample] = ()) -> None:
        self.samples: tuple[ChunkCostSample, ...] = tuple(sorted(samples, key=lambda s: s.pixels))
        self._observed: dict[int, tuple[float, float]] = {}  # pixels -> smoothed (step_s, chunk_s)
        self._observed_encode: dict[int, float] = {}  # pixels -> smoothed encode_s (input sessions' chunks)
        self._lock = threading.Lock()

    def estimate(self, width: int, height: int, steps: int, encode: bool = False) -> float | None:
        """Seconds a chunk of ``width`` x ``height`` at ``steps`` denoise steps costs
        (observed at this area if a chunk was, else the measured model), with
        ``encode`` its input frames' encode too (a session with an input); None
        when nothing was measured at all."""
        return self.area_cost(width * height, steps, encode)

    def area_cost(self, pixels: int, steps: int, encode: bool = False) -> float | None:
        """``estimate`` by frame area: seconds a chunk of ``pixels`` costs."""
        with self._lock:
            observed = self._observed.get(pixels)
            observed_encode = self._observed_encode.get(pixels)
        if observed is not None:
            step_s, chunk_s = observed
        elif self.samples:
            step_s = _interpolate(self.samples, pixels, lambda s: s.step_s)
            chunk_s = _interpolate(self.samples, pixels, lambda s: s.chunk_s)
        else:
            return None
        if not encode:
            return steps * step_s + chunk_s
        if observed_encode is None:
            measured = any(s.encode_s > 0 for s in self.samples)
            observed_encode = _interpolate(self.samples, pixels, lambda s: s.encode_s) if measured else 0.0
        return steps * step_s + chunk_s + observed_encode

    def observe(self, chunk: ChunkReady) -> None:
        """Fold a chunk the worker made into the estimate at its frame area. The
        first chunk of a session is skipped: it opens the session and attends to
        an empty cache, so it is cheaper than the chunks that follow. Its input
        frames' encode (``ChunkTiming.encode_ms``, part of ``boundary_ms``) goes
        to the encode's estimate, not the chunk's: a session without an input
        does not pay it. A chunk of no denoise step gives its encode only."""
        timing = chunk.timing
        if chunk.generation_chunk_index == 0:
            return
        pixels = chunk.width * chunk.height
        if timing.encode_ms > 0:
            encode_s = timing.encode_ms / 1000
            with self._lock:
                old_encode = self._observed_encode.get(pixels)
                if old_encode is not None:
                    encode_s = old_encode + OBSERVED_WEIGHT * (encode_s - old_encode)
                self._observed_encode[pixels] = encode_s
        if timing.steps < 1:
            return
        step_s = timing.denoise_ms / 1000 / timing.steps
        chunk_s = (timing.boundary_ms - timing.encode_ms + timing.decode_ms) / 1000
        with self._lock:
            old = self._observed.get(pixels)
            if old is not None:
                step_s = old[0] + OBSERVED_WEIGHT * (step_s - old[0])
                chunk_s = old[1] + OBSERVED_WEIGHT * (chunk_s - old[1])
            self._observed[pixels] = (step_s, chunk_s)


def _interpolate(samples: Sequence[ChunkCostSample], pixels: int, value) -> float:
    """``value`` of the samples at ``pixels``, a power law between the two samples
    around it (exponent clamped at 0: cost never falls as a frame grows), beyond
    the ends the nearest segment's exponent (at least 1 above, at most 1 below)."""
    if len(samples) == 1:
        only = samples[0]
        return value(only) * pixels / only.pixels
    if pixels <= samples[0].pixels:
        a, b, low, high = samples[0], samples[1], 0.0, 1.0
    elif pixels >= samples[-1].pixels:
        a, b, low, high = samples[-2], samples[-1], 1.0, math.inf
    else:
        i = next(i for i in range(1, len(samples)) if samples[i].pixels >= pixels)
        a, b, low, high = samples[i - 1], samples[i], 0.0, math.inf
    va, vb = max(value(a), 1e-12), max(value(b), 1e-12)
    exponent = math.log(vb / va) / math.log(b.pixels / a.pixels) if b.pixels != a.pixels else 1.0
    exponent = min(max(exponent, low), high)
    anchor, at = (vb, b.pixels) if pixels >= b.pixels else (va, a.pixels)  # beyond the end: from the end
    return anchor * (pixels / at) ** exponent


def chunk_media_s(geometry: SessionGeometry) -> float:
    """Seconds of media one (later) chunk of the session plays for."""
    return geometry.frames_per_chunk / geometry.fps


def realtime_pixels(model: ChunkCostModel, geometry: SessionGeometry, load_limit: float, largest: int) -> int | None:
    """The largest frame area (pixels, at most ``largest``) whose chunk, at
    ``geometry``'s steps and frame rate, costs at most ``load_limit`` of its media
    time: what one session can run in real time with that margin. Never below
    ``geometry``'s own area (the model's default size stays served, in real time
    or not). None when the model has measured nothing."""
    floor = geometry.width * geometry.height
    budget = load_limit * chunk_media_s(geometry)

    def fits(pixels: int) -> bool:
        cost = model.area_cost(pixels, geometry.num_inference_steps)
        return cost is not None and cost <= budget

    if model.area_cost(floor, geometry.num_inference_steps) is None:
        return None
    if not fits(floor):
        return floor
    low, high = floor, max(floor, largest)
    if fits(high):
        return high
    while high - low > 1:  # fits(low), not fits(high); the cost grows with the area
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


@dataclass(frozen=True)
class SessionLoad:
    """One session's share of the worker: its chunk's cost and media time."""

    chunk_s: float  # seconds of the worker one chunk takes
    media_s: float  # seconds of media one chunk plays for
    paced: bool  # has deadlines: a realtime session paced to its viewer


def realtime_load(sessions: Sequence[SessionLoad]) -> float:
    """The fraction of the worker's time the sessions need for every paced one to
    keep real time; 0 when none is paced (no deadline to break).

    A paced session needs ``chunk_s / media_s`` of the worker. An unpaced one (a
    request-mode job, or a realtime session with pacing off) runs as fast as it
    can, so it needs no share of its own, but the scheduler gives it a turn in
    every round: one of its chunks lands between two chunks of every paced
    session, so it counts as one chunk per the shortest paced chunk's media
    time. Below 1 every paced session gets each chunk before its media runs out
    (the scheduler serves sessions round-robin, one chunk each per round)."""
    paced = [s for s in sessions if s.paced]
    if not paced:
        return 0.0
    shortest = min(s.media_s for s in paced)
    return sum(s.chunk_s / s.media_s for s in paced) + sum(s.chunk_s for s in sessions if not s.paced) / shortest
