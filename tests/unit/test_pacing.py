"""Pacing policy (``rtvideo.engine.pacing``) with the clock passed in: the playhead, the
lead, and when a session may begin its next chunk; then the loop deciding on
an injected clock. Values are chosen exact in binary floating point."""

from __future__ import annotations

import pytest

from rtvideo.engine.config import EngineConfig
from rtvideo.engine.control import ControlPlane
from rtvideo.engine.loop import EngineLoop
from rtvideo.engine.messages import ChunkReady, Delivered, Playback, SessionGeometry, StartSession
from rtvideo.engine.pacing import (
    DECODE_RUN_AHEAD,
    EPSILON_S,
    lead_seconds,
    max_chunks_decoding,
    playhead_seconds,
    wait_seconds,
)
from rtvideo.engine.session import ChunkEvents, ChunkInFlight, EngineSession, Phase
from rtvideo.workers.pipelines.stub import StubPipeline
from rtvideo.workers.runner import ModelRunner
from tests.support import inline_loop

GEOMETRY = SessionGeometry(
    width=32,
    height=32,
    fps=16.0,
    num_inference_steps=4,
    first_chunk_frames=4,
    frames_per_chunk=4,
    num_chunks=None,
    transition_chunks=0,
)
CHUNK_S = 4 / 16.0


def session(
    frames_done: int = 0,
    first_emit_at: float | None = None,
    budget: float | None = 0.5,
    phase: Phase = Phase.BOUNDARY,
) -> EngineSession:
    """A session that delivered ``frames_done`` frames (whole chunks of 4), in ``phase``."""
    done = frames_done // GEOMETRY.frames_per_chunk
    s = EngineSession(
        "s",
        GEOMETRY,
        opened=phase is not Phase.NEW,
        next_chunk=done,
        chunks_done=done,
        first_emit_at=first_emit_at,
        max_lead_seconds=budget,
    )
    if phase is Phase.DENOISING:
        _begin_chunk(s)
    elif phase is Phase.FINISHING:
        s.stop_reason = lambda: "stopped"
    assert (s.frames_done, s.phase) == (frames_done, phase)
    return s


def _begin_chunk(s: EngineSession) -> None:
    index = s.next_chunk
    s.chunks[index] = ChunkInFlight(index, 4, ChunkEvents((), (), ()), None, 0)
    s.next_chunk = index + 1


# -- playhead ---------------------------------------------------------------


def test_the_playhead_is_zero_before_the_first_chunk_without_a_report():
    assert playhead_seconds(session(), None, now=123.0) == 0.0


def test_without_a_report_the_playhead_runs_in_real_time_from_the_first_emit():
    s = session(frames_done=8, first_emit_at=100.0)
    assert playhead_seconds(s, None, now=100.0) == 0.0
    assert playhead_seconds(s, None, now=100.375) == 0.375


def test_a_reported_playhead_wins_over_the_real_time_estimate():
    s = session(frames_done=8, first_emit_at=100.0)
    assert playhead_seconds(s, 0.125, now=200.0) == 0.125
    assert playhead_seconds(session(), 2.0, now=0.0) == 2.0  # even before the first chunk


# -- lead -------------------------------------------------------------------


def test_the_lead_is_media_done_minus_the_playhead():
    s = session(frames_done=8, first_emit_at=100.0)  # 0.5 s of media
    assert lead_seconds(s, None, now=100.0) == 0.5
    assert lead_seconds(s, None, now=100.125) == 0.375
    assert lead_seconds(s, 0.25, now=500.0) == 0.25
    assert lead_seconds(s, 0.75, now=100.0) == -0.25  # the viewer is past what was generated


# -- wait_seconds -----------------------------------------------------------


def test_no_budget_never_holds_back():
    s = session(frames_done=16 * 60, first_emit_at=100.0, budget=None)  # a minute ahead
    assert wait_seconds(s, 0.0, now=100.0) == 0.0
    assert wait_seconds(s, None, now=100.0) == 0.0


@pytest.mark.parametrize("phase", [Phase.NEW, Phase.DENOISING, Phase.FINISHING])
def test_only_a_session_between_chunks_is_held(phase):
    s = session(frames_done=16, first_emit_at=100.0, phase=phase)  # 1 s of media, budget 0.5
    assert wait_seconds(s, 0.0, now=100.0) == 0.0
    assert wait_seconds(s, None, now=100.0) == 0.0


