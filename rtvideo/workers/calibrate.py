"""Calibration: what a chunk costs on this machine, and the largest frame it serves in real time.

Worker rank 0, after the warm-up (``rtvideo.workers.warmup``), before READY, through
the worker's own path (``rtvideo.workers.chunk_driver``: micro-steps through the
``ModelRunner``), on throwaway sessions released at once. It measures
``ChunkCostSample``s (one denoise step; the rest of a chunk) at a few frame
areas of the default frame's shape, for ``rtvideo.engine.chunk_cost.ChunkCostModel``:

1. The default size, for as many chunks as fill the session's KV cache (sink
   plus window) and ``REPEATS - 1`` more: the cost of a steady chunk,
   attending to a full cache (the median of the last ``REPEATS``). Its first
   chunk (with the first chunks of more fresh sessions: the median) against
   the steady one gives how much dearer a full cache makes a chunk (``fill``:
   each part's ratio, at least 1).
2. Larger frames, a fresh session's first chunk each, scaled by ``fill`` (a
   full cache at every size would take the cache's length in chunks, each up
   to a chunk's media time): first twice the default's sides, then, at most
   ``PROBES`` times, the frame the model so far says is the largest within
   ``load_limit`` of real time, until the answer lies between two measured
   frames (or at the model's largest). So the derived size is interpolated
   between measurements, and each measurement costs about one chunk's media
   time at most.
3. Instead, half the default's sides, when the default itself is past
   ``load_limit`` (the answer is the default then, and a larger frame would
   cost more than its media time for nothing), twice its sides would not fit
   in memory, or the frame bound is configured (``derive_bound`` False:
   ``--max-pixels`` pins it; nothing larger than the default is measured
   then, only what admission by chunk cost needs): the cost model gets its
   slope from the cheaper side.

4. Video to video (a pipeline that declares ``video_input``): a session of
   the default frame with an input (strength ``ENCODE_STRENGTH``: its frames
   encoded, one denoise step) for two chunks; the second's ``take_input``
   (a later chunk's frames through the streaming VAE encoder) is the
   encode's cost, ``ChunkCostSample.encode_s``, scaled by area to the other
   frames measured (the encoder is convolutions: its cost follows the
   pixels). A session with an input pays it on top of its chunks
   (``ChunkCostModel.estimate(..., encode=True)``); 0 where the pipeline
   takes no input, or refuses this one (``describe``: a model whose VAE has
   no encoder).

A frame is measured only where a session of it, and as much again for the
forward's activations, fits in what the pipeline says sessions may hold
(``session_memory_budget``): a GPU too small for a larger frame starts
without trying it (the 1.3B model's 832x480 session holds 7.1 GB; the first
larger frame, 1280x960 (twice its sides within the model's largest side),
about 22 GB).

Every frame is measured up to ``REPEATS`` times and each figure (a denoise
step, the rest of a chunk) is the median of its measurements: on a loaded
machine one chunk can take ten times another of the same frame, and a size
derived from single measurements moved tenfold from one start to the next.
A frame's measurements stop early once more than half of ``REPEATS`` agree
within ``AGREE`` (the median of all would lie between them): on a quiet
machine two of three. The repeats cost about 1.5 s a start on the 2-core
development machine under other load (demo model: 1.1 s single, 2.6 s
repeated; tiny preset: 4.0 s and 5.8 s; medians of five alternating starts).

The result: the samples (each frame's medians), ``realtime_pixels``
(``rtvideo.engine.chunk_cost``): the largest frame area one session runs within
``load_limit`` of real time, never below the default, and its ``spread``:
the same derived from every frame's slowest and fastest measurements (the
worker logs the three). Measured on the 2-core development machine, tiny
preset (docs/SERVER.md, Limits).
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgspec
import numpy as np

from rtvideo.engine.chunk_cost import ChunkCostModel, chunk_media_s, realtime_pixels
from rtvideo.engine.messages import ChunkCostSample, SessionGeometry, StartSession, VideoInput
from rtvideo.workers.chunk_driver import ChunkDriver
from rtvideo.workers.pipelines.base import ChunkPipeline
from rtvideo.workers.runner import StageCall

log = logging.getLogger(__name__)

CALIBRATION_SESSION = "rtvideo.calibration"
PROBES = 3
"""Frames probed beyond the default and twice its sides, at most."""
REPEATS = 3
"""Measurements of every frame; each figure is their median."""
AGREE = 0.1
ENCODE_STRENGTH = 0.5
"""The input's strength when the encode is measured: one denoise step of four, frames encoded."""
"""Measurements of a frame this close (relative) end it early (``_repeated``)."""
STEP_STAGES = ("forward", "sampler_step")  # a denoise step
SKIPPED_STAGES = ("open", "encode_prompt")  # once per session, not per chunk

