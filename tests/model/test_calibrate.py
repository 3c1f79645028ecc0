"""``rtvideo.workers.calibrate`` on the tiny model: which frames it measures when the
default frame is past the load limit, and when a larger frame would not fit in
the memory sessions may hold; with injected timings, that the size it derives
is the median of each frame's measurements, and that a configured frame bound
measures no larger frame. (The usual path, larger frames measured until the
real-time frame lies between two of them, runs through a real worker in
``tests/engine/test_realtime_limits.py``.)"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from rtvideo.engine.messages import ChunkCostSample, StartSession
from rtvideo.workers.calibrate import REPEATS, calibrate
from rtvideo.workers.pipelines.causal_wan import build

FILL = 1.25
"""How much dearer than a session's first chunk ``Timings`` makes every later one."""


@pytest.fixture(scope="module")
def pipeline():
    return build("tiny", device="cpu")


def _state_bytes(pipeline, side: int) -> int:
    return pipeline.describe(StartSession(session_id="s", prompt="p", width=side, height=side)).state_bytes


def test_a_default_frame_past_the_load_limit_is_the_answer_and_a_smaller_frame_gives_the_slope(pipeline):
    calibration = calibrate(pipeline, load_limit=1e-6)  # no chunk is that cheap
    assert [sample.pixels for sample in calibration.samples] == [32 * 32, 64 * 64]
    assert calibration.realtime_pixels == 64 * 64  # the default stays served
    assert all(sample.step_s > 0 and sample.chunk_s > 0 for sample in calibration.samples)


def test_a_larger_frame_that_would_not_fit_in_memory_is_not_measured(pipeline, monkeypatch):
    room = 2 * _state_bytes(pipeline, 64) + 1  # the default and its activations, not a 128x128 session's
    assert 2 * _state_bytes(pipeline, 128) > room
    monkeypatch.setattr(pipeline, "session_memory_budget", lambda: room)
    calibration = calibrate(pipeline, load_limit=1e6)  # every frame in real time: only memory stops it
    assert [sample.pixels for sample in calibration.samples] == [32 * 32, 64 * 64]
    assert calibration.realtime_pixels >= 64 * 64


def test_with_room_a_default_in_real_time_measures_larger_frames(pipeline, monkeypatch):
    room = 2 * _state_bytes(pipeline, 128) + 1  # 128x128 fits; 256x256 would not
    monkeypatch.setattr(pipeline, "session_memory_budget", lambda: room)
    calibration = calibrate(pipeline, load_limit=1e6)
    assert [sample.pixels for sample in calibration.samples] == [64 * 64, 128 * 128]


class Timings:
    """A ``Measure`` of made-up chunks: a denoise step costs 1 ms x (pixels / 64x64)^1.3,
    the rest of a chunk 5 ms x (pixels / 64x64)^1.1 (power laws, which the cost model
    interpolates exactly), a session's later chunks ``FILL`` times its first; each
    chunk multiplied by the next of ``factors``, cycled, counted per frame area and
    per kind (first or later chunk): with three factors, each frame's three first
    chunks get one each, and so do the three steady chunks of the default's."""

    def __init__(self, *factors: float) -> None:
        self.factors = factors
        self.count: Counter[tuple[int, bool]] = Counter()
        self.sessions: Counter[int] = Counter()  # sessions per frame area

    def __call__(self, width: int, height: int, chunks: int) -> list[ChunkCostSample]:
        pixels = width * height
        self.sessions[pixels] += 1
        made = []
        for index in range(chunks):
            kind = (pixels, index == 0)
            factor = self.factors[self.count[kind] % len(self.factors)] * (1.0 if index == 0 else FILL)
            self.count[kind] += 1
            step_s = 1e-3 * (pixels / 4096) ** 1.3 * factor
            chunk_s = 5e-3 * (pixels / 4096) ** 1.1 * factor
            made.append(ChunkCostSample(width=width, height=height, pixels=pixels, step_s=step_s, chunk_s=chunk_s))
        return made


def test_every_frame_is_measured_three_times_and_the_median_decides(pipeline):
    spread, median = Timings(1.0, 4.0, 2.0), Timings(2.0)
    calibration = calibrate(pipeline, load_limit=0.9, measure=spread)
    assert calibration.repeats == REPEATS == 3
    assert len(calibration.samples) >= 3  # the default, twice its sides, and a probe near the answer
    assert all(count == REPEATS for count in spread.sessions.values())  # the default's: one that fills, two more
    assert len(spread.sessions) == len(calibration.samples)
    expected = calibrate(pipeline, load_limit=0.9, measure=median)
    assert calibration.samples == expected.samples
    assert calibration.realtime_pixels == expected.realtime_pixels
    mean = calibrate(pipeline, load_limit=0.9, measure=Timings(7 / 3)).realtime_pixels
    fastest = calibrate(pipeline, load_limit=0.9, measure=Timings(1.0)).realtime_pixels
    slowest = calibrate(pipeline, load_limit=0.9, measure=Timings(4.0)).realtime_pixels
    assert slowest < mean < calibration.realtime_pixels < fastest
    least, decided, most = calibration.spread  # as the worker logs it: min / median / max
    assert decided == calibration.realtime_pixels
    assert least == pytest.approx(slowest, rel=0.01) and most == pytest.approx(fastest, rel=0.01)


