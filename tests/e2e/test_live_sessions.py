"""Sessions that outlive a connection, against the server as a subprocess: resume
after a dropped socket, the grace period, spectators, shared steering, and every
bad token or resume event."""

from __future__ import annotations

import contextlib
import io
import time

import av
import httpx
import numpy as np
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from rtvideo.server.media import Fmp4Encoder, split_jpeg_payload
from tests.e2e.client import Chunk, Realtime, Received, interaction
from tests.e2e.conftest import start_server, stop_server
from tests.e2e.test_realtime import metric, scrape

GRACE_S = 3.0
RAW = {
    "type": "session.start",
    "prompt": "a kite over a hill",
    "seed": 7,
    "width": 32,
    "height": 24,
    "format": "raw",
    "num_chunks": 24,
    "max_lead_seconds": 0.5,  # two stub chunks (0.25 s each) ahead of the reported playhead
}


@pytest.fixture(scope="module")
def server():
    running = start_server(
        "--max-sessions",
        "8",
        "--resume-grace-s",
        str(GRACE_S),
        "--max-outbox-bytes",
        str(16 << 20),  # a controller held 4 s behind (16 chunks of 0.8 MB) fits
        "--resume-buffer-seconds",
        "1.5",  # six stub chunks
        pipeline={"step_time_s": 0.005},
    )
    yield running
    stop_server(running)


async def dial(url: str, **kwargs) -> Realtime:
    return Realtime(await connect(url, max_size=None, **kwargs))


def drop(client: Realtime) -> None:
    """Cut the TCP connection without a closing handshake (a network drop)."""
    client.ws.transport.abort()


async def read_paced(client: Realtime, until: int | None = None, timeout: float = 30.0) -> dict | None:
    """Chunks, reporting the playhead after each (the session's pacing follows it),
    until chunk ``until`` arrived (None: until session.done, which is returned)."""
    while True:
        item = await client.next(timeout)
        if isinstance(item, Chunk):
            end = item.metadata["media_start_seconds"] + item.metadata["num_frames"] / 16
            with contextlib.suppress(ConnectionClosed):  # the last chunk's report may meet the close
                await client.send({"type": "session.playback", "position_seconds": end})
            if item.metadata["generation_chunk_index"] == until:
                return None
        elif item["type"] == "session.done":
            return item


async def resume(url: str, start: dict, last_chunk_index: int) -> Realtime:
    """A new connection that resumes; retried while the server has not noticed the
    old socket go yet (``resume_token_in_use``)."""
    body = {
        "type": "session.resume",
        "request_id": start["request_id"],
        "resume_token": start["resume_token"],
        "last_chunk_index": last_chunk_index,
    }
    for _ in range(50):
        client = await dial(url)
        await client.send(body)
        first = await client.next()
        if first["type"] == "video.start":
            return client
        assert first["code"] == "resume_token_in_use", first
        await client.rest()
    raise AssertionError("the resume_token stayed in use")


async def fatal(url: str, message: dict | None = None) -> Received:
    client = await dial(url)
    if message is not None:
        await client.send(message)
    return await client.rest()


def job_content(server, start: dict, **extra) -> bytes:
    job = {k: v for k, v in start.items() if k not in ("type", "max_lead_seconds")} | extra
    response = httpx.post(f"{server.http}/v1/videos/sync", json=job, timeout=60)
    assert response.status_code == 200, response.text
    return response.content


# -- resume ---------------------------------------------------------------------------


