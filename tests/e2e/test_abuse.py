"""Holding up under abuse, one file: what a careless or hostile client, or a
worker gone wrong, does to the server as a subprocess, and what it gets back.

- a hung worker (SIGSTOP): found, its sessions failed, replaced;
- a client that stops reading: closed once a write waits too long or its
  backlog passes a byte limit, its session ended, the server's memory bounded;
"""

from __future__ import annotations

import os
import signal
import time

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.client import Realtime, open_realtime

RAW = {"type": "session.start", "prompt": "a lantern", "format": "raw", "width": 32, "height": 32}
JOB = {"prompt": "a windmill", "format": "raw", "width": 32, "height": 32, "num_chunks": 1}


def outcome(server, name: str) -> float:
    """``rtvideo_sessions_total{outcome=name}`` now."""
    for family in text_string_to_metric_families(httpx.get(f"{server.http}/metrics").text):
        for sample in family.samples:
            if sample.name == "rtvideo_sessions_total" and sample.labels.get("outcome") == name:
                return sample.value
    return 0.0


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
            assert time.monotonic() < deadline, "the stalled client was never closed"
        server.released()
        got = await client.rest(timeout=10)  # reading now: what was queued, then the close
    assert got.close_code == 1008, (got.close_code, got.close_reason)
    assert got.close_reason == "slow_client: its socket took nothing for 1 s (send_timeout_s)"
    assert not got.of("session.done")  # nothing more was queued for it
    assert not [line for line in server.log if "Traceback" in line]


async def test_a_client_whose_backlog_passes_the_byte_limit_is_closed_and_memory_stays_bounded(make_server):
    """Pacing would let 30 s of media (290 MB) wait for this client; the outbox
    limit (4 MB) closes it after two chunks instead, and the server's memory
    never grows by more than a few chunks."""
    server = make_server(
        "--max-outbox-bytes",
        "4000000",
        "--max-undelivered-seconds",
        "30",
        "--send-timeout-s",
        "60",
        pipeline={"step_time_s": 0.001, "max_size": 512},
    )
    api = psutil.Process(server.process.pid)
    before = peak = api.memory_info().rss
    async with stalled_client(server) as ws:
        client = Realtime(ws)
        await client.send(BIG_RAW)
        await client.until("video.start")
        deadline = time.monotonic() + 30
        while outcome(server, "slow_client") != 1.0:
            peak = max(peak, api.memory_info().rss)
            assert time.monotonic() < deadline, "the stalled client was never closed"
        server.released()
        got = await client.rest(timeout=10)
    assert got.close_code == 1008 and got.close_reason.startswith("slow_client: "), got.close_reason
    assert "past max_outbox_bytes (4000000)" in got.close_reason
    assert peak - before < 64 << 20, f"the server grew by {(peak - before) >> 20} MiB"
