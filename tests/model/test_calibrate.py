"""``workers.calibrate`` on the tiny model: which frames it measures when the
default frame is past the load limit, and when a larger frame would not fit in
the memory sessions may hold. (The usual path, larger frames measured until
the real-time frame lies between two of them, runs through a real worker in
``tests/engine/test_realtime_limits.py``.)"""

from __future__ import annotations

import pytest

from engine.messages import StartSession
from workers.calibrate import calibrate
from workers.pipelines.causal_wan import build


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