async def test_a_dropped_session_resumes_without_a_gap_or_a_repeat(server):
    first = await dial(server.ws)
    await first.send(RAW)
    start = await first.until("video.start")
    assert start["role"] == "controller" and start["controller_id"] == "c1"
    assert len(start["resume_token"]) >= 32 and start["watch_token"] != start["resume_token"]
    await read_paced(first, until=3)
    await first.send(interaction("a storm", "before-drop"))
    await first.until("session.interaction.queued")
    drop(first)  # its result reaches the session while no one is attached, or is lost in flight
    got = [c for c in first.received.chunks]
    last = got[-1].metadata["generation_chunk_index"]

    second = await resume(server.ws, start, last)
    again = second.received.of("video.start")[0]
    assert again["resumed"] is True and again["request_id"] == start["request_id"]
    assert again["config"] == start["config"] and again["resume_token"] == start["resume_token"]
    done = await read_paced(second)
    rest = await second.rest()
    assert rest.close_code == 1000 and done["reason"] == "completed"

    indexes = [c.metadata["generation_chunk_index"] for c in got + rest.chunks]
    assert indexes == list(range(24))  # nothing missing, nothing twice
    assert [c.metadata["transport_chunk_index"] for c in rest.chunks] == list(range(len(rest.chunks)))
    [applied] = [e for e in first.received.events + rest.events if e["type"] == "session.interaction.applied"][:1]
    assert applied["event_id"] == "before-drop" and applied["controller"] == "c1"
    # The frames are those of an uninterrupted run with the same prompt change.
    expected = job_content(
        server, RAW, interactions=[{"at_chunk": applied["generation_chunk_index"], "prompt": "a storm"}]
    )
    assert b"".join(c.payload for c in got + rest.chunks) == expected
    assert done["frames"] == 4 * 24 and done["replay"]["interactions"][0]["prompt"] == "a storm"


async def test_a_resumed_fmp4_session_starts_its_connection_with_a_fresh_init_segment(server):
    """After a drop, the resumed connection's payloads alone are a valid MP4: the
    first missed chunk comes behind the session's init segment, the rest as the
    session encoded them, and no chunk is missing or repeated."""
    first = await dial(server.ws)
    await first.send({**RAW, "format": "fmp4", "num_chunks": 10})
    start = await first.until("video.start")
    await read_paced(first, until=2)
    drop(first)
    got = list(first.received.chunks)
    second = await resume(server.ws, start, got[-1].metadata["generation_chunk_index"])
    await read_paced(second)
    rest = await second.rest()
    indexes = [c.metadata["generation_chunk_index"] for c in got + rest.chunks]
    assert indexes == list(range(10))
    for part in (got, rest.chunks):
        with av.open(io.BytesIO(b"".join(c.payload for c in part))) as container:
            assert len(list(container.decode(video=0))) == sum(c.metadata["num_frames"] for c in part)
    assert rest.chunks[0].payload[:8] == got[0].payload[:8]  # both begin with the init segment's ftyp box
    assert rest.chunks[0].payload[4:8] == b"ftyp" and rest.chunks[1].payload[4:8] == b"moof"


async def test_an_abandoned_session_ends_after_the_grace_and_is_freed(server):
    before = scrape(server)
    client = await dial(server.ws)
    await client.send({**RAW, "num_chunks": None, "max_lead_seconds": None})  # unpaced: only the hold holds it
    start = await client.until("video.start")
    spectator = await dial(f"{server.ws}?watch={start['watch_token']}")
    await spectator.until("video.start")
    await client.next()
    dropped_at = time.monotonic()
    drop(client)
    done = await spectator.until("session.done", timeout=GRACE_S + 30)
    assert done["reason"] == "abandoned" and done["stopped"] is True
    assert time.monotonic() - dropped_at >= GRACE_S - 0.5
    assert (await spectator.rest()).close_code == 1000
    after = scrape(server)
    outcome = "rtvideo_sessions_total", {"outcome": "abandoned"}
    assert metric(after, outcome[0], **outcome[1]) == metric(before, outcome[0], **outcome[1]) + 1
    # Held while detached: past the chunks written to its socket (delivered), the engine
    # made at most max_undelivered_seconds (4 s: 16 chunks) and the one under way, not
    # the hundreds a grace of unpaced stub chunks would be.
    delivered = metric(after, "rtvideo_chunks_delivered_total") - metric(before, "rtvideo_chunks_delivered_total")
    assert done["chunks"] - delivered <= 17, (done["chunks"], delivered)
    server.released()  # the worker holds nothing of it
    got = await fatal(server.ws, resume_body(start, 0))
    assert got.of("error")[0]["code"] == "unknown_resume_token" and got.close_code == 1008


