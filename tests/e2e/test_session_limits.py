"""What one realtime session lets its viewers cost, against the server as a
subprocess with real clients: at most ``max_spectators`` spectators (one
more is refused, naming the limit); a spectator that stops reading is
dropped while its controller gets every chunk; and interactions past
``max_interactions_per_s`` are refused one by one (``rate_limited``) while
the session streams on and takes later ones."""

from __future__ import annotations

import time

import pytest
from websockets.exceptions import ConnectionClosed

from tests.e2e.client import Chunk, Realtime, interaction
from tests.e2e.conftest import start_server, stop_server
from tests.e2e.test_live_sessions import dial, fatal
from tests.e2e.test_realtime import metric, scrape

START = {
    "type": "session.start",
    "prompt": "a lighthouse",
    "width": 32,
    "height": 24,
    "format": "raw",
    "num_chunks": None,
    "max_lead_seconds": 0.5,
}
RATE, BURST = 2, 3


@pytest.fixture(scope="module")
def server():
    running = start_server(
        "--max-sessions",
        "4",
        "--max-spectators",
        "2",
        "--max-interactions-per-s",
        str(RATE),
        "--interaction-burst",
        str(BURST),
        pipeline={"step_time_s": 0.005},
    )
    yield running
    stop_server(running)


async def stop(controller: Realtime) -> None:
    await controller.send({"type": "session.stop"})
    assert (await controller.rest()).of("session.done")[0]["reason"] == "stopped"


async def test_a_spectator_past_max_spectators_is_refused_naming_the_limit(server):
    controller = await dial(server.ws)
    await controller.send(START)
    start = await controller.until("video.start")
    watch = f"{server.ws}?watch={start['watch_token']}"
    spectators = [await dial(watch) for _ in range(2)]
    for spectator in spectators:
        assert (await spectator.until("video.start"))["role"] == "spectator"
    refused = await fatal(watch)
    [error] = refused.of("error")
    assert (error["code"], error["fatal"], refused.close_code) == ("too_many_spectators", True, 1013), error
    assert "max_spectators = 2" in error["message"] and "request_id" not in error
    assert metric(scrape(server), "rtvideo_session_rejections_total", reason="too_many_spectators") >= 1
    # The two watching and the controller go on; once one spectator leaves, another is taken.
    for spectator in spectators:
        while not spectator.received.chunks:
            await spectator.next()
    await spectators[0].ws.close()
    for _ in range(100):  # until the server has seen it go
        third = await dial(watch)
        first = await third.next()
        if first["type"] == "video.start":
            break
        assert first["code"] == "too_many_spectators", first
        await third.rest()
    else:
        raise AssertionError("a spectator's place was never freed")
    assert isinstance(await third.next(), Chunk)
    await stop(controller)
    for spectator in (spectators[1], third):
        assert (await spectator.rest()).of("session.done")[0]["reason"] == "stopped"


async def test_a_spectator_that_never_reads_is_dropped_and_the_controller_gets_every_chunk(server):
    """Unpaced 0.8 MB chunks (0.25 s of media each) that a spectator never reads:
    once its socket is full, more than max_undelivered_seconds (4 s) of them wait
    for it, and it is closed, naming that limit; the controller meanwhile gets
    every chunk, in order, without a gap the spectator caused."""
    big = {**START, "width": 256, "height": 256, "max_lead_seconds": None}
    controller = await dial(server.ws)
    await controller.send(big)
    start = await controller.until("video.start")
    stalled = await dial(f"{server.ws}?watch={start['watch_token']}", max_queue=1, compression=None)
    await stalled.next()  # video.start; then it reads nothing
    watching = metric(scrape(server), "rtvideo_session_viewers", role="spectator")
    assert watching >= 1.0
    gaps, last = [], None
    deadline = time.monotonic() + 60
    while metric(scrape(server), "rtvideo_session_viewers", role="spectator") >= watching:
        assert time.monotonic() < deadline, "the stalled spectator was never dropped"
        item = await controller.next()
        if isinstance(item, Chunk):
            now = time.monotonic()
            if last is not None:
                gaps.append(now - last)
            last = now
    await stop(controller)
    indexes = [c.metadata["generation_chunk_index"] for c in controller.received.chunks]
    assert indexes == list(range(len(indexes))) and len(indexes) > 16  # every chunk, in order
    assert max(gaps) < 2.0, gaps  # nothing held the controller (send_timeout_s is 30 s)
    with pytest.raises(ConnectionClosed) as closed:
        while True:
            await stalled.ws.recv()
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1008
    reason = closed.value.rcvd.reason
    assert reason.startswith("slow_client: ") and "of media wait for this spectator" in reason, reason
    assert "past max_undelivered_seconds (4)" in reason, reason


async def test_interactions_past_the_rate_are_refused_and_the_session_goes_on(server):
    controller = await dial(server.ws)
    await controller.send({**START, "max_lead_seconds": None})  # a held session would apply nothing more
    await controller.until("video.start")
    sent = [f"burst-{i}" for i in range(BURST + 5)]
    for event_id in sent:
        await controller.send(interaction(f"prompt {event_id}", event_id))
    answers: dict[str, dict] = {}
    while len(answers) < len(sent):
        item = await controller.next()
        if isinstance(item, dict) and item["type"] in ("session.interaction.queued", "error"):
            answers[item.get("event_id")] = item
    queued = [e for e in sent if answers[e]["type"] == "session.interaction.queued"]
    limited = [e for e in sent if answers[e]["type"] == "error"]
    assert queued[:BURST] == sent[:BURST] and len(queued) <= BURST + 1, answers  # one more may have grown back
    assert limited and set(limited) == set(sent) - set(queued)
    for event_id in limited:
        error = answers[event_id]
        assert (error["code"], error["fatal"]) == ("rate_limited", False), error
        assert f"at most {RATE} per second (max_interactions_per_s)" in error["message"]
        assert f"{BURST} at once (interaction_burst)" in error["message"]
    # The session streams on, and a token grows back (1 / RATE s) while it does.
    refused_at = time.monotonic()
    streamed = len(controller.received.chunks)
    while time.monotonic() - refused_at < 1.5 / RATE or len(controller.received.chunks) < streamed + 2:
        await controller.next()
    await controller.send(interaction("a later prompt", "later"))
    assert (await controller.until("session.interaction.queued"))["event_id"] == "later"
    applied = await controller.until("session.interaction.applied")
    while applied["event_id"] != "later":
        applied = await controller.until("session.interaction.applied")
    await stop(controller)
