"""Process lifecycle: READY, orderly shutdown, and no orphan worker however
the parent goes away."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rtvideo.engine.messages import SessionDone, StartSession
from tests.support import collect, make_gate, wait_reached

ROOT = Path(__file__).resolve().parents[2]


def process_gone(pid: int) -> bool:
    """True once ``pid`` has exited (a zombie waiting for its reaper counts as exited)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


def wait_gone(pid: int, within: float) -> float:
    """Seconds until ``pid`` exits; fails after ``within`` seconds."""
    started = time.monotonic()
    while not process_gone(pid):
        if time.monotonic() - started > within:
            raise AssertionError(f"process {pid} is still alive after {within} s")
        time.sleep(0.02)
    return time.monotonic() - started


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_no_orphan_worker_whatever_signal_ends_the_parent(sig):
    parent = subprocess.Popen(
        [sys.executable, "-m", "tests.engine.parent_process"], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    try:
        line = parent.stdout.readline()
        assert line.startswith("READY "), line
        worker = int(line.split()[1])
        assert not process_gone(worker)
        parent.send_signal(sig)
        parent.wait(timeout=30)
        # SIGINT: orderly shutdown. SIGTERM/SIGKILL: the worker sees its parent's
        # liveness pipe close and shuts itself down.
        wait_gone(worker, within=10.0)
        if sig is signal.SIGINT:
            assert parent.returncode == 0
    finally:
        parent.kill()
        parent.wait()


async def test_shutdown_ends_open_sessions_with_done_shutdown(make_engine):
    engine = await make_engine(step_time_s=0.002)
    handles = [await engine.start_session(StartSession(session_id=f"s{i}", prompt="p")) for i in range(2)]
    pid = engine.worker_pid
    collecting = [asyncio.create_task(collect(h)) for h in handles]
    await engine.shutdown()
    for result in await asyncio.gather(*collecting):
        assert isinstance(result.end, SessionDone) and result.end.reason == "shutdown" and result.end.stopped
    assert process_gone(pid)
    assert engine._process.exitcode == 0


async def test_shutdown_kills_a_worker_that_does_not_exit_in_time():
    from rtvideo.engine.client.engine_client import EngineClient
    from rtvideo.engine.config import EngineConfig, PipelineSpec

    gate = make_gate(chunk=0, step=0)
    client = EngineClient(EngineConfig(pipeline=PipelineSpec("stub", {"gates": [gate]}), shutdown_timeout_s=1.0))
    await client.start()
    await client.start_session(StartSession(session_id="stuck", prompt="p"))
    await wait_reached(gate)  # the loop is stuck inside the pipeline and never drains Shutdown
    started = time.monotonic()
    await client.shutdown()
    assert time.monotonic() - started < 5.0
    assert process_gone(client.worker_pid)


async def test_shutdown_ends_the_heartbeat_also_when_its_cancel_lands_as_a_probe_is_sent(make_engine):
    """``shutdown`` cancels the heartbeat task wherever it is, also in the one
    turn of the loop between its probe's send completing and the task resuming.
    ``asyncio.wait_for`` on Python 3.11 swallows a cancel that lands there: the
    task went on probing and ``shutdown`` waited for it for ever (a benchmark
    hung so). With the heartbeat probing without a pause, about half of these
    shutdowns land there (three of six before the fix); each must finish."""
    for _ in range(6):
        engine = await make_engine()
        engine.heartbeat.interval_s = 0.0
        first = engine.heartbeat.last_reply.probe_id if engine.heartbeat.last_reply else 0
        while engine.heartbeat.last_reply is None or engine.heartbeat.last_reply.probe_id < first + 3:
            await asyncio.sleep(0.001)  # until its sleep of the old interval is over and it probes back to back
        shutting = asyncio.create_task(engine.shutdown())
        done, _ = await asyncio.wait({shutting}, timeout=20)  # about 0.1 s when it works
        if not done:
            engine._heartbeat_task.cancel()  # a second cancel ends it, and the shutdown with it
            await shutting
        assert done, "shutdown still waited for the heartbeat task after 20 s"
        assert engine._heartbeat_task.done()