async def test_a_session_that_ends_while_detached_keeps_its_end_for_the_resume(server):
    """Dropped after chunk 0, the session runs to its end before anyone resumes
    (4 unpaced chunks: within what a detached session may run ahead). The
    resume still gets chunks 1..3, ``session.done`` and the close, the frames
    of an uninterrupted run; its watch token found nothing from the end on, and
    once the end reached the client, neither does the resume token."""
    before = scrape(server)
    completed = ("rtvideo_sessions_total", {"outcome": "completed"})
    first = await dial(server.ws)
    start_event = {**RAW, "num_chunks": 4, "max_lead_seconds": None}
    await first.send(start_event)
    start = await first.until("video.start")
    await first.next()  # chunk 0
    drop(first)
    server.released()  # the engine ended it: nobody was attached
    assert metric(scrape(server), completed[0], **completed[1]) == metric(before, completed[0], **completed[1]) + 1
    watched = await fatal(f"{server.ws}?watch={start['watch_token']}")
    assert watched.of("error")[0]["code"] == "unknown_watch_token"

    second = await resume(server.ws, start, 0)
    rest = await second.rest()
    done = rest.of("session.done")
    assert [e["type"] for e in rest.events] == ["video.start", "session.done"] and done[0]["reason"] == "completed"
    assert rest.close_code == 1000
    got = first.received.chunks + rest.chunks
    assert [c.metadata["generation_chunk_index"] for c in got] == [0, 1, 2, 3]
    assert b"".join(c.payload for c in got) == job_content(server, start_event)
    again = await fatal(server.ws, resume_body(start, 3))
    assert again.of("error")[0]["code"] == "unknown_resume_token"
    assert metric(scrape(server), "rtvideo_sessions_detached") == 0


def resume_body(start: dict, last: int, **changes) -> dict:
    body = {
        "type": "session.resume",
        "request_id": start["request_id"],
        "resume_token": start["resume_token"],
        "last_chunk_index": last,
    }
    return {**body, **changes}


async def test_bad_resumes_are_refused_and_harm_no_session(server):
    owner = await dial(server.ws)
    await owner.send({**RAW, "num_chunks": None})
    start = await owner.until("video.start")
    await read_paced(owner, until=8)
    other = {"request_id": "rtv-0", "resume_token": "x" * 32}
    cases = [
        (resume_body(start, 0), "resume_token_in_use"),  # its owner is still attached
        (resume_body(start, 0, resume_token="wrong"), "unknown_resume_token"),
        (resume_body(start, 0, request_id="rtv-someone-else"), "unknown_resume_token"),
        (resume_body(start, 0, **other), "unknown_resume_token"),
        (resume_body(start, 0, resume_token=start["watch_token"]), "unknown_resume_token"),
        (resume_body(start, -2), "invalid_event"),
        (resume_body(start, "one"), "invalid_event"),
        ({k: v for k, v in resume_body(start, 0).items() if k != "resume_token"}, "invalid_event"),
        ({**resume_body(start, 0), "extra": 1}, "invalid_event"),
    ]
    for body, code in cases:
        got = await fatal(server.ws, body)
        [error] = got.of("error")
        assert (error["code"], error["fatal"], got.close_code) == (code, True, 1008), (body, error)
        assert "request_id" not in error  # nothing of the session leaks
    missing = (await fatal(server.ws, {**resume_body(start, 0), "last_chunk_index": None})).of("error")[0]
    assert "last_chunk_index" in missing["message"]

    # Ahead of what was made, and older than the buffer: resume_gap, and the session survives both.
    drop(owner)
    for last in (10_000, -1):
        body = resume_body(start, last)
        for _ in range(50):
            got = await fatal(server.ws, body)
            if got.of("error")[0]["code"] != "resume_token_in_use":
                break
        [error] = got.of("error")
        assert error["code"] == "resume_gap" and got.close_code == 1008, error
        assert "last_chunk_index" in error["message"]
    last = owner.received.chunks[-1].metadata["generation_chunk_index"]
    back = await resume(server.ws, start, last)
    await read_paced(back, until=last + 2)
    await back.send({"type": "session.stop"})
    assert (await back.rest()).of("session.done")[0]["reason"] == "stopped"


