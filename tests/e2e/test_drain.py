"""SIGTERM drains: running sessions end with session.done{reason: "shutdown"},
new work is refused, the process exits 0, and no worker is left."""

from __future__ import annotations

import asyncio
import signal
import subprocess

import httpx
import pytest

from tests.e2e.client import Realtime, open_realtime
from tests.engine.test_lifecycle import wait_gone


def exit_code(server, within: float = 30.0) -> int:
    """The server's exit code once it exits; a server still running after
    ``within`` seconds fails the test with the tail of its log (the drain's
    and the shutdown's lines say where it stands)."""
    try:
        return server.process.wait(timeout=within)
    except subprocess.TimeoutExpired:
        tail = "".join(server.log[-40:])
        pytest.fail(f"the server had not exited {within:g} s after its sessions ended; its log ends:\n{tail}")


async def test_sigterm_ends_live_sessions_cleanly_and_exits_0(make_server):
    server = make_server("--shutdown-grace-s", "1.5", pipeline={"step_time_s": 0.005})
    worker = server.health()["workers"][0]["pid"]
    async with open_realtime(server.ws) as ws:
        client = Realtime(ws)
        await client.send({"type": "session.start", "prompt": "endless", "format": "raw"})
        await client.until("video.start")
        await client.next()
        server.process.send_signal(signal.SIGTERM)

        # While draining: readiness says so, and new work is refused.
        for _ in range(100):
            health = httpx.get(f"{server.http}/health")
            if health.status_code == 503:
                break
            await asyncio.sleep(0.02)
        assert health.json()["status"] == "draining"
        assert httpx.get(f"{server.http}/health/live").status_code == 200
        job = httpx.post(f"{server.http}/v1/videos", json={"prompt": "p", "num_chunks": 1})
        assert job.status_code == 503 and job.json()["error"]["code"] == "shutting_down"
        async with open_realtime(server.ws) as late_ws:
            late = Realtime(late_ws)
            await late.send({"type": "session.start", "prompt": "late"})
            refused = await late.rest(timeout=10)
        assert refused.close_code == 1013 and refused.of("error")[0]["code"] == "shutting_down"

        got = await client.rest(timeout=30)  # the grace period runs out
    done = got.of("session.done")
    assert done and done[0]["reason"] == "shutdown" and done[0]["stopped"] is True
    assert got.close_code == 1000
    assert exit_code(server) == 0
    wait_gone(worker, within=10.0)


async def test_sigterm_lets_a_finite_session_finish_within_the_grace(make_server):
    server = make_server("--shutdown-grace-s", "30", pipeline={"step_time_s": 0.005})
    async with open_realtime(server.ws) as ws:
        client = Realtime(ws)
        await client.send({"type": "session.start", "prompt": "short", "format": "raw", "num_chunks": 12})
        await client.until("video.start")
        server.process.send_signal(signal.SIGTERM)
        got = await client.rest(timeout=30)
    assert got.of("session.done")[0]["reason"] == "completed" and len(got.chunks) == 12
    assert exit_code(server) == 0


async def test_a_session_stopped_while_draining_hears_its_end_before_the_exit(make_server):
    """The last session's end lets the server exit, but only once its client was
    sent the final ``session.done`` and the close: the exit does not cut them off."""
    server = make_server("--shutdown-grace-s", "60", pipeline={"step_time_s": 0.005})
    async with open_realtime(server.ws) as ws:
        client = Realtime(ws)
        await client.send({"type": "session.start", "prompt": "endless", "format": "raw"})
        await client.until("video.start")
        server.process.send_signal(signal.SIGTERM)
        for _ in range(100):
            if httpx.get(f"{server.http}/health").status_code == 503:
                break
            await asyncio.sleep(0.02)
        await client.send({"type": "session.stop"})
        got = await client.rest(timeout=30)
    done = got.of("session.done")
    assert done and done[0]["reason"] == "stopped" and got.close_code == 1000
    assert exit_code(server) == 0