def test_an_outlier_measurement_does_not_move_the_size(pipeline):
    quiet_timings = Timings(1.0)
    quiet = calibrate(pipeline, load_limit=0.9, measure=quiet_timings)
    # Two measurements that agree settle a frame: the median of three lies between them.
    assert all(count == 2 for count in quiet_timings.sessions.values())
    stalled = Timings(30.0, 1.0, 1.0)  # every frame's first measurement stalls, and one of the steady chunks
    disturbed = calibrate(pipeline, load_limit=0.9, measure=stalled)
    assert all(count == 3 for count in stalled.sessions.values())  # two that disagree: a third decides
    assert disturbed.realtime_pixels == quiet.realtime_pixels > 4 * 64 * 64
    assert disturbed.samples == quiet.samples
    assert disturbed.spread[0] < quiet.realtime_pixels  # the stalls show in the spread, not in the decision
    # Measured once, the stalled chunks decide alone.
    once = calibrate(pipeline, load_limit=0.9, repeats=1, measure=Timings(30.0, 1.0, 1.0))
    assert once.realtime_pixels < quiet.realtime_pixels / 4


def test_a_configured_frame_bound_measures_no_larger_frame_than_the_default(pipeline):
    timings = Timings(1.0)
    calibration = calibrate(pipeline, load_limit=0.9, derive_bound=False, measure=timings)
    assert set(timings.sessions) == {32 * 32, 64 * 64}  # the default and, for the slope, half its sides
    assert [sample.pixels for sample in calibration.samples] == [32 * 32, 64 * 64]
    assert (calibration.realtime_pixels, calibration.spread) == (None, None)


class FailingAbove(Timings):
    """``Timings`` whose chunks of frames larger than ``pixels`` raise ``error``
    (a device out of memory, unless told); the frames that failed are in ``failed``."""

    def __init__(self, pixels: int, error: type[Exception] = torch.cuda.OutOfMemoryError) -> None:
        super().__init__(1.0)
        self.pixels, self.error = pixels, error
        self.failed: list[int] = []

    def __call__(self, width: int, height: int, chunks: int) -> list[ChunkCostSample]:
        if width * height > self.pixels:
            self.failed.append(width * height)
            raise self.error(f"out of memory at {width}x{height}")
        return super().__call__(width, height, chunks)


@pytest.mark.parametrize("fits", [64 * 64, 160 * 160], ids=["the first larger frame", "a later probe"])
def test_a_larger_frame_that_runs_out_of_memory_is_not_measured_and_the_bound_stays_below_it(
    pipeline, fits, caplog, monkeypatch
):
    """No session asked for the frames calibration tries: one that runs out of
    memory (where ``_fits``'s estimate was wrong) must not stop the worker's
    start, nor leave its full device's peak as the sessions' transient: the
    pipeline is told, with the peak from before the measurement."""
    told = []
    monkeypatch.setattr(pipeline, "memory_mark", lambda: 12345, raising=False)
    monkeypatch.setattr(pipeline, "after_out_of_memory", told.append, raising=False)
    timings = FailingAbove(fits)
    calibration = calibrate(pipeline, load_limit=0.9, measure=timings)
    assert timings.failed, "no frame failed: the test measures nothing"
    assert told == [12345] * len(timings.failed)
    assert all(sample.pixels <= fits for sample in calibration.samples)
    assert 64 * 64 <= calibration.realtime_pixels < min(timings.failed)
    assert "chunk ran out of memory (out of memory at" in caplog.text
    # Without the failure, the same timings derive a larger frame: the bound is the failure's doing.
    assert calibrate(pipeline, load_limit=0.9, measure=Timings(1.0)).realtime_pixels > min(timings.failed)


def test_a_probe_that_fails_for_another_reason_fails_the_start(pipeline):
    """A device fault or a bug is no frame that does not fit: it is reported."""
    with pytest.raises(RuntimeError, match="out of memory at 128x128"):
        calibrate(pipeline, load_limit=0.9, measure=FailingAbove(64 * 64, error=RuntimeError))
