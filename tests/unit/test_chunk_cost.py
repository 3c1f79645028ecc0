"""The chunk cost model, the real-time load arithmetic, and admission by both
(``rtvideo.engine.chunk_cost``, ``rtvideo.engine.control``): pure, with hand-made measurements."""

from __future__ import annotations

import pytest

from rtvideo.engine.chunk_cost import ChunkCostModel, SessionLoad, realtime_load, realtime_pixels
from rtvideo.engine.config import EngineConfig
from rtvideo.engine.control import ControlPlane
from rtvideo.engine.messages import ChunkCostSample, ChunkReady, ChunkTiming, SessionGeometry, StartSession, VideoInput
from rtvideo.workers.pipelines.stub import StubPipeline


def sample(side: int, step_s: float, chunk_s: float, encode_s: float = 0.0) -> ChunkCostSample:
    return ChunkCostSample(
        width=side, height=side, pixels=side * side, step_s=step_s, chunk_s=chunk_s, encode_s=encode_s
    )


def geometry(side: int = 64, fps: float = 16.0, frames: int = 12, steps: int = 4) -> SessionGeometry:
    return SessionGeometry(
        width=side,
        height=side,
        fps=fps,
        num_inference_steps=steps,
        first_chunk_frames=9,
        frames_per_chunk=frames,
        num_chunks=None,
        transition_chunks=0,
    )


def chunk(
    side: int, index: int, denoise_ms: float, decode_ms: float, steps: int = 4, encode_ms: float = 0.0
) -> ChunkReady:
    timing = ChunkTiming(
        boundary_ms=encode_ms,
        denoise_ms=denoise_ms,
        decode_ms=decode_ms,
        steps=steps,
        runner_calls=(),
        encode_ms=encode_ms,
    )
    return ChunkReady(
        session_id="s",
        generation_chunk_index=index,
        num_frames=12,
        first_frame_index=0,
        media_start_seconds=0.0,
        width=side,
        height=side,
        started_event_ids=(),
        active_event_ids=(),
        completed_event_ids=(),
        timing=timing,
        payload=b"",
    )


# -- the model ------------------------------------------------------------------------


def test_the_model_gives_back_what_it_measured_and_scales_steps():
    model = ChunkCostModel([sample(128, 0.01, 0.04), sample(64, 0.002, 0.02)])
    assert model.estimate(64, 64, 4) == pytest.approx(4 * 0.002 + 0.02)
    assert model.estimate(128, 128, 4) == pytest.approx(4 * 0.01 + 0.04)
    assert model.estimate(128, 128, 1) == pytest.approx(0.01 + 0.04)


def test_between_two_measurements_each_part_follows_a_power_law():
    # step_s: x4 per x4 area (exponent 1); chunk_s: x16 per x4 area (exponent 2)
    model = ChunkCostModel([sample(64, 0.001, 0.01), sample(128, 0.004, 0.16)])
    assert model.estimate(64, 128, 1) == pytest.approx(0.002 + 0.04)  # twice the area


def test_beyond_the_largest_measurement_cost_grows_at_least_linearly():
    # Overheads make the measured growth sublinear (x2 per x4 area): extrapolated as linear.
    model = ChunkCostModel([sample(64, 0.0, 0.01), sample(128, 0.0, 0.02)])
    assert model.estimate(256, 256, 4) == pytest.approx(0.08)
    # Superlinear growth (attention) carries on as measured.
    steep = ChunkCostModel([sample(64, 0.0, 0.01), sample(128, 0.0, 0.08)])
    assert steep.estimate(256, 256, 4) == pytest.approx(0.64)


def test_cost_never_falls_as_the_frame_grows():
    noisy = ChunkCostModel([sample(64, 0.0, 0.02), sample(128, 0.0, 0.01)])
    assert noisy.estimate(96, 96, 4) == pytest.approx(0.02)


def test_nothing_measured_means_no_estimate():
    assert ChunkCostModel().estimate(64, 64, 4) is None


def test_an_observed_chunk_replaces_the_model_at_its_size_smoothed():
    model = ChunkCostModel([sample(64, 0.001, 0.01)])
    model.observe(chunk(64, 0, denoise_ms=400.0, decode_ms=100.0))  # a first chunk: skipped
    assert model.estimate(64, 64, 4) == pytest.approx(0.014)
    model.observe(chunk(64, 1, denoise_ms=40.0, decode_ms=10.0))
    assert model.estimate(64, 64, 4) == pytest.approx(0.05)
    model.observe(chunk(64, 2, denoise_ms=80.0, decode_ms=20.0))
    assert model.estimate(64, 64, 4) == pytest.approx(0.05 + 0.3 * 0.05)
    assert model.estimate(128, 128, 4) == pytest.approx(0.056)  # other sizes: the model


