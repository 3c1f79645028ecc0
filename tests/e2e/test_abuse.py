"""Holding up under abuse, one file: what a careless or hostile client, or a
worker gone wrong, does to the server as a subprocess, and what it gets back.

- a hung worker (SIGSTOP): found, its sessions failed, replaced;
- a client that stops reading: closed once a write waits too long or its
  backlog passes a byte limit, its session ended, the server's memory bounded
  and given back as the session ends;
- hostile bodies and messages: an HTTP body over the limit (refused before it
  is read whole), JSON nested 1000 deep, ``Infinity``, ``NaN`` and ``1e308``,
  over HTTP and the WebSocket, before and during a session (which lives on);
  an integer of thousands of digits, refused naming its field;
- sockets that cannot be held: a request head over 16 KiB (a WebSocket URL
  included) answered 414 / 431 at once, one sent by halves or a byte at a time
  answered 408 and closed at the header timeout;
- an abandoned ``/v1/videos/sync``: its job is cancelled and frees its slot, and
  the access log has its 499 line;
- a flood of jobs: bounded with 429 and ``Retry-After``, nothing finished is
  evicted, and realtime sessions are admitted once the accepted jobs are done.

Their neighbours live elsewhere: every malformed first and in-session message
(``test_bad_input.py``, whose fast cases include these), a killed worker, a
long forward and the restart budget (``test_restart.py``), pacing holding a
slow reader's own session (``test_realtime.py``), the job queue's bounds and
ttl (``test_http_and_limits.py``). The whole file runs in under a minute.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import os
import signal
import socket
import threading
import time
from urllib.parse import quote_from_bytes

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families
from websockets.exceptions import ConnectionClosed, InvalidStatus

from tests.e2e.client import Realtime, interaction, open_realtime

RAW = {"type": "session.start", "prompt": "a lantern", "format": "raw", "width": 32, "height": 32}
JOB = {"prompt": "a windmill", "format": "raw", "width": 32, "height": 32, "num_chunks": 1}


def samples(server, name: str, **labels: str) -> list[float]:
    """The values on ``/metrics`` now of the samples ``name`` with ``labels``."""
    return [
        sample.value
        for family in text_string_to_metric_families(httpx.get(f"{server.http}/metrics").text)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(key) == value for key, value in labels.items())
    ]


def outcome(server, name: str) -> float:
    """``rtvideo_sessions_total{outcome=name}`` now."""
    return next(iter(samples(server, "rtvideo_sessions_total", outcome=name)), 0.0)


def never_closed(server) -> str:
    """The failure message of a stalled client that was not closed in time: what
    the server had delivered, held and logged, so that a failure says where it
    stuck."""
    delivered = samples(server, "rtvideo_chunks_delivered_total")
    tail = "\n".join(server.log[-30:])
    return f"the stalled client was never closed: chunks delivered {delivered}, health {server.health()}; log:\n{tail}"


def wait_ready(server, within: float = 30.0) -> dict:
    deadline = time.monotonic() + within
    while (health := httpx.get(f"{server.http}/health")).status_code != 200:
        assert time.monotonic() < deadline, health.text
    return health.json()


# -- a hung worker ----------------------------------------------------------------------


async def test_a_stopped_worker_fails_its_sessions_and_is_replaced(make_server):
    """SIGSTOP the worker under two streaming sessions: within the 1 s floor and a
    few heartbeats each gets a fatal ``worker_wedged`` and close 1011 (today:
    nothing, forever), readiness and liveness never wait on the stopped worker,
    and a fresh worker serves the next session."""
    server = make_server("--worker-wedged-after-s", "1", pipeline={"step_time_s": 0.005})
    stopped = server.health()["workers"][0]["pid"]
    async with open_realtime(server.ws) as ws1, open_realtime(server.ws) as ws2:
        clients = [Realtime(ws1), Realtime(ws2)]
        for client in clients:
            await client.send(RAW)
            await client.until("video.start")
            await client.next()  # streaming
        os.kill(stopped, signal.SIGSTOP)
        began = time.monotonic()
        health = httpx.get(f"{server.http}/health", timeout=2)  # answers at once, from what it knows
        live = httpx.get(f"{server.http}/health/live", timeout=2)
        got = [await client.rest(timeout=30) for client in clients]
        took = time.monotonic() - began
    assert health.status_code in (200, 503) and live.status_code in (200, 503)
    for received in got:
        [error] = [e for e in received.of("error") if e["fatal"]]
        assert error["code"] == "worker_wedged" and received.close_code == 1011, received
        assert f"worker process {stopped} is wedged: the worker's loop has answered no probe" in error["message"]
    assert took < 10, took  # 1 s floor + heartbeats; generous for 2 shared cores
    ready = wait_ready(server)
    assert ready["workers"][0]["restarts"] == 1 and ready["workers"][0]["pid"] != stopped
    assert httpx.get(f"{server.http}/health/live").json()["status"] == "ok"
    async with open_realtime(server.ws) as ws:
        client = Realtime(ws)
        await client.send({**RAW, "num_chunks": 2})
        assert (await client.rest()).of("session.done")
    text = httpx.get(f"{server.http}/metrics").text
    assert 'rtvideo_sessions_total{outcome="failed"} 2.0' in text


async def test_a_stopped_worker_past_the_restart_budget_fails_liveness(make_server):
    server = make_server("--worker-wedged-after-s", "1", "--max-worker-restarts", "0", pipeline={"step_time_s": 0.005})
    stopped = server.health()["workers"][0]["pid"]
    async with open_realtime(server.ws) as ws:
        client = Realtime(ws)
        await client.send(RAW)
        await client.until("video.start")
        os.kill(stopped, signal.SIGSTOP)
        got = await client.rest(timeout=30)
    assert got.of("error")[0]["code"] == "worker_wedged"
    live = httpx.get(f"{server.http}/health/live")  # an orchestrator restarts the replica
    assert live.status_code == 503 and live.json()["status"] == "dead" and "wedged" in live.json()["reason"]
    ready = httpx.get(f"{server.http}/health")
    assert ready.status_code == 503 and ready.json()["status"] == "unavailable"
    refused = httpx.post(f"{server.http}/v1/videos", json=JOB)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_unavailable"


# -- a client that stops reading ------------------------------------------------------

BIG_RAW = {**RAW, "width": 448, "height": 448, "max_lead_seconds": None}  # 2.4 MB chunks, unpaced


def stalled_client(server):
    """A real client that reads nothing after ``video.start``: one message queued at
    most, no compression (the stub's frames would deflate to nothing), so the
    server's socket fills."""
    return open_realtime(server.ws, max_queue=1, compression=None)


async def test_a_client_whose_socket_takes_nothing_is_closed(make_server):
    """Its session is held by pacing meanwhile; once one write has waited
    ``send_timeout_s`` the server closes it (1008 ``slow_client``), ends its
    session and frees what the worker held, without waiting for it to read."""
    server = make_server(
        "--send-timeout-s", "1", "--max-undelivered-seconds", "1", pipeline={"step_time_s": 0.001, "max_size": 512}
    )
    async with stalled_client(server) as ws:
        client = Realtime(ws)
        await client.send(BIG_RAW)
        await client.until("video.start")
        deadline = time.monotonic() + 30
        while outcome(server, "slow_client") != 1.0:  # the client reads nothing meanwhile
            assert time.monotonic() < deadline, never_closed(server)
        server.released()
        got = await client.rest(timeout=10)  # reading now: what was queued, then the close
    assert got.close_code == 1008, (got.close_code, got.close_reason)
    assert got.close_reason == "slow_client: its socket took nothing for 1 s (send_timeout_s)"
    assert not got.of("session.done")  # nothing more was queued for it
    assert not [line for line in server.log if "Traceback" in line]


def byte_limited_server(make_server, *flags: str):
    """A server whose outbox limit (4 MB) closes a stalled client long before
    pacing (30 s of media) or the send timeout (60 s) would, its stub unpaced."""
    return make_server(
        "--max-outbox-bytes",
        "4000000",
        "--max-undelivered-seconds",
        "30",
        "--send-timeout-s",
        "60",
        *flags,
        pipeline={"step_time_s": 0.001, "max_size": 512},
    )


async def test_a_client_whose_backlog_passes_the_byte_limit_is_closed_and_memory_stays_bounded(make_server):
    """Pacing would let 30 s of media (290 MB) wait for this client; the outbox
    limit (4 MB) closes it after two chunks instead, and the server's memory
    grows by no more than its limits allow: the outbox, the resume buffer
    (1 s here, four chunks; the default 8 s alone could hold 77 MB of these
    chunks) and the few chunks made before the session's stop reached the
    worker."""
    server = byte_limited_server(make_server, "--resume-buffer-seconds", "1")
    api = psutil.Process(server.process.pid)
    before = api.memory_info().rss
    peak = await stall_until_closed(server, api, 1)
    assert peak - before < 64 << 20, f"the server grew by {(peak - before) >> 20} MiB"


async def stall_until_closed(server, api: psutil.Process, nth: int) -> int:
    """A stalled client's ``nth`` session, until the outbox limit closed it and
    the session ended; the API process's peak RSS meanwhile."""
    peak = api.memory_info().rss
    async with stalled_client(server) as ws:
        client = Realtime(ws)
        await client.send(BIG_RAW)
        await client.until("video.start")
        deadline = time.monotonic() + 30
        while outcome(server, "slow_client") != nth:
            peak = max(peak, api.memory_info().rss)
            assert time.monotonic() < deadline, never_closed(server)
        server.released()
        got = await client.rest(timeout=10)
    assert got.close_code == 1008 and got.close_reason.startswith("slow_client: "), got.close_reason
    assert "past max_outbox_bytes (4000000)" in got.close_reason
    return peak


async def read_to_the_end(server) -> None:
    """A client that reads every chunk of an 8-chunk session of ``BIG_RAW``'s
    (19 MB), until its ``session.done``."""
    async with open_realtime(server.ws) as ws:
        client = Realtime(ws)
        await client.send({**BIG_RAW, "num_chunks": 8})
        await client.until("session.done")
    server.released()


@pytest.mark.parametrize("ending", ["slow_client", "completed"])
async def test_an_ended_sessions_chunks_are_freed_when_it_ends_not_at_a_later_garbage_collection(make_server, ending):
    """An ended session sits in reference cycles (its cancelled tasks' frames)
    until the cyclic collector runs, which in a long-lived server may be many
    sessions later; so its resume buffer, and the chunk a slow client's writer
    was cancelled on, are let go as it ends. Six sessions in a row, closed as
    slow clients (each held about 12 MB of chunks) or read to their end (19
    MB), leave the API process about where the first left it: before, 28-39
    MB and about 37 MB larger."""
    server = byte_limited_server(make_server)
    api = psutil.Process(server.process.pid)
    after: list[int] = []
    for nth in range(1, 7):
        if ending == "slow_client":
            await stall_until_closed(server, api, nth)  # ended: released() saw no session open
        else:
            await read_to_the_end(server)
        after.append(api.memory_info().rss)
    grown = [(rss - after[0]) >> 20 for rss in after]
    assert after[-1] - after[0] < 16 << 20, f"the API process after each session, MiB over the first: {grown}"


# -- hostile bodies and messages --------------------------------------------------------


def test_http_bodies_are_limited_in_size_and_nesting_before_they_are_read(server):
    headers = {"content-type": "application/json"}
    refused = httpx.post(f"{server.http}/v1/videos", content=b"x" * ((8 << 20) + 1), headers=headers)
    assert refused.status_code == 413 and refused.json()["error"]["code"] == "body_too_large"
    assert f"at most {8 << 20} are accepted" in refused.json()["error"]["message"]

    def chunks():  # no Content-Length: the limit is found while reading
        for _ in range(9):
            yield b" " * (1 << 20)

    streamed = httpx.post(f"{server.http}/v1/videos", content=chunks(), headers=headers)
    assert streamed.status_code == 413 and "the request body is over" in streamed.json()["error"]["message"]

    nested = httpx.post(f"{server.http}/v1/videos", content="[" * 1000 + "]" * 1000, headers=headers)
    assert nested.status_code == 422 and nested.json()["error"] == {
        "code": "invalid_request",
        "message": "body: JSON nested 1000 levels deep; at most 32 are accepted",
    }
    for body, field in (
        ('{"prompt": "p", "seconds": Infinity}', "seconds"),
        ('{"prompt": "p", "fps": NaN, "num_chunks": 1}', "fps"),
        ('{"prompt": "p", "seconds": 1e308}', "seconds"),
    ):
        refused = httpx.post(f"{server.http}/v1/videos", content=body, headers=headers)
        assert refused.status_code == 422, (body, refused.text)
        assert refused.json()["error"]["message"].startswith(field), refused.text
    fine = httpx.post(f"{server.http}/v1/videos", json={"prompt": "[[[[" * 20, "num_chunks": 1, "format": "raw"})
    assert fine.status_code == 202, fine.text  # brackets inside a string are not nesting
    for route in ("/v1/videos", "/v1/videos/sync"):  # JSON is UTF-8, and a body is read as sent
        latin = httpx.post(f"{server.http}{route}", content=b'{"prompt": "caf\xe9", "num_chunks": 1}', headers=headers)
        message = "body: not UTF-8 (byte 0xe9 at 15); a JSON body is UTF-8"
        assert latin.status_code == 422 and latin.json()["error"] == {"code": "invalid_request", "message": message}
        zipped = httpx.post(
            f"{server.http}{route}",
            content=gzip.compress(b'{"prompt": "p", "num_chunks": 1}'),
            headers={**headers, "content-encoding": "gzip"},
        )
        assert zipped.status_code == 422 and zipped.json()["error"]["message"].startswith("content-encoding: 'gzip'")


HUGE = "9" * 5000  # past the 4300 digits Python's parser converts at all


def test_an_integer_of_thousands_of_digits_is_refused_naming_its_field(server):
    headers = {"content-type": "application/json"}
    for body, field in (
        (f'{{"prompt": "p", "num_chunks": {HUGE}}}', "num_chunks"),
        (f'{{"prompt": "p", "num_chunks": 1, "seed": -{HUGE}}}', "seed"),
        (
            f'{{"prompt": "p", "num_chunks": 2, "interactions": [{{"at_chunk": {HUGE}, "prompt": "q"}}]}}',
            "interactions.0.at_chunk",
        ),
    ):
        for route in ("/v1/videos", "/v1/videos/sync"):
            refused = httpx.post(f"{server.http}{route}", content=body, headers=headers)
            assert refused.status_code == 422, (route, field, refused.text)
            message = f"{field}: an integer of 5000 digits; at most 100 are accepted"
            assert refused.json()["error"] == {"code": "invalid_request", "message": message}
    form = httpx.post(f"{server.http}/v1/videos", data={"prompt": "p", "num_chunks": HUGE})
    assert form.status_code == 422 and form.json()["error"]["message"].startswith("num_chunks: "), form.text
    form = httpx.post(f"{server.http}/v1/videos", data={"prompt": "p", "width": "9" * 400})  # not echoed whole
    message = "width: an integer of 400 digits; at most 100 are accepted"
    assert form.status_code == 422 and form.json()["error"]["message"] == message, form.text
    digits = {"prompt": "1" * 150, "num_chunks": "1", "format": "raw", "width": "32", "height": "32"}
    assert httpx.post(f"{server.http}/v1/videos", data=digits).status_code == 202  # a prompt of digits is text
    fields = {"num_chunks": "1", "format": "raw", "width": "32", "height": "32"}
    for prompt, status in ((b"caf\xc3\xa9", 202), (b"caf\xe9", 422)):  # UTF-8 text, then a latin-1 byte
        multipart = {name: (None, value) for name, value in {**fields, "prompt": prompt}.items()}
        urlencoded = "&".join(f"{n}={v}" for n, v in fields.items()) + "&prompt=" + quote_from_bytes(prompt)
        form = {"content-type": "application/x-www-form-urlencoded"}
        for answer in (
            httpx.post(f"{server.http}/v1/videos", files=multipart),
            httpx.post(f"{server.http}/v1/videos", content=urlencoded, headers=form),
        ):
            assert answer.status_code == status, answer.text
            if status == 422:
                assert answer.json()["error"]["message"] == "prompt: not utf-8 text", answer.text
            else:
                assert answer.json()["prompt"] == "café"
    scheduled = {"prompt": "p", "num_chunks": "2", "interactions": f'[{{"at_chunk": {HUGE}, "prompt": "q"}}]'}
    for route in ("/v1/videos", "/v1/videos/sync"):  # a form's JSON field: named within it, not a 500
        for sent in ({"data": scheduled}, {"files": {name: (None, value) for name, value in scheduled.items()}}):
            refused = httpx.post(f"{server.http}{route}", **sent)
            message = "interactions.0.at_chunk: an integer of 5000 digits; at most 100 are accepted"
            assert refused.status_code == 422 and refused.json()["error"]["message"] == message, refused.text
    digits = {"prompt": "1" * 4000, "num_chunks": 1, "format": "raw", "width": 32, "height": 32}
    assert httpx.post(f"{server.http}/v1/videos", json=digits).status_code == 202  # digits in a string are text


HOSTILE = [
    ("[" * 1000 + "]" * 1000, "invalid_message", "JSON nested 1000 levels deep; at most 32"),
    (
        f'{{"type": "session.playback", "position_seconds": {HUGE}}}',
        "invalid_message",
        "position_seconds: an integer of 5000 digits",
    ),
    ('{"type": "session.playback", "position_seconds": Infinity}', "invalid_event", "position_seconds"),
    ('{"type": "session.playback", "position_seconds": NaN}', "invalid_event", "position_seconds"),
    (json.dumps(interaction("x" * 5000)), "invalid_interaction", "prompt"),
]


async def test_hostile_json_over_the_websocket_is_refused_and_the_session_lives_on(server):
    for raw, code, names in [
        ("[" * 1000 + "]" * 1000, "invalid_message", "nested 1000 levels deep"),
        ('{"type": "session.start", "prompt": "p", "seconds": Infinity}', "invalid_event", "seconds"),
        (json.dumps({**RAW, "seconds": 1e308}), "invalid_request", "seconds: at most"),
        (json.dumps(RAW)[:-1] + f', "seed": {HUGE}}}', "invalid_message", "seed: an integer of 5000 digits"),
    ]:  # before the start: fatal, 1008
        async with open_realtime(server.ws) as ws:
            client = Realtime(ws)
            await client.send(raw)
            got = await client.rest(timeout=15)
        [error] = got.of("error")
        assert (error["code"], error["fatal"], got.close_code) == (code, True, 1008) and names in error["message"]
    async with open_realtime(server.ws) as ws:  # during a session: refused, and it goes on
        client = Realtime(ws)
        await client.send(RAW)
        await client.until("video.start")
        for raw, code, names in HOSTILE:
            await client.send(raw)
            error = await client.until("error")
            assert (error["code"], error["fatal"]) == (code, False) and names in error["message"], error
        await client.send(interaction("still here", "ok"))
        await client.until("session.interaction.applied")
        await client.send({"type": "session.stop"})
        assert (await client.rest()).of("session.done")[0]["reason"] == "stopped"


async def test_text_past_the_length_or_the_connections_budget_is_refused_unread_and_a_flood_is_closed(server):
    """A text message longer than 131,072 characters is refused without being
    parsed (before the start: fatal, 1008; during a session: not); a connection
    that sends more text than 256 KiB a second (1 MiB at once) is closed,
    1008, ``too_many_messages``, and the server, and a session beside it, go
    on. No permessage-deflate is negotiated, so a message costs a client its
    length on the wire: a compressed flood would inflate past it."""
    async with open_realtime(server.ws) as ws:
        assert ws.response.headers.get("sec-websocket-extensions") is None  # the client asked for deflate
        client = Realtime(ws)
        too_long = json.dumps({**RAW, "prompt": "p" * 200_000})
        await client.send(too_long)
        got = await client.rest(timeout=15)
    [error] = got.of("error")
    expected = f"a text message of {len(too_long)} characters; at most 131072 are accepted"
    assert (error["code"], error["fatal"], got.close_code, error["message"]) == (
        "invalid_message",
        True,
        1008,
        expected,
    )
    async with open_realtime(server.ws) as beside, open_realtime(server.ws) as ws:
        neighbour, client = Realtime(beside), Realtime(ws)
        await neighbour.send(RAW)
        await client.send(RAW)
        await neighbour.until("video.start")
        await client.until("video.start")
        too_long = json.dumps({"type": "session.ping", "pad": "x" * 200_000})
        await client.send(too_long)
        error = await client.until("error")
        assert (error["code"], error["fatal"]) == ("invalid_message", False) and f"{len(too_long)} characters" in error[
            "message"
        ]
        padded = json.dumps({"type": "session.ping", "pad": "x" * 120_000})  # within the length: parsed, refused
        for _ in range(12):  # 1.4 MB at once, well past the burst
            await client.send(padded)
        got = await client.rest(timeout=15)
        [flood] = [event for event in got.of("error") if event["code"] == "too_many_messages"]
        assert flood["fatal"] and "262144 characters of text a second" in flood["message"]
        assert (got.close_code, got.close_reason) == (1008, "too many messages")
        for empty in ("", "{}", b""):  # a flood of empty messages: each counts 512 characters
            async with open_realtime(server.ws) as flooding:
                flooder = Realtime(flooding)
                await flooder.send(RAW)
                await flooder.until("video.start")
                with contextlib.suppress(ConnectionClosed):  # closed mid-flood
                    for _ in range(4000):  # 2,048,000 counted: past the burst and what grows back meanwhile
                        await flooder.send(empty)
                got = await flooder.rest(timeout=15)
            assert (got.close_code, got.close_reason) == (1008, "too many messages"), repr(empty)
        await neighbour.send(interaction("still here", "ok"))
        await neighbour.until("session.interaction.applied")
        await neighbour.send({"type": "session.stop"})
        assert (await neighbour.rest()).of("session.done")[0]["reason"] == "stopped"
    assert httpx.get(f"{server.http}/health").status_code == 200


# -- sockets that cannot be held -------------------------------------------------------

HANDSHAKE = (
    "GET /v1/realtime/video?pad={pad} HTTP/1.1\r\nHost: rtvideo\r\nUpgrade: websocket\r\n"
    "Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
)


def dial_raw(server) -> socket.socket:
    host, port = server.http.removeprefix("http://").rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=10)


