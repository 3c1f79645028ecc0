"""A worker that dies, restarts, wedges or is gone for good, seen from outside.

The server runs as a subprocess on the stub pipeline. A restart is held for as
long as a test needs by the stub's ``startup_gate``: a FIFO created once the
server is up, which the fresh worker's construction opens and blocks on until
the test opens its write end.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import httpx

from tests.e2e.client import Realtime, open_realtime

JOB = {"prompt": "a windmill", "seed": 1, "width": 32, "height": 32, "format": "raw", "num_chunks": 2}


async def kill_worker_under_a_session(server) -> None:
    worker = server.health()["workers"][0]["pid"]
    async with open_realtime(server.ws) as ws:
        client = Realtime(ws)
        await client.send({"type": "session.start", "prompt": "p", "format": "raw"})
        await client.until("video.start")
        await client.next()
        os.kill(worker, signal.SIGKILL)
        got = await client.rest(timeout=10)
    [error] = [e for e in got.of("error") if e["fatal"]]
    assert error["code"] == "worker_died" and got.close_code == 1011


async def refused_start(server) -> tuple[dict, int | None]:
    async with open_realtime(server.ws) as ws:
        late = Realtime(ws)
        await late.send({"type": "session.start", "prompt": "p", "format": "raw"})
        refused = await late.rest(timeout=10)
    [error] = refused.of("error")
    return error, refused.close_code


def wait_ready(server, within: float = 30.0) -> dict:
    deadline = time.monotonic() + within
    while (health := httpx.get(f"{server.http}/health")).status_code != 200:
        assert time.monotonic() < deadline, health.text
        time.sleep(0.05)
    return health.json()


async def test_a_dead_worker_ends_its_sessions_and_a_fresh_one_takes_over(make_server):
    server = make_server(pipeline={"step_time_s": 0.005})
    await kill_worker_under_a_session(server)
    assert wait_ready(server)["workers"][0]["restarts"] == 1
    async with open_realtime(server.ws) as ws:
        client = Realtime(ws)
        await client.send({"type": "session.start", "prompt": "again", "format": "raw", "num_chunks": 2})
        assert (await client.rest()).of("session.done")


async def test_requests_during_a_restart_are_told_to_retry_and_liveness_holds(make_server, tmp_path):
    gate = tmp_path / "restart-gate"
    server = make_server(pipeline={"step_time_s": 0.005, "startup_gate": str(gate)})
    os.mkfifo(gate)  # the first worker is up; the next one will wait here
    await kill_worker_under_a_session(server)

    live = httpx.get(f"{server.http}/health/live")
    assert live.status_code == 200 and live.json()["status"] == "restarting"
    ready = httpx.get(f"{server.http}/health")
    assert ready.status_code == 503 and ready.json()["status"] == "restarting"
    for route in ("/v1/videos", "/v1/videos/sync"):
        refused = httpx.post(f"{server.http}{route}", json=JOB)
        assert refused.status_code == 503, (route, refused.text)
        assert refused.json()["error"]["code"] == "engine_unavailable"
        assert "restarting" in refused.json()["error"]["message"]
        assert int(refused.headers["retry-after"]) >= 1
    error, close = await refused_start(server)
    assert error["code"] == "engine_unavailable" and error["fatal"] is True and close == 1013
    models = httpx.get(f"{server.http}/v1/models")  # what is served does not change with a restart
    assert models.status_code == 200 and models.json()["data"][0]["id"] == "stub"
    assert httpx.get(f"{server.http}/v1/videos").status_code == 200
    assert httpx.get(f"{server.http}/metrics").status_code == 200
    assert not [line for line in server.log if "Traceback" in line or "Exception in ASGI" in line]

    opened = threading.Thread(target=lambda: open(gate, "wb").close(), daemon=True)
    opened.start()  # the held worker goes on
    opened.join(30)
    os.unlink(gate)
    wait_ready(server)
    assert httpx.get(f"{server.http}/health/live").json()["status"] == "ok"
    created = httpx.post(f"{server.http}/v1/videos", json=JOB)
    assert created.status_code == 202


async def test_a_queued_job_outlives_a_restart(make_server, tmp_path):
    """A job waiting for capacity when the worker dies is started by the fresh worker."""
    gate = tmp_path / "restart-gate"
    server = make_server("--max-sessions", "1", pipeline={"step_time_s": 0.005, "startup_gate": str(gate)})
    os.mkfifo(gate)
    worker = server.health()["workers"][0]["pid"]
    async with open_realtime(server.ws) as ws:
        holder = Realtime(ws)
        await holder.send({"type": "session.start", "prompt": "holds the only slot", "format": "raw"})
        await holder.until("video.start")
        queued = httpx.post(f"{server.http}/v1/videos", json=JOB)
        assert queued.status_code == 202 and queued.json()["status"] == "queued"
        os.kill(worker, signal.SIGKILL)
        await holder.rest(timeout=10)
    job_id = queued.json()["id"]
    assert httpx.get(f"{server.http}/v1/videos/{job_id}").json()["status"] == "queued"
    threading.Thread(target=lambda: open(gate, "wb").close(), daemon=True).start()
    deadline = time.monotonic() + 30
    while (job := httpx.get(f"{server.http}/v1/videos/{job_id}").json())["status"] != "completed":
        assert job["status"] in ("queued", "in_progress") and time.monotonic() < deadline, job
        await asyncio.sleep(0.05)
    os.unlink(gate)


async def test_without_restarts_a_dead_worker_fails_liveness_and_new_work(make_server):
    server = make_server("--max-worker-restarts", "0", pipeline={"step_time_s": 0.005})
    await kill_worker_under_a_session(server)
    health = httpx.get(f"{server.http}/health")
    assert health.status_code == 503 and "died" in health.json()["reason"]
    live = httpx.get(f"{server.http}/health/live")
    assert live.status_code == 503 and live.json()["status"] == "dead"  # an orchestrator restarts it
    error, close = await refused_start(server)
    assert error["code"] == "engine_unavailable" and close == 1011
    for route in ("/v1/videos", "/v1/videos/sync"):
        refused = httpx.post(f"{server.http}{route}", json=JOB)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_unavailable"
        assert "retry-after" not in refused.headers
    assert httpx.get(f"{server.http}/metrics").text.count("rtvideo_worker_up 0.0") == 1


async def test_liveness_tells_a_long_forward_from_a_wedged_one(make_server):
    """A first forward at a size never measured may run up to the worker startup
    timeout (here 8 s) before it counts as wedged: past a second it is ``busy``
    (200), well past the 1 s floor it is still busy, and at the timeout the
    worker is killed: the session fails with ``worker_wedged`` and, with no
    restarts allowed, liveness fails (503) saying why."""
    server = make_server(
        "--worker-wedged-after-s",
        "1",
        "--worker-startup-timeout-s",
        "8",
        "--max-worker-restarts",
        "0",
        pipeline={"step_time_s": 30.0},
    )
    assert httpx.get(f"{server.http}/health/live").json()["status"] == "ok"
    async with open_realtime(server.ws) as ws:
        client = Realtime(ws)
        await client.send({"type": "session.start", "prompt": "one very long step", "format": "raw"})
        await client.until("video.start")
        statuses = []  # the executor is inside a 30 s step now; the loop still answers
        deadline = time.monotonic() + 30
        while (live := httpx.get(f"{server.http}/health/live")).status_code == 200:
            statuses.append((live.json()["status"], live.json().get("reason", "")))
            assert time.monotonic() < deadline, live.text
            time.sleep(0.1)  # the condition is time itself: how long the forward has run
        got = await client.rest(timeout=10)
    seen = [status for status, _ in statuses]
    assert "busy" in seen and seen == sorted(seen, key=["ok", "busy"].index), statuses
    assert any("one forward has run for 2." in reason for _, reason in statuses), statuses  # past the floor
    assert live.status_code == 503 and live.json()["status"] in ("wedged", "dead"), live.text
    assert "past its deadline of 8.0 s (no chunk of this size measured yet)" in live.json()["reason"]
    [error] = got.of("error")
    assert error["code"] == "worker_wedged" and error["fatal"] is True and got.close_code == 1011
