"""The page's playback buffer policy, as ``rtvideo/bench/playback.py`` mirrors it, and the
simulated viewer ``rtvideo bench realtime`` plays each session through.

The policy's constants are read from the page itself (``rtvideo/server/static/index.html``,
``const LEAD``): the two copies cannot drift apart unnoticed. That both take the
same decisions on the same events is checked in Chromium
(``tests/browser/test_key_to_pixel.py``)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from rtvideo.bench import playback
from rtvideo.bench.playback import LeadPolicy, SimulatedPlayer
from rtvideo.engine.messages import SessionGeometry
from rtvideo.engine.pacing import wait_seconds
from rtvideo.engine.session import EngineSession, Phase

FPS, CHUNK_FRAMES = 16.0, 12  # the page's usual session: chunks of 0.75 s
PAGE = Path(__file__).resolve().parents[2] / "rtvideo" / "server" / "static" / "index.html"


def page_constants() -> dict[str, float]:
    match = re.search(r"^const LEAD = (\{[^}]*\});", PAGE.read_text(), re.MULTILINE)
    assert match, "index.html has no `const LEAD = {...};` line"
    return json.loads(re.sub(r"(\w+):", r'"\1":', match.group(1)))


def test_the_page_and_the_bench_share_the_policys_constants():
    assert page_constants() == {
        "startS": playback.START_S,
        "stepS": playback.STEP_S,
        "maxS": playback.MAX_S,
        "calmS": playback.CALM_S,
        "shrinkS": playback.SHRINK_S,
        "reportEveryS": playback.REPORT_EVERY_S,
    }


def test_the_lead_starts_small_grows_after_each_underrun_up_to_the_most_and_shrinks_back_when_calm():
    policy = LeadPolicy()
    assert policy.lead_s == playback.START_S < 0.75  # less than a chunk (12 frames at 16 fps)
    policy.played(100.0)
    assert policy.lead_s == playback.START_S  # never below where it started
    policy.underrun()
    assert policy.lead_s == playback.START_S + playback.STEP_S and policy.underruns == 1
    for _ in range(20):
        policy.underrun()
    assert policy.lead_s == playback.MAX_S
    policy.played(playback.CALM_S - 0.01)
    assert policy.lead_s == playback.MAX_S  # not calm for long enough yet
    policy.underrun()  # a stall starts the calm count again
    policy.played(playback.CALM_S - 0.01)
    assert policy.lead_s == playback.MAX_S
    policy.played(0.01)
    assert policy.lead_s == playback.MAX_S - playback.SHRINK_S
    steps = round((playback.MAX_S - playback.START_S) / playback.SHRINK_S)
    for _ in range(steps + 5):
        policy.played(playback.CALM_S)
    assert policy.lead_s == playback.START_S


def test_the_reported_playhead_is_ahead_by_what_the_lead_grew_by():
    policy = LeadPolicy()
    assert policy.reported(3.0) == 3.0  # at the start: the truth, and the server's budget is the lead
    policy.underrun()
    assert policy.reported(3.0) == pytest.approx(3.0 + playback.STEP_S)
    assert policy.reported(0.0) == pytest.approx(playback.STEP_S)


@pytest.mark.parametrize("underruns", range(8))
def test_the_server_paced_on_the_reported_playhead_runs_the_current_lead_ahead_of_the_picture(underruns):
    """The page's policy against the engine's own pacing decision: the session asks
    for ``START_S`` and reports ``reported(position)``; after any number of
    underruns the server begins a chunk exactly while what it generated is less
    than the current lead ahead of the picture. So a picture that has caught up
    with everything generated never holds the session (a playhead reported
    behind held it for good once the lead had grown by ``START_S``)."""
    policy = LeadPolicy()
    for _ in range(underruns):
        policy.underrun()
    chunk_s = CHUNK_FRAMES / FPS
    for chunks in range(1, 9):
        session = paced_session(chunks, budget=policy.start_s)
        generated = chunks * chunk_s
        for ahead in (0.0, chunk_s / 2, policy.lead_s - chunk_s / 4, policy.lead_s, policy.lead_s + chunk_s):
            position = generated - ahead
            if position < 0:
                continue
            wait = wait_seconds(session, policy.reported(position), now=1000.0)
            assert (wait == 0.0) == (ahead < policy.lead_s), (underruns, chunks, ahead, wait)


def paced_session(chunks: int, budget: float) -> EngineSession:
    """A session between chunks that has made ``chunks`` chunks, paced at ``budget``."""
    geometry = SessionGeometry(
        width=32,
        height=32,
        fps=FPS,
        num_inference_steps=4,
        first_chunk_frames=CHUNK_FRAMES,
        frames_per_chunk=CHUNK_FRAMES,
        num_chunks=None,
        transition_chunks=0,
    )
    session = EngineSession(
        "s", geometry, opened=True, next_chunk=chunks, chunks_done=chunks, first_emit_at=0.0, max_lead_seconds=budget
    )
    assert session.phase is Phase.BOUNDARY
    return session


def test_a_fixed_lead_never_moves():
    policy = LeadPolicy(1.5, adaptive=False)
    policy.underrun()
    policy.played(100.0)
    assert policy.lead_s == 1.5 and policy.underruns == 1 and policy.reported(4.0) == 4.0
    with pytest.raises(ValueError, match="must be > 0"):
        LeadPolicy(0.0)


def test_the_player_plays_in_real_time_stalls_when_it_catches_up_and_resumes_with_more_media():
    player = SimulatedPlayer(LeadPolicy())
    player.received(10.0, 0.5625)  # chunk 0: 9 frames
    player.advance(10.3)
    assert player.position == pytest.approx(0.3) and not player.stalled
    player.received(10.4, 1.3125)
    player.advance(11.5)  # ran dry at 10.0 + 1.3125
    assert player.position == pytest.approx(1.3125) and player.stalled
    assert player.policy.underruns == 1 and player.policy.lead_s == playback.START_S + playback.STEP_S
    player.advance(12.0)
    assert player.position == pytest.approx(1.3125) and player.policy.underruns == 1  # one stall, one underrun
    player.received(12.0, 2.0625)
    assert not player.stalled and player.stalled_s == pytest.approx(12.0 - 11.3125)
    player.advance(12.5)
    assert player.position == pytest.approx(1.8125)


def test_a_watched_frame_is_shown_when_the_playhead_reaches_it():
    player = SimulatedPlayer(LeadPolicy())
    player.received(0.0, 0.5625)
    player.received(0.1, 1.3125)
    player.watch(1.3125, since=0.2)  # the applied chunk (2) begins at 1.3125 s: not received yet
    player.received(0.9, 2.0625)
    player.advance(2.0)
    assert player.shown_after() == [pytest.approx(1.3125 - 0.2)]


def test_a_watched_frame_the_player_waits_for_is_shown_when_it_arrives():
    player = SimulatedPlayer(LeadPolicy())
    player.received(0.0, 0.5625)
    player.watch(0.5625, since=0.1)
    player.advance(1.0)  # stalled at 0.5625 s from 0.5625 on, waiting for the applied chunk
    assert player.stalled and player.shown_after() == []
    player.received(1.2, 1.3125)
    assert player.shown_after() == [pytest.approx(1.1)]


def test_the_end_of_a_session_is_not_an_underrun_and_what_was_received_plays_out():
    player = SimulatedPlayer(LeadPolicy())
    player.received(0.0, 0.5625)
    player.received(0.1, 1.3125)
    player.watch(0.5625, since=0.05)
    player.finish(0.2)
    assert player.policy.underruns == 0 and not player.stalled
    assert player.clock == pytest.approx(1.3125) and player.position == pytest.approx(1.3125)
    assert player.shown_after() == [pytest.approx(0.5625 - 0.05)]
