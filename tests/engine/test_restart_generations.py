"""Worker restarts, one generation at a time: a fork server that dies takes its
worker with it and a new one serves; a failed restart uses one unit of the
budget and ends the engine only when it is spent; nothing sent to or by one
worker reaches the next (each worker has pipes of its own)."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import zmq

from rtvideo.engine.client.engine_client import EngineClient
from rtvideo.engine.client.errors import EngineDeadError
from rtvideo.engine.config import EngineConfig, PipelineSpec
from rtvideo.engine.messages import ChunkReady, SessionDone, SessionFailed, StartSession
from tests.conftest import PINNED_LIMITS
from tests.engine.test_lifecycle import process_gone, wait_gone
from tests.support import Collected, collect, read_until


def flaky_engine(fail_starts, max_worker_restarts: int) -> EngineClient:
    """An engine on the stub pipeline whose workers fail to start while the count
    in the file ``fail_starts`` is above 0 (``tests.engine.flaky_start``)."""
    pipeline = PipelineSpec("tests.engine.flaky_start:build", {"fail_starts": str(fail_starts), "step_time_s": 0.002})
    return EngineClient(
        EngineConfig(pipeline=pipeline, startup_timeout_s=60, max_worker_restarts=max_worker_restarts, **PINNED_LIMITS)
    )


async def test_a_killed_fork_server_fails_its_sessions_and_a_new_one_serves(make_engine):
    engine = await make_engine(step_time_s=0.002, max_worker_restarts=3)
    handles = [await engine.start_session(StartSession(session_id=f"s{i}", prompt="p")) for i in range(2)]
    for handle in handles:  # both are generating
        await read_until(handle, ChunkReady, Collected())
    server, worker = engine.fork_server_pid, engine.worker_pid
    assert server is not None and not process_gone(server)

    os.kill(server, signal.SIGKILL)
    for result in await asyncio.gather(*(collect(h, timeout=10.0) for h in handles)):
        assert isinstance(result.end, SessionFailed) and result.end.code == "worker_died"
        assert f"fork server (pid {server}) died" in result.end.message
        assert f"worker process {worker}" in result.end.message

    await engine.settled()
    assert engine.alive, engine.dead_reason
    assert process_gone(worker)  # killed with its fork server, not left serving nobody
    assert engine.fork_server_pid not in (None, server) and engine.worker_pid != worker
    assert engine.restarts == 1 and engine.restarts_left == 2
    again = await engine.start_session(StartSession(session_id="again", prompt="p", num_chunks=2))
    result = await collect(again)
    assert isinstance(result.end, SessionDone) and len(result.chunks) == 2


async def test_a_failed_restart_uses_one_unit_of_the_budget_and_the_next_try_serves(tmp_path):
    fail_starts = tmp_path / "fail-starts"
    engine = flaky_engine(fail_starts, max_worker_restarts=3)
    await engine.start()  # no file: the first worker starts
    try:
        handle = await engine.start_session(StartSession(session_id="a", prompt="p"))
        await read_until(handle, ChunkReady, Collected())
        fail_starts.write_text("1")  # the next start fails, the one after it serves
        os.kill(engine.worker_pid, signal.SIGKILL)
        assert (await collect(handle, timeout=10.0)).end.code == "worker_died"

        await engine.settled()
        assert fail_starts.read_text() == "0"  # a start failed
        assert engine.alive, engine.dead_reason
        assert engine.restarts == 1 and engine.restarts_left == 1  # two tries: the failed one counts
        again = await engine.start_session(StartSession(session_id="b", prompt="p", num_chunks=2))
        assert isinstance((await collect(again)).end, SessionDone)
    finally:
        await engine.shutdown()


async def test_restarts_that_fail_until_the_budget_is_spent_end_the_engine_with_the_reason(tmp_path):
    fail_starts = tmp_path / "fail-starts"
    engine = flaky_engine(fail_starts, max_worker_restarts=2)
    await engine.start()
    try:
        handle = await engine.start_session(StartSession(session_id="a", prompt="p"))
        fail_starts.write_text("5")
        worker = engine.worker_pid
        os.kill(worker, signal.SIGKILL)
        assert (await collect(handle, timeout=10.0)).end.code == "worker_died"
        await engine.settled()
        assert fail_starts.read_text() == "3"  # two starts were tried, no more
        assert not engine.alive and not engine.restarting and engine.restarts_left == 0
        reason = engine.dead_reason
        assert f"worker process {worker} died (exit code -9)" in reason
        assert "injected startup failure" in reason and "the restart budget is spent" in reason
        with pytest.raises(EngineDeadError, match="restart budget is spent"):
            await engine.start_session(StartSession(session_id="late", prompt="p"))
    finally:
        await engine.shutdown()


def wait_no_peer(engine: EngineClient, within: float = 10.0) -> None:
    """Block (and the event loop with it: the client has not yet seen the death)
    until ZeroMQ has dropped the dead worker's end of the control pipe, so a
    send now waits for a peer."""
    deadline = time.monotonic() + within
    while engine._control.getsockopt(zmq.EVENTS) & zmq.POLLOUT:
        assert time.monotonic() < deadline, "the dead worker's end of the control pipe was never dropped"
        time.sleep(0.01)


async def test_a_control_message_sent_as_the_worker_dies_never_reaches_the_next_one(make_engine):
    engine = await make_engine(step_time_s=0.002, max_worker_restarts=1)
    handle = await engine.start_session(StartSession(session_id="a", prompt="p"))
    await read_until(handle, ChunkReady, Collected())
    worker = engine.worker_pid
    os.kill(worker, signal.SIGKILL)
    wait_gone(worker, within=10.0)
    wait_no_peer(engine)
    # Sent after the crash, before the client handled it: the send waits for a peer.
    ghost = asyncio.create_task(engine.start_session(StartSession(session_id="ghost", prompt="p")))
    with pytest.raises(EngineDeadError):
        await ghost
    assert (await collect(handle, timeout=10.0)).end.code == "worker_died"

    await engine.settled()
    assert engine.alive and engine.worker_pid != worker, engine.dead_reason
    probe = await engine.probe()
    assert probe.sessions == () and probe.runner_sessions == ()  # the new worker never heard of "ghost"
    again = await engine.start_session(StartSession(session_id="b", prompt="p", num_chunks=1))
    assert isinstance((await collect(again)).end, SessionDone)
    assert (await engine.probe()).sessions == ()