async def test_tokens_in_the_query_must_name_a_live_session(server):
    for query, code in (
        ("watch=nope", "unknown_watch_token"),
        ("control=nope", "unknown_control_token"),
        ("watch=a&control=b", "invalid_request"),
    ):
        got = await fatal(f"{server.ws}?{query}")
        [error] = got.of("error")
        assert (error["code"], error["fatal"], got.close_code) == (code, True, 1008), error


# -- spectators -------------------------------------------------------------------------


async def test_a_spectator_joins_mid_stream_read_only_with_decodable_fmp4(server):
    controller = await dial(server.ws)
    await controller.send({**RAW, "format": "fmp4", "num_chunks": 12})
    start = await controller.until("video.start")
    assert "control_token" not in start  # not shared: nobody else may steer
    await read_paced(controller, until=2)
    spectator = await dial(f"{server.ws}?watch={start['watch_token']}")
    seen = await spectator.until("video.start")
    assert seen["role"] == "spectator" and seen["request_id"] == start["request_id"]
    assert seen["config"] == start["config"] and "resume_token" not in seen and "watch_token" not in seen
    await spectator.send(interaction("steer", "s1"))
    await spectator.send({"type": "session.stop"})
    errors = [await spectator.until("error") for _ in range(2)]
    assert [e["code"] for e in errors] == ["read_only", "read_only"] and not any(e["fatal"] for e in errors)
    assert errors[0]["event_id"] == "s1"
    done = await read_paced(controller)
    watched = await spectator.rest()
    assert watched.of("session.done")[0]["reason"] == "completed" and watched.close_code == 1000
    mine = {c.metadata["generation_chunk_index"]: c for c in controller.received.chunks}
    indexes = [c.metadata["generation_chunk_index"] for c in watched.chunks]
    assert indexes == list(range(indexes[0], 12)) and indexes[0] >= 3
    assert [c.metadata["transport_chunk_index"] for c in watched.chunks] == list(range(len(indexes)))
    # The same fragments, the spectator's first one behind a fresh init segment; it decodes alone.
    assert [c.payload for c in watched.chunks[1:]] == [mine[i].payload for i in indexes[1:]]
    with av.open(io.BytesIO(b"".join(c.payload for c in watched.chunks))) as container:
        frames = list(container.decode(video=0))
    assert len(frames) == sum(c.metadata["num_frames"] for c in watched.chunks)
    assert (frames[0].width, frames[0].height) == (32, 24)
    assert done["chunks"] == 12


async def test_a_spectator_that_never_reads_is_dropped_and_holds_no_one(server):
    big = {**RAW, "width": 256, "height": 256, "num_chunks": None, "max_lead_seconds": None}
    controller = await dial(server.ws)
    await controller.send(big)
    start = await controller.until("video.start")
    stalled = await dial(f"{server.ws}?watch={start['watch_token']}", max_queue=1, compression=None)
    await stalled.next()  # video.start; then it reads nothing
    gaps, last = [], None
    watching = metric(scrape(server), "rtvideo_session_viewers", role="spectator")
    for _ in range(40):  # 0.8 MB chunks: the spectator's socket and its 16 MiB outbox fill
        item = await controller.next()
        if isinstance(item, Chunk):
            now = time.monotonic()
            if last is not None:
                gaps.append(now - last)
            last = now
    assert watching >= 1.0
    while metric(scrape(server), "rtvideo_session_viewers", role="spectator") >= watching:
        await controller.next()  # it was dropped; the controller streams on meanwhile
    await controller.send({"type": "session.stop"})
    got = await controller.rest()
    assert got.of("session.done")[0]["reason"] == "stopped"
    assert max(gaps) < 2.0, gaps  # the spectator never held the session (send_timeout_s is 30 s)
    try:
        while True:
            await stalled.ws.recv()
    except ConnectionClosed as closed:
        assert closed.rcvd is not None and closed.rcvd.code == 1008
        assert closed.rcvd.reason.startswith("slow_client: ")