def test_an_input_sessions_chunk_counts_its_encode_and_a_text_sessions_does_not():
    model = ChunkCostModel([sample(32, 0.01, 0.1, encode_s=0.05), sample(64, 0.04, 0.4, encode_s=0.2)])
    assert model.estimate(32, 32, 2) == pytest.approx(0.12)
    assert model.estimate(32, 32, 2, encode=True) == pytest.approx(0.17)
    assert model.estimate(45, 45, 2, encode=True) - model.estimate(45, 45, 2) == pytest.approx(0.05 * 45**2 / 32**2)
    unmeasured = ChunkCostModel([sample(32, 0.01, 0.1)])  # a pipeline that takes no input: nothing to add
    assert unmeasured.estimate(32, 32, 2, encode=True) == unmeasured.estimate(32, 32, 2)


def test_an_observed_encode_is_the_encodes_not_the_chunks():
    """A chunk of an input session reports its encode within its boundary time:
    the encode's estimate takes it, the chunk's (every session's) does not."""
    model = ChunkCostModel([sample(32, 0.01, 0.1, encode_s=0.05)])
    model.observe(chunk(32, 1, denoise_ms=40.0, decode_ms=100.0, encode_ms=300.0))
    assert model.estimate(32, 32, 4) == pytest.approx(0.04 + 0.1)
    assert model.estimate(32, 32, 4, encode=True) == pytest.approx(0.04 + 0.1 + 0.3)
    model.observe(chunk(32, 2, denoise_ms=0.0, decode_ms=100.0, steps=0, encode_ms=100.0))  # strength 0
    assert model.estimate(32, 32, 4) == pytest.approx(0.04 + 0.1)
    assert model.estimate(32, 32, 4, encode=True) == pytest.approx(0.14 + 0.3 + 0.3 * (0.1 - 0.3))


def test_an_unmeasured_pipeline_learns_from_its_chunks():
    model = ChunkCostModel()
    model.observe(chunk(32, 1, denoise_ms=400.0, decode_ms=0.0))
    assert model.estimate(32, 32, 4) == pytest.approx(0.4)
    assert model.estimate(64, 64, 4) is None


# -- the largest frame served in real time ------------------------------------------------


def test_the_realtime_frame_is_the_largest_whose_chunk_fits_the_margin():
    # A chunk costs 1 s per 100,000 pixels (all in chunk_s); a chunk plays 0.75 s.
    model = ChunkCostModel([sample(100, 0.0, 0.1), sample(200, 0.0, 0.4)])
    pixels = realtime_pixels(model, geometry(64), load_limit=0.9, largest=1280**2)
    assert abs(pixels - 67_500) <= 1  # 0.9 x 0.75 s = 0.675 s (to the last bit of a float)
    assert model.area_cost(pixels, 4) <= 0.9 * 0.75 < model.area_cost(pixels + 1, 4)


def test_the_realtime_frame_is_never_below_the_default_nor_above_the_largest():
    slow = ChunkCostModel([sample(64, 1.0, 1.0)])
    assert realtime_pixels(slow, geometry(64), 0.9, 1280**2) == 64 * 64
    fast = ChunkCostModel([sample(64, 0.0, 1e-6)])
    assert realtime_pixels(fast, geometry(64), 0.9, 1280**2) == 1280**2
    assert realtime_pixels(ChunkCostModel(), geometry(64), 0.9, 1280**2) is None


# -- the load arithmetic -----------------------------------------------------------------


def test_paced_sessions_need_their_cost_over_their_media_time():
    assert realtime_load([SessionLoad(0.3, 0.75, True), SessionLoad(0.15, 0.75, True)]) == pytest.approx(0.6)
    assert realtime_load([SessionLoad(0.3, 0.75, True), SessionLoad(0.3, 1.5, True)]) == pytest.approx(0.6)


