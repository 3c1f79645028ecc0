"""SIGTERM drains: running sessions end with session.done{reason: "shutdown"},
new work is refused, the process exits 0, and no worker is left."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.client import Chunk, Realtime, open_realtime
from tests.engine.test_lifecycle import process_gone, wait_gone


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


def loading_server(tmp_path) -> tuple[subprocess.Popen, int]:
    """``rtvideo serve`` on a model whose build never ends (``tests/e2e/slow_start.py``),
    once its worker is building; and the worker's pid."""
    from tests.conftest import PINNED_LIMITS
    from tests.e2e.conftest import ROOT

    marker = tmp_path / "building"
    command = [
        *(sys.executable, "-m", "rtvideo.cli", "serve", "--port", "0", "--log-level", "info"),
        *("--model", "tests.e2e.slow_start:build", "--pipeline-options", json.dumps({"marker": str(marker)})),
        *("--data-dir", str(tmp_path / "data"), "--max-pixels", str(PINNED_LIMITS["max_pixels"])),
    ]
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    while not marker.exists() or not marker.read_text():  # the worker is building its pipeline
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"the worker never began building: {process.communicate()[0]}")
        time.sleep(0.05)
    return process, int(marker.read_text())


def test_an_exit_signal_while_the_model_loads_ends_the_start_at_once_in_one_line(tmp_path):
    """Nothing is served yet, so there is nothing to drain: the start is given up,
    its worker stopped, and the server exits (uvicorn's failed start, 3) saying
    why in one line. It used to wait for the model to load (minutes, for a real
    one) and log an AttributeError's traceback from the drain."""
    process, worker = loading_server(tmp_path)
    try:
        process.send_signal(signal.SIGTERM)
        out, _ = process.communicate(timeout=20)
    finally:
        process.kill()
    assert process.returncode == 3, out
    assert "api ERROR rtvideo serve: stopped by SIGTERM before the server was ready" in out, out
    assert "Traceback" not in out and "Application startup complete" not in out, out
    assert process_gone(worker)


def test_a_worker_still_loading_its_model_ends_when_the_api_process_is_killed(tmp_path):
    """The worker watches the liveness pipe from its first moment, not only once it
    serves: killed meanwhile, the API process left it loading a model for nobody."""
    process, worker = loading_server(tmp_path)
    process.kill()
    process.communicate(timeout=20)
    wait_gone(worker, within=10)


async def test_a_sigterm_to_the_whole_process_group_drains_and_leaves_the_worker_serving_to_the_end(make_server):
    """systemd (KillMode=control-group) and ``timeout`` send SIGTERM to every
    process of the server at once. The fork server, the workers' parent, follows
    the API process as the workers do: it ignores the signal, so the worker is
    not killed under the drain (its sessions would fail worker_died, and a fresh
    worker would be started during the shutdown). Here the fork server gets its
    SIGTERM first; the session then ends with the drain, as with SIGTERM alone."""
    server = make_server("--shutdown-grace-s", "1.0", pipeline={"step_time_s": 0.005})
    worker = server.health()["workers"][0]["pid"]
    fork_server = int(Path(f"/proc/{worker}/stat").read_text().rsplit(")", 1)[1].split()[1])  # its parent
    async with open_realtime(server.ws) as ws:
        client = Realtime(ws)
        await client.send({"type": "session.start", "prompt": "endless", "format": "raw"})
        await client.until("video.start")
        await client.next()
        os.kill(fork_server, signal.SIGTERM)
        os.kill(worker, signal.SIGTERM)  # as the group's signal reaches every process: the worker ignores it too
        for _ in range(3):  # still chunks: the worker serves on
            assert isinstance(await client.next(), Chunk)
        server.process.send_signal(signal.SIGTERM)
        got = await client.rest(timeout=30)
    done = got.of("session.done")
    assert done and done[0]["reason"] == "shutdown", got.events
    assert exit_code(server) == 0
    assert "was killed with it" not in "".join(server.log) and "restarting the worker" not in "".join(server.log)
    wait_gone(worker, within=10)
    wait_gone(fork_server, within=10)


async def test_a_worker_lost_while_the_server_drains_is_not_replaced(make_server):
    """A fresh worker would load its model only to be shut down: the server says
    the engine is dead for the shutdown, and exits as the drain ends."""
    server = make_server("--shutdown-grace-s", "30", pipeline={"step_time_s": 0.005})
    worker = server.health()["workers"][0]["pid"]
    async with open_realtime(server.ws) as ws:
        client = Realtime(ws)
        await client.send({"type": "session.start", "prompt": "endless", "format": "raw"})
        await client.until("video.start")
        server.process.send_signal(signal.SIGTERM)
        for _ in range(500):  # the drain has begun
            if httpx.get(f"{server.http}/health").status_code == 503:
                break
            await asyncio.sleep(0.02)
        else:
            pytest.fail("the server did not begin to drain within 10 s of its SIGTERM")
        os.kill(worker, signal.SIGKILL)
        got = await client.rest(timeout=30)
    assert got.of("error")[0]["code"] == "worker_died", got.events
    assert exit_code(server) == 0
    log = "".join(server.log)
    assert "the engine is dead: the server is shutting down" in log and "restarting the worker" not in log, log