def test_under_budget_runs_now():
    s = session(frames_done=4, first_emit_at=100.0)  # lead 0.25 < 0.5
    assert wait_seconds(s, 0.0, now=100.0) == 0.0
    assert wait_seconds(s, None, now=100.0) == 0.0
    assert wait_seconds(session(frames_done=0), None, now=100.0) == 0.0  # nothing emitted yet


def test_over_budget_with_a_report_waits_for_the_next_report():
    s = session(frames_done=16, first_emit_at=100.0)  # 1 s of media
    assert wait_seconds(s, 0.25, now=100.0) is None  # lead 0.75: only a report frees it
    assert wait_seconds(s, 0.25, now=10_000.0) is None  # time alone does not move a reported playhead
    assert wait_seconds(s, 0.5, now=100.0) is None  # exactly at the budget: held
    assert wait_seconds(s, 0.625, now=100.0) == 0.0  # the viewer moved: under budget


def test_over_budget_without_a_report_waits_until_real_time_catches_up_plus_epsilon():
    s = session(frames_done=16, first_emit_at=8.0)  # 1 s of media, budget 0.5
    assert wait_seconds(s, None, now=8.25) == 0.25 + EPSILON_S  # lead 0.75: 0.25 over
    # Exactly at the budget is still held, for EPSILON: a wake-up a little after, never a little before.
    assert wait_seconds(s, None, now=8.5) == EPSILON_S
    assert wait_seconds(s, None, now=8.25 + wait_seconds(s, None, now=8.25)) == 0.0
    assert wait_seconds(s, None, now=8.5 + EPSILON_S) == 0.0


# -- the loop on an injected clock ------------------------------------------


class FakeClock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _loop(clock: FakeClock, config: EngineConfig | None = None) -> tuple[EngineLoop, ControlPlane, list]:
    sent: list = []
    config = config or EngineConfig()
    runner = ModelRunner(StubPipeline())
    control = ControlPlane(config, runner.describe, sent.append)
    loop = inline_loop(config, control, runner, sent.append, grouping=True, max_rows=1, clock=clock)
    return loop, control, sent


def _held(loop: EngineLoop) -> float | None:
    """Plan as the loop would now; the plan must be empty (every session held).
    Returns when a held session may run again (None: only a report frees it)."""
    step, wake_in = loop.plan(loop.control.pacing_state()[1])
    assert step.is_empty(), step
    return wake_in


def _chunks(sent: list) -> list[int]:
    return [m.generation_chunk_index for m in sent if isinstance(m, ChunkReady)]


def test_the_loop_paces_on_its_clock_from_the_first_emit():
    clock = FakeClock(100.0)
    loop, control, sent = _loop(clock)
    control.handle(StartSession(session_id="s", prompt="p", max_lead_seconds=0.5, num_inference_steps=1))
    loop.run_once()
    loop.run_once()
    assert _chunks(sent) == [0, 1] and loop.sessions["s"].first_emit_at == 100.0

    # 0.5 s ahead of a playhead still at 0: held, to wake just after the budget allows.
    assert _held(loop) == EPSILON_S
    clock.now = 100.0 + EPSILON_S
    loop.run_once()
    assert _chunks(sent) == [0, 1, 2]
    assert _held(loop) == pytest.approx(0.25)  # 0.75 s of media at playhead 0.001: 0.249 over

    clock.now = 100.125  # not yet: 0.125 over
    assert _held(loop) == pytest.approx(0.125 + EPSILON_S)
    clock.now = 100.25 + EPSILON_S
    loop.run_once()
    assert _chunks(sent) == [0, 1, 2, 3]


def test_a_report_overrides_the_clock_and_frees_exactly_what_it_allows():
    clock = FakeClock(100.0)
    loop, control, sent = _loop(clock)
    control.handle(StartSession(session_id="s", prompt="p", max_lead_seconds=0.5, num_inference_steps=1))
    loop.run_once()
    loop.run_once()
    control.handle(Playback(session_id="s", position_seconds=0.0))
    clock.now = 1_000.0  # real time is far ahead; the report is what counts
    assert _held(loop) is None  # only a report frees it

    control.handle(Playback(session_id="s", position_seconds=CHUNK_S))  # frees one chunk
    loop.run_once()
    _held(loop)
    assert _chunks(sent) == [0, 1, 2]
    control.handle(Playback(session_id="s", position_seconds=3 * CHUNK_S))  # frees two
    loop.run_once()
    loop.run_once()
    _held(loop)
    assert _chunks(sent) == [0, 1, 2, 3, 4]