Measure = Callable[[int, int, int], Sequence[ChunkCostSample]]
"""``measure(width, height, chunks)``: every chunk of a fresh session of that
frame, in order, each a ``ChunkCostSample`` (``_ChunkTimer.measure``; a test
gives its own timings)."""


@dataclass(frozen=True)
class Calibration:
    samples: tuple[ChunkCostSample, ...]  # per frame measured, the median of its measurements
    realtime_pixels: int | None  # the largest frame area within the load limit (None: not derived)
    seconds: float  # how long calibrating took
    spread: tuple[int, int, int] | None = None
    """``realtime_pixels`` as the least, the median (the decision) and the most
    of the figures derived from every frame's slowest, median and fastest
    measurements; None where nothing was derived."""
    repeats: int = 1  # measurements of each frame


def calibrate(
    pipeline: ChunkPipeline,
    load_limit: float,
    *,
    derive_bound: bool = True,
    repeats: int = REPEATS,
    measure: Measure | None = None,
) -> Calibration:
    """Measure, derive, release (module docstring). Pipelines that ask for no
    warm-up (``warm_up_chunks`` 0: arithmetic, or a model too slow on this
    device to run a chunk at start) are not measured. ``derive_bound`` False
    (the frame bound is configured): the default frame and half its sides
    only, ``realtime_pixels`` None. ``measure``: the chunks' timings (default:
    the pipeline's own chunks, through the worker's path)."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    began = time.perf_counter()
    if pipeline.warm_up_chunks <= 0:
        return Calibration((), None, 0.0)
    defaults = pipeline.describe(StartSession(session_id=CALIBRATION_SESSION, prompt="calibration"))
    limits = pipeline.limits()
    largest, multiple = limits.max_size**2, limits.size_multiple
    timer = None
    if measure is None:
        timer = _ChunkTimer(pipeline)
        measure = timer.measure
    try:
        # The session that fills the cache, then as many steady chunks as measurements; more first chunks.
        session = measure(defaults.width, defaults.height, _chunks_to_fill(pipeline) + repeats - 1)
        firsts = _repeated(lambda: measure(defaults.width, defaults.height, 1)[0], repeats, [session[0]])
        steady = list(session[-repeats:])
        first, full = _median(firsts), _median(steady)
        fill = (max(1.0, full.step_s / first.step_s), max(1.0, full.chunk_s / first.chunk_s))
        measured = {full.pixels: steady}  # per frame area: its measurements, scaled to a full cache

        def probe(pixels: int) -> bool:
            """``repeats`` chunks measured at about ``pixels``; False (nothing measured)
            when a session of that frame would not fit in the memory sessions may
            hold, or its chunk failed (out of memory, most likely: the estimate
            ``_fits`` goes by is not the device's word). A frame no session asked
            for must not stop the worker: its failure is logged, and the frame
            bound derived stays below it."""
            nonlocal largest
            width, height = _frame(defaults, pixels, multiple, limits.max_size)
            if width * height in measured:
                return True
            if not _fits(pipeline, width, height):
                log.info("calibration: a %dx%d session would not fit in memory; not measured", width, height)
                return False
            mark = pipeline.memory_mark() if hasattr(pipeline, "memory_mark") else None
            try:
                measured[width * height] = _repeated(lambda: _scaled(measure(width, height, 1)[0], fill), repeats)
            except Exception as error:
                if not out_of_memory(error):  # anything else (a device fault, a bug) is the start's to report
                    raise
                if hasattr(pipeline, "after_out_of_memory"):
                    pipeline.after_out_of_memory(mark)  # the full device's peak is not the sessions' transient
                largest = min(largest, width * height - 1)
                log.warning(
                    "calibration: a %dx%d chunk ran out of memory (%s); frames of %d pixels or more are not admitted",
                    width,
                    height,
                    error,
                    width * height,
                )
                return False
            return True

        def model(pick=_median) -> ChunkCostModel:
            return ChunkCostModel(pick(samples) for samples in measured.values())

        default_cost = model().area_cost(full.pixels, defaults.num_inference_steps)
        in_real_time = default_cost <= load_limit * chunk_media_s(defaults)
        if derive_bound and in_real_time and probe(4 * full.pixels):
            for _ in range(PROBES):
                target = realtime_pixels(model(), defaults, load_limit, largest)
                if target is None or target <= max(measured) or max(measured) >= largest:
                    break  # between two measured frames (or below the first): interpolated
                if not probe(target):
                    break
        else:  # not derived, the answer is the default (over the limit already) or nothing larger fits:
            probe(full.pixels // 4)  # a smaller frame's cost gives the model its slope, cheaper than a larger one
        encode_s = timer.measure_encode(defaults) if timer is not None else 0.0
    finally:
        if timer is not None:
            timer.close()
    ordered = tuple(
        sorted(
            (_with_encode(_median(samples), encode_s, full.pixels) for samples in measured.values()),
            key=lambda s: s.pixels,
        )
    )
    if not derive_bound:
        return Calibration(ordered, None, time.perf_counter() - began, None, repeats)
    decided = realtime_pixels(model(), defaults, load_limit, largest)
    figures = [realtime_pixels(model(pick), defaults, load_limit, largest) for pick in (_slowest, _fastest)]
    spread = None if decided is None else (min(decided, *figures), decided, max(decided, *figures))
    return Calibration(ordered, decided, time.perf_counter() - began, spread, repeats)


def out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is a device or host running out of memory (torch's
    ``OutOfMemoryError``, by name: this module imports no torch; or ``MemoryError``)."""
    return isinstance(error, MemoryError) or any(kind.__name__ == "OutOfMemoryError" for kind in type(error).__mro__)


def _repeated(
    one: Callable[[], ChunkCostSample], repeats: int, taken: list[ChunkCostSample] | None = None
) -> list[ChunkCostSample]:
    """Measurements of one frame by ``one()`` (after those ``taken`` already), up to
    ``repeats``, stopping early once more than half of ``repeats`` agree within
    ``AGREE``: whatever the rest would measure, their median lies between those
    (on a quiet machine, two measurements of three)."""
    taken = list(taken or ())
    while len(taken) < repeats and not (len(taken) > repeats // 2 and _agree(taken)):
        taken.append(one())
    return taken


def _agree(samples: Sequence[ChunkCostSample]) -> bool:
    """Whether each figure's largest measurement is within ``AGREE`` of its smallest."""
    return all(
        max(values) <= (1 + AGREE) * min(values)
        for values in ([s.step_s for s in samples], [s.chunk_s for s in samples])
    )


def _median(samples: Sequence[ChunkCostSample]) -> ChunkCostSample:
    """One frame's measurements as one: each figure their median."""
    return _combine(samples, statistics.median)


def _slowest(samples: Sequence[ChunkCostSample]) -> ChunkCostSample:
    return _combine(samples, max)


def _fastest(samples: Sequence[ChunkCostSample]) -> ChunkCostSample:
    return _combine(samples, min)


def _combine(samples: Sequence[ChunkCostSample], pick) -> ChunkCostSample:
    one = samples[0]
    return ChunkCostSample(
        width=one.width,
        height=one.height,
        pixels=one.pixels,
        step_s=pick([s.step_s for s in samples]),
        chunk_s=pick([s.chunk_s for s in samples]),
    )


def _fits(pipeline: ChunkPipeline, width: int, height: int) -> bool:
    """Whether a session of ``width`` x ``height`` has room to be measured: its state,
    and as much again for the forward's activations and roped keys (a 832x480
    session of the 1.3B model on a GPU peaked at about 0.8 times its state beyond
    the weights), within what the pipeline says sessions may hold now. Where
    it says None (not limited), it fits."""
    budget = pipeline.session_memory_budget()
    if budget is None:
        return True
    state = pipeline.describe(
        StartSession(session_id=CALIBRATION_SESSION, prompt="calibration", width=width, height=height)
    )
    return 2 * state.state_bytes <= budget


def _chunks_to_fill(pipeline: ChunkPipeline) -> int:
    """Chunks that fill a session's KV cache (sinks and window), plus one; 2 for a
    pipeline that declares no such window (``kv_window``)."""
    if not pipeline.capabilities.kv_window:
        return 2
    return (pipeline.sink_frames + pipeline.window_frames) // pipeline.latent_frames + 1


def _frame(defaults: SessionGeometry, pixels: int, multiple: int, max_size: int) -> tuple[int, int]:
    """The frame of the default's shape with about ``pixels`` pixels, its sides
    multiples of ``multiple`` (rounded down) within the model's largest side."""
    scale = math.sqrt(pixels / (defaults.width * defaults.height))

    def side(value: int) -> int:
        return min(max_size, max(multiple, int(value * scale) // multiple * multiple))

    return side(defaults.width), side(defaults.height)


def _with_encode(sample: ChunkCostSample, encode_s: float, pixels: int) -> ChunkCostSample:
    """``sample`` with the encode measured at ``pixels`` (``encode_s``), scaled to its area."""
    return msgspec.structs.replace(sample, encode_s=encode_s * sample.pixels / pixels)


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
        sync = pipeline.synchronize if pipeline.capabilities.synchronize else None
        self._driver = ChunkDriver(
            pipeline,
            max_rows=1,
            synchronize=None if sync is None else (lambda _stage: sync()),
            on_stage=self._calls.append,
        )

    def measure(self, width: int, height: int, chunks: int) -> tuple[ChunkCostSample, ...]:
        """Every one of ``chunks`` chunks of a fresh session, in order (``Measure``)."""
        start = StartSession(session_id=CALIBRATION_SESSION, prompt="calibration", width=width, height=height)
        self._calls.clear()
        timed = []
        try:
            (state,) = self._driver.open(start)
            steps = state.geometry.num_inference_steps
            for _ in range(chunks):
                self._calls.clear()
                self._driver.run([CALIBRATION_SESSION], 1)
                timed.append(self._sample(width, height, steps))
        finally:
            self._driver.release(CALIBRATION_SESSION)
        return tuple(timed)

    def measure_encode(self, defaults: SessionGeometry) -> float:
        """Seconds a later chunk's input frames take through the encoder at the
        default frame (``take_input`` of a session's second chunk, its encoder's
        cache warm); 0 where the pipeline takes no input or refuses this one."""
        if not self._pipeline.capabilities.video_input:
            return 0.0
        width, height = defaults.width, defaults.height
        given = VideoInput(strength=ENCODE_STRENGTH, format="raw", width=width, height=height, fps=defaults.fps)
        start = StartSession(
            session_id=CALIBRATION_SESSION, prompt="calibration", width=width, height=height, input=given
        )
        try:
            self._pipeline.describe(start)
        except ValueError as error:
            log.info("calibration: the input frames' encode not measured (%s)", error)
            return 0.0
        frames = [
            np.zeros((count, height, width, 3), dtype=np.uint8)
            for count in (defaults.first_chunk_frames, defaults.frames_per_chunk)
        ]
        try:
            self._driver.open(start)
            self._driver.run([CALIBRATION_SESSION], 1, inputs={CALIBRATION_SESSION: frames[:1]})
            self._calls.clear()
            self._driver.run([CALIBRATION_SESSION], 1, inputs={CALIBRATION_SESSION: frames[1:]})
        except Exception as error:  # the sessions will say it: text to video need not wait on it
            log.warning(
                "calibration: the input frames' encode failed (%s: %s); not counted", type(error).__name__, error
            )
            return 0.0
        finally:
            self._driver.release(CALIBRATION_SESSION)
        return sum(call.ms for call in self._calls if call.stage == "take_input") / 1000

    def _sample(self, width: int, height: int, steps: int) -> ChunkCostSample:
        seconds: dict[str, float] = defaultdict(float)
        for call in self._calls:
            seconds[call.stage] += call.ms / 1000
        step_s = sum(seconds[stage] for stage in STEP_STAGES) / steps
        rest = sum(value for stage, value in seconds.items() if stage not in STEP_STAGES + SKIPPED_STAGES)
        return ChunkCostSample(width=width, height=height, pixels=width * height, step_s=step_s, chunk_s=rest)

    def close(self) -> None:
        self._driver.close()
