"""Holding up under abuse, one file: what a careless or hostile client, or a
worker gone wrong, does to the server as a subprocess, and what it gets back.

- a hung worker (SIGSTOP): found, its sessions failed, replaced;
"""

from __future__ import annotations

import os
import signal
import time

import httpx

from tests.e2e.client import Realtime, open_realtime

RAW = {"type": "session.start", "prompt": "a lantern", "format": "raw", "width": 32, "height": 32}
JOB = {"prompt": "a windmill", "format": "raw", "width": 32, "height": 32, "num_chunks": 1}


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