def test_a_client_that_takes_no_media_holds_its_session_paced_or_not():
    """Past max_undelivered_seconds of media beyond what was written to its socket,
    a session waits for a delivery report, whatever its pacing budget says."""
    for budget in (None, 100.0):
        s = session(frames_done=64, budget=budget)  # 4 s made at 16 fps
        s.max_undelivered_seconds = 2.0
        assert wait_seconds(s, None, now=100.0, delivered=2.5) == 0.0  # 1.5 s undelivered
        assert wait_seconds(s, None, now=100.0, delivered=2.0) is None  # 2 s: only a report frees it
        assert wait_seconds(s, None, now=100.0) == 0.0  # nothing delivered yet, nothing to hold on
        _begin_chunk(s)
        assert wait_seconds(s, None, now=100.0, delivered=0.0) == 0.0  # a chunk in progress is never held


def _committed(index: int) -> ChunkInFlight:
    return ChunkInFlight(index, 4, ChunkEvents((), (), ()), None, 0)


def test_a_session_with_its_decode_stage_full_waits_for_a_decode_whatever_else_allows():
    """Decode backpressure: with ``DECODE_RUN_AHEAD`` committed chunks not yet
    decoded beyond its chunks in flight (``max_chunks_decoding``), a session
    between chunks waits until a decode comes back (None: only an event frees
    it), unpaced and with nothing undelivered; with fewer, it runs; a chunk
    under way is never held."""
    for lookahead in (1, 2):  # exact; stream batch on two ranks
        for budget in (None, 100.0):
            s = session(frames_done=8, budget=budget)
            s.lookahead = lookahead
            limit = max_chunks_decoding(s)
            assert limit == lookahead + DECODE_RUN_AHEAD
            s.decoding = {index: _committed(index) for index in range(limit - 1)}
            assert wait_seconds(s, None, now=100.0) == 0.0
            s.decoding[limit - 1] = _committed(limit - 1)
            assert wait_seconds(s, None, now=100.0) is None
            assert wait_seconds(s, None, now=100.0, begins=False) == 0.0  # its chunk under way goes on
            del s.decoding[0]  # chunk 0 came back
            assert wait_seconds(s, None, now=100.0) == 0.0


def test_a_session_whose_server_reports_delivery_is_held_before_the_first_report():
    """A live session (``reports_delivery``) counts nothing as written until its
    server's first report: a client that takes nothing from the start holds it
    after ``max_undelivered_seconds``, however late that report comes; a session
    no one reports on (a job) runs on."""
    for reports, held_after in ((True, [0, 1]), (False, [0, 1, 2, 3, 4, 5])):
        loop, control, sent = _loop(FakeClock(100.0), EngineConfig(max_undelivered_seconds=2 * CHUNK_S))
        start = StartSession(session_id="s", prompt="p", num_inference_steps=1, reports_delivery=reports)
        control.handle(start)
        for _ in held_after:  # one chunk a turn (a held turn would wait for a report)
            loop.run_once()
        assert _chunks(sent) == held_after, reports
        if not reports:
            assert not loop.plan(control.pacing_state()[1])[0].is_empty()  # runs on
        else:
            assert _held(loop) is None  # only a report frees it
            control.handle(Delivered(session_id="s", media_seconds=CHUNK_S))  # one chunk taken: frees one
            loop.run_once()
            assert _held(loop) is None and _chunks(sent) == [0, 1, 2]


def test_a_live_start_says_its_server_reports_delivery_and_a_job_start_does_not():
    from rtvideo.server.schemas import JobRequest, resolve
    from rtvideo.server.settings import ServerSettings

    for paced in (True, False):  # a live session's start is paced; a job's is not
        start, _ = resolve(JobRequest(prompt="p", num_chunks=2), "s", GEOMETRY, ServerSettings(), "stub", paced=paced)
        assert start.reports_delivery is paced