# -- shared steering --------------------------------------------------------------------


async def test_two_controllers_steer_one_session_and_both_learn_who_won(server):
    first = await dial(server.ws)
    await first.send({**RAW, "num_chunks": None, "shared_control": True})
    start = await first.until("video.start")
    assert start["control_token"] and start["controller_id"] == "c1"
    second = await dial(f"{server.ws}?control={start['control_token']}")
    joined = await second.until("video.start")
    assert joined["controller_id"] == "c2" and joined["role"] == "controller" and "resume_token" not in joined
    # Hold the session at a boundary, send both, then let it go. The playhead at the
    # end of chunk 1 (0.5 s) and a lead of 0.5 s allow chunks up to 3: once chunk 3
    # is in, the session waits at chunk 4's boundary, however slow the machine.
    await read_paced(first, until=1)
    while first.received.chunks[-1].metadata["generation_chunk_index"] < 3:
        await first.next()
    await first.send(interaction("from one", "one"))
    assert (await first.until("session.interaction.queued"))["event_id"] == "one"
    await second.send(interaction("from two", "two"))
    assert (await second.until("session.interaction.queued"))["event_id"] == "two"
    await first.send({"type": "session.playback", "position_seconds": 10.0})
    outcomes = {}
    for client in (first, second):
        applied = await client.until("session.interaction.applied")
        [superseded] = client.received.of("session.interaction.superseded")
        outcomes[client] = (superseded, applied)
        assert not [e for e in client.received.of("session.interaction.queued") if e["event_id"] not in ("one", "two")]
    assert [e["event_id"] for e in first.received.of("session.interaction.queued")] == ["one"]
    assert [e["event_id"] for e in second.received.of("session.interaction.queued")] == ["two"]
    for superseded, applied in outcomes.values():
        assert (superseded["event_id"], superseded["controller"]) == ("one", "c1")
        assert (superseded["by_event_id"], superseded["by_controller"]) == ("two", "c2")
        assert (applied["event_id"], applied["controller"]) == ("two", "c2")
    # One controller leaving (close 1000) leaves the session to the other.
    await second.ws.close()
    await read_paced(first, until=outcomes[first][1]["generation_chunk_index"] + 1)
    await first.send({"type": "session.stop"})
    assert (await first.rest()).of("session.done")[0]["reason"] == "stopped"


async def test_control_of_a_session_without_shared_control_is_refused(server):
    owner = await dial(server.ws)
    await owner.send({**RAW, "num_chunks": 4})
    start = await owner.until("video.start")
    got = await fatal(f"{server.ws}?control={start['watch_token']}")
    assert got.of("error")[0]["code"] == "unknown_control_token" and got.close_code == 1008
    assert "shared_control" in got.of("error")[0]["message"]
    await read_paced(owner)
    assert (await owner.rest()).close_code == 1000
    bad = await fatal(server.ws, {**RAW, "shared_control": "sometimes"})
    assert bad.of("error")[0]["code"] == "invalid_event" and "shared_control" in bad.of("error")[0]["message"]


def test_viewer_gauges_are_exported(server):
    samples = scrape(server)
    for role in ("controller", "spectator"):
        assert ("rtvideo_session_viewers", (("role", role),)) in samples
    assert ("rtvideo_sessions_detached", ()) in samples


