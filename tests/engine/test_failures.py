"""Failures stay where they belong: a pipeline error fails one session, a dead
worker fails all of its sessions quickly, and nothing hangs."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from rtvideo.engine.client.engine_client import EngineClient
from rtvideo.engine.client.errors import EngineDeadError, EngineStartupError, UnknownSessionError
from rtvideo.engine.config import EngineConfig, PipelineSpec
from rtvideo.engine.messages import (
    ChunkReady,
    Interaction,
    InteractionApplied,
    InteractionQueued,
    InteractionRejected,
    InteractionSuperseded,
    ScheduledInteraction,
    SessionDone,
    SessionFailed,
    StartSession,
)
from tests.conftest import PINNED_LIMITS
from tests.support import Collected, collect, make_gate, read_until, wait_reached


async def test_pipeline_error_fails_only_that_session(make_engine):
    engine = await make_engine(fail_prompt="doomed", fail_chunk=1, max_batch_rows=2)
    doomed = await engine.start_session(StartSession(session_id="bad", prompt="doomed", num_chunks=4))
    healthy = await engine.start_session(StartSession(session_id="good", prompt="fine", num_chunks=6))
    bad, good = await asyncio.gather(collect(doomed), collect(healthy))

    assert isinstance(bad.end, SessionFailed)
    assert bad.end.code == "pipeline_error"
    assert "forward failed" in bad.end.message and "injected failure at chunk 1" in bad.end.message
    assert len(bad.chunks) == 1
    assert isinstance(good.end, SessionDone) and good.end.chunks == 6
    probe = await engine.probe()
    assert probe.sessions == probe.runner_sessions == probe.pipeline_sessions == ()


async def test_every_queued_interaction_ends_once_when_the_chunk_that_took_it_fails(make_engine):
    # Chunk 1's first denoise step raises, in the invocation that crossed chunk 1's boundary.
    during_0, during_1 = make_gate(chunk=0, step=0), make_gate(chunk=1, step=0)
    engine = await make_engine(fail_prompt="doomed", fail_chunk=1, gates=[during_0, during_1])
    scheduled = tuple(
        ScheduledInteraction(at_chunk=chunk, event_id=eid, interaction=Interaction(prompt=eid))
        for chunk, eid in ((1, "planned"), (2, "later"))
    )
    start = StartSession(session_id="s", prompt="doomed", num_chunks=4, scheduled=scheduled)
    handle = await engine.start_session(start)
    seen = Collected()
    await wait_reached(during_0)
    await handle.interact("e1", Interaction(prompt="first"))
    await handle.interact("e2", Interaction(prompt="second"))  # replaces e1, and at chunk 1 the planned one
    for _ in range(2):
        assert (await read_until(handle, InteractionQueued, seen)).expected_chunk_index == 1
    during_0.release.set()
    await wait_reached(during_1)  # chunk 1's boundary took e2
    await handle.interact("e3", Interaction(prompt="third"))
    assert (await read_until(handle, InteractionQueued, seen)).expected_chunk_index == 2
    during_1.release.set()

    result = await collect(handle, seen)  # the stream ends at SessionFailed: anything after it is lost
    assert isinstance(result.end, SessionFailed) and "injected failure at chunk 1" in result.end.message
    assert [c.generation_chunk_index for c in result.chunks] == [0]
    ends = result.of(InteractionApplied) + result.of(InteractionSuperseded) + result.of(InteractionRejected)
    assert sorted(m.event_id for m in ends) == ["e1", "e2", "e3", "later", "planned"]  # each exactly once
    by_id = {m.event_id: m for m in ends}
    assert isinstance(by_id["e1"], InteractionSuperseded) and by_id["e1"].by_event_id == "e2"
    assert isinstance(by_id["planned"], InteractionSuperseded) and by_id["planned"].by_event_id == "e2"
    for eid in ("e2", "e3", "later"):
        assert isinstance(by_id[eid], InteractionRejected) and by_id[eid].code == "session_failed"
        assert "injected failure at chunk 1" in by_id[eid].message
    probe = await engine.probe()
    assert probe.sessions == probe.runner_sessions == probe.pipeline_sessions == ()


async def test_killed_worker_fails_every_session_within_two_seconds(make_engine):
    engine = await make_engine(step_time_s=0.005, max_worker_restarts=0)
    handles = [await engine.start_session(StartSession(session_id=f"s{i}", prompt="p")) for i in range(3)]
    for handle in handles:  # all three are generating
        await read_until(handle, ChunkReady, Collected())

    killed_at = time.monotonic()
    os.kill(engine.worker_pid, signal.SIGKILL)
    ends = await asyncio.gather(*(collect(h, timeout=5.0) for h in handles))
    elapsed = time.monotonic() - killed_at

    assert elapsed < 2.0, f"sessions learned of the dead worker after {elapsed:.2f} s"
    for result in ends:
        assert isinstance(result.end, SessionFailed) and result.end.code == "worker_died"
        assert "died" in result.end.message
    assert not engine.alive and "exit code -9" in engine.dead_reason
    with pytest.raises(EngineDeadError):
        await engine.start_session(StartSession(session_id="late", prompt="p"))
    with pytest.raises(EngineDeadError):
        await engine.probe()


async def test_unknown_pipeline_is_a_clear_startup_error():
    client = EngineClient(EngineConfig(pipeline=PipelineSpec("no-such-model"), startup_timeout_s=60))
    with pytest.raises(EngineStartupError, match="unknown pipeline 'no-such-model'"):
        await client.start()


async def test_bad_pipeline_options_are_a_clear_startup_error():
    client = EngineClient(EngineConfig(pipeline=PipelineSpec("stub", {"no_such_option": 1}), startup_timeout_s=60))
    with pytest.raises(EngineStartupError, match="no_such_option"):
        await client.start()


async def test_interactions_on_unknown_or_finished_sessions_raise(make_engine):
    engine = await make_engine()
    handle = await engine.start_session(StartSession(session_id="s", prompt="p", num_chunks=1))
    await collect(handle)
    with pytest.raises(UnknownSessionError):
        await engine.interact("s", "e", Interaction(prompt="later"))
    await engine.stop("s")  # idempotent: a finished session is a no-op


async def test_a_dead_worker_is_replaced_within_the_restart_budget(make_engine):
    engine = await make_engine(step_time_s=0.002, max_worker_restarts=1)
    first_pid = engine.worker_pid
    handle = await engine.start_session(StartSession(session_id="a", prompt="p"))
    await read_until(handle, ChunkReady, Collected())
    os.kill(first_pid, signal.SIGKILL)
    result = await collect(handle, timeout=5.0)
    assert isinstance(result.end, SessionFailed) and result.end.code == "worker_died"

    await engine.settled()  # a fresh worker started on the same sockets
    assert engine.alive, engine.dead_reason
    assert engine.worker_pid != first_pid and engine.restarts == 1
    again = await engine.start_session(StartSession(session_id="b", prompt="p", num_chunks=2))
    assert isinstance((await collect(again)).end, SessionDone)

    second = await engine.start_session(StartSession(session_id="c", prompt="p"))
    os.kill(engine.worker_pid, signal.SIGKILL)  # past the budget: it stays dead
    assert (await collect(second, timeout=5.0)).end.code == "worker_died"
    await engine.settled()
    assert not engine.alive and engine.restarts == 1
    with pytest.raises(EngineDeadError):
        await engine.start_session(StartSession(session_id="d", prompt="p"))


async def test_a_tiny_worker_warms_up_before_ready_and_serves_clean():
    spec = PipelineSpec("tiny", {"device": "cpu"})
    client = EngineClient(EngineConfig(pipeline=spec, startup_timeout_s=120, **PINNED_LIMITS))
    await client.start()
    try:
        probe = await client.probe()
        assert probe.pipeline_sessions == ()  # the warm-up session was released before READY
        handle = await client.start_session(StartSession(session_id="s", prompt="p", num_chunks=2))
        result = await collect(handle, timeout=60)
        assert isinstance(result.end, SessionDone) and [c.num_frames for c in result.chunks] == [9, 12]
    finally:
        await client.shutdown()


async def test_a_pipeline_that_cannot_warm_up_is_a_clear_startup_error():
    # Its default size (64x64) is past its own max_size: the warm-up's describe() refuses it.
    spec = PipelineSpec("tiny", {"device": "cpu", "max_size": 32})
    client = EngineClient(EngineConfig(pipeline=spec, startup_timeout_s=120, **PINNED_LIMITS))
    with pytest.raises(EngineStartupError, match="width must be a multiple of 16 up to 32, got 64"):
        await client.start()


@pytest.mark.parametrize(
    ("limits", "refusal"),
    [
        ({"max_pixels": 3}, r"max_pixels 3 is below the smallest frame the model makes, 2x2: no session could be"),
        (
            {"max_pixels": None, "session_memory_bytes": 8},
            r"session_memory_gib: sessions may hold 0.00 MiB of memory, and the smallest session, 2x2, needs",
        ),
    ],
)
async def test_limits_that_would_admit_no_session_refuse_the_start_naming_them(limits, refusal):
    """No request could be served: the worker says so at start, in one line,
    instead of starting a server that serves nothing (limits below the default
    session only are warned of: tests/engine/test_realtime_limits.py serves one)."""
    config = EngineConfig(startup_timeout_s=60, **{**PINNED_LIMITS, **limits})
    client = EngineClient(config)
    with pytest.raises(EngineStartupError, match=refusal):
        await client.start()
    await client.shutdown()


async def test_batch_rows_have_one_knob(make_engine):
    """The worker builds its pipeline for EngineConfig.max_batch_rows; the same
    option given to the pipeline is refused at startup, naming the server's flag."""
    engine = await make_engine(max_batch_rows=3)
    assert engine.ready.max_batch_rows == 3
    client = EngineClient(EngineConfig(pipeline=PipelineSpec("stub", {"max_batch_rows": 2}), startup_timeout_s=60))
    with pytest.raises(EngineStartupError, match="max_batch_rows: set it as the server's --max-batch-rows"):
        await client.start()


async def test_fp8_where_it_cannot_run_fails_the_start_in_one_line_naming_why():
    import torch

    if torch.cuda.is_available():
        pytest.skip("checks the refusal where FP8 cannot run")
    spec = PipelineSpec("tiny", {"device": "cpu", "warm_up_chunks": 1, "quantize": "fp8"})
    engine = EngineClient(EngineConfig(pipeline=spec, startup_timeout_s=60, **PINNED_LIMITS))
    with pytest.raises(EngineStartupError, match="quantize fp8: FP8 matrix products need a GPU .* runs on cpu"):
        await engine.start()
    await engine.shutdown()