def read_until_closed(sock: socket.socket, within: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and how long
    that took; fails if the server still holds it after ``within`` seconds."""
    started = time.monotonic()
    sock.settimeout(within)
    received = b""
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except TimeoutError:
        pytest.fail(f"the server held the socket {within:g} s without closing it; it sent {received[:200]!r}")
    except ConnectionResetError:
        pass
    finally:
        sock.close()
    return received, time.monotonic() - started


def masked_frame(opcode: int, payload: bytes) -> bytes:
    """One final client frame (masked, as a client's must be) of ``payload`` < 126 bytes."""
    mask = os.urandom(4)
    return bytes([0x80 | opcode, 0x80 | len(payload)]) + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


def test_a_text_message_that_is_not_utf_8_closes_1007_saying_so_in_one_log_line(server):
    sock = dial_raw(server)
    sock.sendall(HANDSHAKE.format(pad="").encode())
    head = b""
    while b"\r\n\r\n" not in head:
        head += sock.recv(4096)
    assert head.startswith(b"HTTP/1.1 101 "), head
    rest = head.split(b"\r\n\r\n", 1)[1]
    lines = len(server.log)
    sock.sendall(masked_frame(0x1, b'{"type": "\xff\xfe"}'))
    answer, _ = read_until_closed(sock, within=5)
    frame = rest + answer
    reason = "a text message that is not valid UTF-8"
    assert (
        frame[0] == 0x88 and frame[2:4] == (1007).to_bytes(2, "big") and frame[4 : 4 + len(reason)] == reason.encode()
    )
    deadline = time.monotonic() + 5
    while not any("not UTF-8" in line for line in server.log[lines:]):
        assert time.monotonic() < deadline, server.log[lines:]
        time.sleep(0.05)
    assert not any("Traceback" in line or "ERROR" in line for line in server.log[lines:]), server.log[lines:]


async def test_an_over_long_websocket_url_is_answered_at_once_not_held(make_server):
    """Past websockets' own 8 KiB line (10 KB) and past the server's 16 KiB head
    (20 KB): 414, at once, for the WebSocket client and a raw socket alike."""
    server = make_server("--header-timeout-s", "30")
    for size in (10_000, 20_000):
        with pytest.raises(InvalidStatus) as refused:
            async with asyncio.timeout(5):  # held, it would wait for the header timeout
                await open_realtime(f"{server.ws}?pad={'a' * size}", open_timeout=10)
        assert refused.value.response.status_code == 414, size
    sockets = [dial_raw(server) for _ in range(20)]
    for sock in sockets:
        sock.sendall(HANDSHAKE.format(pad="a" * 20_000).encode())
    for sock in sockets:
        answer, _ = read_until_closed(sock, within=5)
        assert answer.startswith(b"HTTP/1.1 414 "), answer[:200]
    for broken in (  # not HTTP/1.1 at all: 400 in the error shape
        b"GET /v1/models HTTP/1.1 extra\r\nHost: rtvideo\r\n\r\n",
        b"POST /v1/videos HTTP/1.1\r\nHost: rtvideo\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n",
    ):
        sock = dial_raw(server)
        sock.sendall(broken)
        answer, _ = read_until_closed(sock, within=5)
        assert answer.startswith(b"HTTP/1.1 400 ") and b'"code": "bad_request"' in answer, answer[:300]
    many = dial_raw(server)  # a head of many headers, each short: 431
    many.sendall(b"GET /v1/models HTTP/1.1\r\n" + b"".join(b"x-pad-%d: %s\r\n" % (i, b"a" * 100) for i in range(200)))
    answer, _ = read_until_closed(many, within=5)
    assert answer.startswith(b"HTTP/1.1 431 ") and b"headers_too_large" in answer, answer[:200]
    assert httpx.get(f"{server.http}/v1/models").status_code == 200


def test_a_request_head_sent_by_halves_is_answered_408_and_closed_at_the_header_timeout(make_server):
    """Half a head, a head trickled a byte at a time (each byte does not extend
    the time), a connection that sends nothing, and a whole head with half a
    body: each closed once the header timeout passes (the body's, from its last
    byte), all but the silent one with 408; a whole request is served meanwhile."""
    server = make_server("--header-timeout-s", "1")
    half, trickled, silent, half_body = dial_raw(server), dial_raw(server), dial_raw(server), dial_raw(server)
    half.sendall(b"GET /v1/models HTTP/1.1\r\nHost: rtvideo\r\n")
    half_body.sendall(  # a whole head, then 16 of the body's 1000 bytes, then nothing
        b"POST /v1/videos HTTP/1.1\r\nHost: rtvideo\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
        + b'{"prompt": "a ca'
    )
    stop = threading.Event()

    def trickle() -> None:
        for byte in b"GET /v1/models HTTP/1.1\r\nHost: rtvideo\r\nX-Slow: " + b"a" * 1000:
            if stop.wait(0.05):
                return
            try:
                trickled.send(bytes([byte]))
            except OSError:
                return

    threading.Thread(target=trickle, daemon=True).start()
    assert httpx.get(f"{server.http}/v1/models").status_code == 200  # served while those wait
    try:
        for sock, answered in ((half, True), (trickled, True), (silent, False), (half_body, True)):
            answer, took = read_until_closed(sock, within=10)
            assert took < 5, f"held {took:.1f} s past a header timeout of 1 s"
            if answered:
                assert answer.startswith(b"HTTP/1.1 408 ") and b"request_timeout" in answer, answer[:200]
            else:
                assert answer == b""
        assert b"no byte of the request body for 1 s (16 bytes came)" in answer
    finally:
        stop.set()
    server.wait_for_log("408 request_timeout")


# -- an abandoned /sync -----------------------------------------------------------------


def test_a_sync_request_whose_client_left_is_cancelled(make_server):
    server = make_server(pipeline={"step_time_s": 0.02})
    body = {**JOB, "num_chunks": 1000}  # 80 s of work
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.http}/v1/videos/sync", json=body, timeout=1.0)
    server.released(within=15)  # the abandoned job no longer holds the worker
    assert httpx.get(f"{server.http}/v1/videos").json()["data"] == []
    assert 'rtvideo_jobs_total{status="cancelled"} 1.0' in httpx.get(f"{server.http}/metrics").text
    server.wait_for_log('"POST /v1/videos/sync HTTP/1.1" 499')
    assert "Traceback" not in "".join(server.log)


# -- a flood of jobs --------------------------------------------------------------------


async def test_a_flood_of_jobs_is_bounded_and_evicts_nothing(make_server):
    server = make_server(
        "--max-sessions", "1", "--max-queued-jobs", "4", "--max-jobs-kept", "8", pipeline={"step_time_s": 0.002}
    )
    first = httpx.post(f"{server.http}/v1/videos", json=JOB).json()
    deadline = time.monotonic() + 30
    while httpx.get(f"{server.http}/v1/videos/{first['id']}").json()["status"] != "completed":
        assert time.monotonic() < deadline
    async with httpx.AsyncClient(base_url=server.http, timeout=30) as http:
        answers = await asyncio.gather(*(http.post("/v1/videos", json={**JOB, "seed": i}) for i in range(100)))
    accepted = [a.json()["id"] for a in answers if a.status_code == 202]
    refused = [a for a in answers if a.status_code != 202]
    assert 1 <= len(accepted) <= 7  # max_jobs_kept, the first job included
    assert all(a.status_code == 429 and int(a.headers["retry-after"]) >= 1 for a in refused)
    assert {a.json()["error"]["code"] for a in refused} <= {"queue_full", "too_many_jobs"}
    assert httpx.get(f"{server.http}/health").status_code == 200  # answered through the flood
    deadline = time.monotonic() + 60
    while {j["status"] for j in httpx.get(f"{server.http}/v1/videos").json()["data"]} != {"completed"}:
        assert time.monotonic() < deadline, "the accepted jobs never finished"
    for job_id in [first["id"], *accepted]:  # nothing finished was pushed out by the flood
        assert httpx.get(f"{server.http}/v1/videos/{job_id}/content").status_code == 200
    async with open_realtime(server.ws) as ws:  # the only session slot is free again
        client = Realtime(ws)
        await client.send({**RAW, "num_chunks": 1})
        assert (await client.rest()).of("session.done")
