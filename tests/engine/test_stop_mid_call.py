"""A stop honoured within a forward and within a decode, through a real worker
(stub pipeline): a forward or decode whose sessions are all stopping is
abandoned at its next block or frame, never waited out; a batched forward with
another session's row in it runs on.

The stub's simulated compute is slept block by block (``step_time_s``) and
frame by frame (``decode_time_s``), with a stop point before each, as a
model's forward and decode have; a gate inside the call says "the call is
under way now", so no sleep is needed to place the stop."""

from __future__ import annotations

import time

from rtvideo.engine.messages import ChunkReady, Interaction, InteractionRejected, SessionDone, StartSession
from rtvideo.workers.pipelines.stub import DECODE_GATE_STEP
from tests.support import Collected, collect, make_gate, read_until, wait_reached

SLOW_S = 600.0  # a call this long would outlast every timeout here: only abandoning it ends the test in time


async def _stop_seen(handle) -> Collected:
    """Stop the session, and return once the worker has seen the stop: control is
    handled in order, so an interaction sent after it is refused as session_ended."""
    await handle.stop()
    await handle.interact("after-stop", Interaction(prompt="after the stop"))
    seen = Collected()
    refused = await read_until(handle, InteractionRejected, seen)
    assert refused.code == "session_ended"
    return seen


async def test_a_stop_abandons_the_forward_under_way(make_engine):
    gate = make_gate(chunk=0, step=0)
    engine = await make_engine(gates=[gate], step_time_s=SLOW_S)  # one forward: 600 s
    handle = await engine.start_session(StartSession(session_id="s", prompt="p"))
    await wait_reached(gate)  # inside the forward of chunk 0's first step
    seen = await _stop_seen(handle)
    began = time.monotonic()
    gate.release.set()
    result = await collect(handle, seen, timeout=30.0)
    took = time.monotonic() - began

    assert isinstance(result.end, SessionDone) and result.end.stopped and result.end.reason == "stopped"
    assert result.end.chunks == 0 and not result.chunks
    assert took < SLOW_S / 20, f"the stop waited {took:.1f} s for the forward"
    after = await engine.probe()
    assert after.sessions == after.runner_sessions == after.pipeline_sessions == ()
    assert after.steps == 0  # the abandoned step is not counted as run


async def test_a_stop_abandons_the_decode_under_way(make_engine):
    gate = make_gate(chunk=0, step=DECODE_GATE_STEP)
    engine = await make_engine(gates=[gate], decode_time_s=SLOW_S)  # the decode stage: one decode, 600 s
    assert engine.ready.overlap_decode is True
    handle = await engine.start_session(StartSession(session_id="s", prompt="p"))  # until stopped
    await wait_reached(gate)  # chunk 0 committed, its decode begun
    seen = await _stop_seen(handle)
    gate.release.set()
    result = await collect(handle, seen, timeout=30.0)

    assert isinstance(result.end, SessionDone) and result.end.reason == "stopped"  # not failed
    assert not result.chunks  # the abandoned chunk is not sent
    after = await engine.probe()
    assert after.sessions == after.runner_sessions == after.pipeline_sessions == ()


async def test_a_batched_forward_runs_on_for_the_row_still_wanted(make_engine):
    first = make_gate(chunk=0, step=0, prompt="a")
    batched = make_gate(chunk=0, step=2, prompt="a")
    engine = await make_engine(gates=[first, batched], max_batch_rows=2)
    a = await engine.start_session(StartSession(session_id="a", prompt="a", num_chunks=1))
    await wait_reached(first)  # a's first forward holds while b is admitted
    b = await engine.start_session(StartSession(session_id="b", prompt="b", num_chunks=2))
    first.release.set()
    # a's step 2 runs in the third micro-step, planned after b was admitted: b's row is in it.
    await wait_reached(batched)
    seen = await _stop_seen(a)
    batched.release.set()
    a_result = await collect(a, seen)
    b_result = await collect(b)

    assert isinstance(a_result.end, SessionDone) and a_result.end.reason == "stopped" and not a_result.chunks
    assert isinstance(b_result.end, SessionDone) and b_result.end.reason == "completed"
    first_chunk = b_result.chunks[0]
    assert isinstance(first_chunk, ChunkReady)
    assert first_chunk.timing.batch_rows == 2  # b shared forwards with a, and was never cut short
    assert first_chunk.timing.batch_exact  # the stub's batched forward is batch-invariant
    assert [c.timing.batch_rows for c in b_result.chunks[1:]] == [1]  # alone once a had gone
