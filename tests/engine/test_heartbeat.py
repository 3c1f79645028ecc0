"""The worker heartbeat through real worker processes: a stopped worker and a
forward far past what its chunks cost are both found, their sessions fail with
``worker_wedged``, and a fresh worker takes over under the restart budget."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from rtvideo.engine.client.heartbeat import FACTOR
from rtvideo.engine.messages import ChunkReady, SessionDone, SessionFailed, StartSession
from tests.support import Collected, collect, make_gate, read_until, wait_reached


async def test_a_stopped_worker_is_found_wedged_and_replaced(make_engine):
    engine = await make_engine(wedged_after_s=1.0, max_worker_restarts=1, step_time_s=0.005)
    handles = [await engine.start_session(StartSession(session_id=f"s{i}", prompt="p")) for i in range(2)]
    for handle in handles:
        await read_until(handle, ChunkReady, Collected())
    stopped = engine.worker_pid

    os.kill(stopped, signal.SIGSTOP)
    began = time.monotonic()
    ends = await asyncio.gather(*(collect(h, timeout=30) for h in handles))
    took = time.monotonic() - began

    for result in ends:
        assert isinstance(result.end, SessionFailed) and result.end.code == "worker_wedged", result.end
        assert f"worker process {stopped} is wedged" in result.end.message
        assert "answered no probe for" in result.end.message
    # Not before the floor; and within it plus a few heartbeats (generous: 2 shared cores).
    assert 1.0 <= took < 6.0, took
    await engine.settled()
    assert engine.alive and engine.restarts == 1 and engine.worker_pid != stopped
    with pytest.raises(ProcessLookupError):
        os.kill(stopped, 0)  # killed and reaped
    again = await engine.start_session(StartSession(session_id="after", prompt="p", num_chunks=2))
    assert isinstance((await collect(again)).end, SessionDone)
    assert engine.responsiveness()[0] == "ok"


async def test_a_forward_past_its_measured_deadline_is_wedged(make_engine):
    """Chunks of four 50 ms steps are measured; then one forward blocks (a gate).
    The deadline is ten times the slowest chunk, above the 1 s floor: the
    session fails once the forward passed it, not before. With no restarts
    left the engine stays down, and says why."""
    gate = make_gate(chunk=3, step=0)
    engine = await make_engine(wedged_after_s=1.0, max_worker_restarts=0, step_time_s=0.05, gates=[gate])
    handle = await engine.start_session(StartSession(session_id="s", prompt="p"))
    await wait_reached(gate)
    began = time.monotonic()
    deadline, why = engine.heartbeat.deadline([(32, 32)])
    assert deadline > 1.0 and why.startswith(f"{FACTOR:g} x the slowest chunk measured")

    result = await collect(handle, timeout=60)
    took = time.monotonic() - began
    assert [c.generation_chunk_index for c in result.chunks] == [0, 1, 2]
    assert isinstance(result.end, SessionFailed) and result.end.code == "worker_wedged"
    assert "one forward has run for" in result.end.message and "past its deadline of" in result.end.message
    assert took >= deadline - 0.1, (took, deadline)  # the gate is seen a moment after the forward began
    await engine.settled()
    assert not engine.alive and "wedged" in engine.dead_reason