def test_unpaced_sessions_have_no_deadline_but_take_a_turn_every_round():
    assert realtime_load([SessionLoad(5.0, 0.75, False), SessionLoad(5.0, 0.75, False)]) == 0.0
    # A job's chunk lands between two chunks of the paced session (0.75 s of media each).
    load = realtime_load([SessionLoad(0.15, 0.75, True), SessionLoad(0.3, 0.25, False), SessionLoad(0.3, 1.5, True)])
    assert load == pytest.approx(0.2 + 0.4 + 0.2)


# -- admission ------------------------------------------------------------------------------


def control(costs: ChunkCostModel | None, **config) -> tuple[ControlPlane, list]:
    sent: list = []
    plane = ControlPlane(EngineConfig(max_sessions=8, **config), StubPipeline().describe, sent.append, costs=costs)
    return plane, sent


def paced(sid: str, **fields) -> StartSession:
    return StartSession(session_id=sid, prompt="p", max_lead_seconds=2.0, **fields)


def test_a_session_that_would_break_the_paced_sessions_deadlines_is_refused():
    """Stub chunks play 0.25 s (4 frames at 16 fps); a 32x32 chunk costs 0.1 s here: 0.4 of the worker."""
    plane, sent = control(ChunkCostModel([sample(32, 0.0, 0.1)]))
    plane.handle(paced("a"))
    plane.handle(paced("b"))  # 0.8
    plane.handle(paced("c"))  # 1.2: over 0.9
    plane.handle(StartSession(session_id="job", prompt="p"))  # unpaced: a turn per round, 0.4 more
    assert [type(m).__name__ for m in sent] == [
        "SessionStarted",
        "SessionStarted",
        "SessionRejected",
        "SessionRejected",
    ]
    refused = sent[2]
    assert refused.code == "server_full"
    assert "a 32x32 chunk takes about 0.100 s of the worker for 0.250 s of media" in refused.message
    assert "would need 1.20 of the worker's time, over the 0.9" in refused.message
    small = paced("small", width=16, height=16)  # a quarter of the area: 0.1 more
    plane.handle(small)
    assert type(sent[-1]).__name__ == "SessionStarted"


def test_an_input_sessions_encode_counts_for_admission():
    """A 32x32 stub chunk costs 0.1 s, its input frames' encode 0.05 s more: two
    text sessions need 0.8 of the worker, a text one and a video-to-video one 1.0."""
    costs = ChunkCostModel([sample(32, 0.0, 0.1, encode_s=0.05)])
    given = VideoInput(strength=0.5, format="raw", width=32, height=32, fps=16.0)
    plane, sent = control(costs)
    plane.handle(paced("a", width=32, height=32))
    plane.handle(paced("b", width=32, height=32))
    assert [type(m).__name__ for m in sent] == ["SessionStarted"] * 2
    plane, sent = control(costs)
    plane.handle(paced("a", width=32, height=32))
    plane.handle(paced("v", input=given))
    assert [type(m).__name__ for m in sent] == ["SessionStarted", "SessionRejected"]
    assert "a 32x32 chunk takes about 0.150 s of the worker" in sent[1].message


def test_a_session_alone_and_unpaced_sessions_alone_are_admitted():
    plane, sent = control(ChunkCostModel([sample(32, 0.0, 1.0)]))  # 4 s of work per 0.25 s of media
    plane.handle(paced("alone"))
    assert type(sent[-1]).__name__ == "SessionStarted"
    plane.unregister("alone")
    for sid in "abc":
        plane.handle(StartSession(session_id=sid, prompt="p"))  # jobs: nobody's deadline
    assert [type(m).__name__ for m in sent[1:]] == ["SessionStarted"] * 3


def test_admission_by_cost_can_be_turned_off():
    plane, sent = control(ChunkCostModel([sample(32, 0.0, 1.0)]), max_realtime_load=None)
    for sid in "abc":
        plane.handle(paced(sid))
    assert [type(m).__name__ for m in sent] == ["SessionStarted"] * 3


def test_a_frame_over_max_pixels_is_refused_naming_both_fields():
    sent: list = []
    describe = StubPipeline().describe
    plane = ControlPlane(EngineConfig(), describe, sent.append, max_pixels=32 * 32, pixels_derived=True)
    plane.handle(StartSession(session_id="wide", prompt="p", width=64, height=32))
    plane.handle(StartSession(session_id="fits", prompt="p", width=32, height=32))
    refused, started = sent
    assert refused.code == "invalid_request"
    assert refused.message.startswith("width x height: 64x32 is 2048 pixels; this server takes at most 1024")
    assert "measured" in refused.message and started.session_id == "fits"