async def test_a_spectator_watches_in_a_format_of_its_own_encoded_once_for_all_who_ask(server):
    """A raw session watched as fMP4 by two spectators and as JPEG by a third: each
    other format is encoded once for the session (the later fMP4 spectator gets
    the very fragments the earlier one got, sequence numbers and all), its media
    decode alone and show the session's frames."""
    controller = await dial(server.ws)
    await controller.send({**RAW, "num_chunks": 12})
    start = await controller.until("video.start")
    await read_paced(controller, until=1)
    watch = f"{server.ws}?watch={start['watch_token']}"
    early = await dial(f"{watch}&format=fmp4")
    seen = await early.until("video.start")
    assert (seen["format"], seen["config"]["format"], seen["role"]) == ("fmp4", "fmp4", "spectator")
    assert seen["config"]["width"] == start["config"]["width"] and start["format"] == "raw"
    jpeg = await dial(f"{watch}&format=jpeg")
    assert (await jpeg.until("video.start"))["format"] == "jpeg"
    while not early.received.chunks:  # the second fMP4 spectator joins a chunk or more later
        await early.next()
    await read_paced(controller, until=early.received.chunks[-1].metadata["generation_chunk_index"] + 1)
    late = await dial(f"{watch}&format=fmp4")
    await late.until("video.start")
    done = await read_paced(controller)
    assert done["chunks"] == 12
    watched = {"early": await early.rest(), "late": await late.rest(), "jpeg": await jpeg.rest()}
    for got in watched.values():
        assert got.of("session.done")[0]["reason"] == "completed" and got.close_code == 1000
        indexes = [c.metadata["generation_chunk_index"] for c in got.chunks]
        assert indexes == list(range(indexes[0], 12)) and indexes[0] >= 2
    raw = {c.metadata["generation_chunk_index"]: c.payload for c in controller.received.chunks}
    early_chunks = {c.metadata["generation_chunk_index"]: c for c in watched["early"].chunks}
    late_chunks = watched["late"].chunks
    assert late_chunks[0].metadata["generation_chunk_index"] > min(early_chunks)
    for chunk in late_chunks[1:]:  # past the late one's init segment: the same bytes
        assert chunk.payload == early_chunks[chunk.metadata["generation_chunk_index"]].payload
    # The spectator's media are the fMP4 of the session's own frames, from its first chunk on.
    config = start["config"]
    reference = Fmp4Encoder(config["width"], config["height"], config["fps"])
    for index, chunk in sorted(early_chunks.items()):
        frames = np.frombuffer(raw[index], np.uint8).reshape(-1, config["height"], config["width"], 3)
        assert chunk.payload == reference.encode(frames, chunk.metadata["first_frame_index"]), index
    with av.open(io.BytesIO(b"".join(c.payload for c in watched["early"].chunks))) as container:
        assert len(list(container.decode(video=0))) == sum(c.metadata["num_frames"] for c in early_chunks.values())
    for chunk in watched["jpeg"].chunks:
        assert len(split_jpeg_payload(chunk.payload)) == chunk.metadata["num_frames"]


async def test_a_format_is_chosen_only_by_a_spectator_and_only_among_those_served(server):
    owner = await dial(server.ws)
    await owner.send({**RAW, "num_chunks": None})
    start = await owner.until("video.start")
    for query, words in (
        (f"watch={start['watch_token']}&format=gif", "format: unknown 'gif'; known: fmp4, jpeg, raw"),
        (f"control={start['watch_token']}&format=raw", "format: only a spectator"),
        ("format=raw", "format: only a spectator"),
    ):
        got = await fatal(f"{server.ws}?{query}")
        [error] = got.of("error")
        assert (error["code"], got.close_code) == ("invalid_request", 1008) and words in error["message"], error
    same = await dial(f"{server.ws}?watch={start['watch_token']}&format=raw")  # its own format: served as it is
    assert (await same.until("video.start"))["format"] == "raw"
    await same.ws.close()
    await read_paced(owner, until=2)
    await owner.send({"type": "session.stop"})
    assert (await owner.rest()).of("session.done")[0]["reason"] == "stopped"
