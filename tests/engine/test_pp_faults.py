"""Faults on pipeline ranks, through real worker processes over the tiny model
split over two ranks: a session whose boundary failed on a later rank fails,
naming the rank, instead of running on a cache that missed its boundary, and
the other session goes on; ranks with no device to run on fail the start
naming why; a prompt sent while a chunk is held in the ring at a gate lands
exactly where the worker said it would."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

from rtvideo.engine.client.engine_client import EngineClient
from rtvideo.engine.client.errors import EngineStartupError
from rtvideo.engine.client.spawned_worker import fork_server_pid
from rtvideo.engine.config import EngineConfig, PipelineSpec
from rtvideo.engine.messages import (
    Interaction,
    InteractionApplied,
    InteractionQueued,
    SessionDone,
    SessionFailed,
    StartSession,
)
from tests.conftest import PINNED_LIMITS
from tests.engine.test_lifecycle import process_gone
from tests.support import Collected, collect, make_gate, read_until, wait_reached

SIZE = {"width": 32, "height": 32}


async def test_a_boundary_that_fails_on_a_later_rank_fails_its_session_and_no_other():
    options = {"device": "cpu", "warm_up_chunks": 1, "fail_follow_prompt": "doomed", "fail_follow_chunk": 2}
    spec = PipelineSpec("tests.engine.faulty_pipeline:build", options)
    engine = EngineClient(EngineConfig(pipeline=spec, pp=2, max_batch_rows=2, startup_timeout_s=120, **PINNED_LIMITS))
    await engine.start()
    try:
        doomed = await engine.start_session(StartSession(session_id="d", prompt="doomed", num_chunks=4, **SIZE))
        healthy = await engine.start_session(StartSession(session_id="h", prompt="fine", num_chunks=4, **SIZE))
        doomed_seen, healthy_seen = await asyncio.gather(collect(doomed, timeout=120), collect(healthy, timeout=120))
        later = await engine.start_session(StartSession(session_id="n", prompt="x", num_chunks=3, **SIZE))
        again = await collect(later, timeout=120)
    finally:
        await engine.shutdown()
    end = doomed_seen.end
    assert isinstance(end, SessionFailed), end
    assert "rank 1: boundary failed" in end.message and "injected boundary failure at chunk 2" in end.message
    assert [c.generation_chunk_index for c in doomed_seen.chunks] == [0, 1]  # chunk 2 never ran on a stale cache
    assert isinstance(healthy_seen.end, SessionDone) and len(healthy_seen.chunks) == 4
    assert isinstance(again.end, SessionDone) and len(again.chunks) == 3


async def test_a_decode_on_a_later_rank_that_returns_no_chunk_fails_its_session_not_the_group():
    """The first session decodes on rank 1 (a follower takes a tie). A decode there
    whose output cannot travel as frames is that session's decode error, as on
    rank 0: it used to end rank 1's decode thread, and so the whole group."""
    options = {"device": "cpu", "warm_up_chunks": 1, "bad_prompt": "doomed", "bad_chunk": 1}
    spec = PipelineSpec("tests.engine.faulty_pipeline:build_bad_later_decode", options)
    engine = EngineClient(EngineConfig(pipeline=spec, pp=2, max_batch_rows=2, startup_timeout_s=120, **PINNED_LIMITS))
    await engine.start()
    try:
        worker = engine.worker_pid
        doomed = await engine.start_session(StartSession(session_id="d", prompt="doomed", num_chunks=4, **SIZE))
        healthy = await engine.start_session(StartSession(session_id="h", prompt="fine", num_chunks=4, **SIZE))
        doomed_seen, healthy_seen = await asyncio.gather(collect(doomed, timeout=120), collect(healthy, timeout=120))
        assert engine.worker_pid == worker and engine.restarts == 0  # the group lives on
        probe = await engine.probe()
    finally:
        await engine.shutdown()
    end = doomed_seen.end
    assert isinstance(end, SessionFailed) and end.code == "pipeline_error", end
    assert end.message == "rank 1: decode returned an empty payload", end.message
    assert [c.generation_chunk_index for c in doomed_seen.chunks] == [0]
    assert isinstance(healthy_seen.end, SessionDone) and len(healthy_seen.chunks) == 4
    assert probe.sessions == probe.runner_sessions == probe.pipeline_sessions == ()


async def test_a_decode_that_never_ends_on_a_later_rank_ends_the_group_within_pp_timeout_s():
    """Rank 1 decodes its sessions' chunks one after another: one that never ends
    would hold every session decoding there for ever, unseen by the heartbeat
    (the loop is idle, waiting). Rank 0 counts how long the rank has owed a
    decode: past pp_timeout_s the group ends, its sessions fail as the worker's
    death, and a fresh group serves the next session."""
    options = {"device": "cpu", "warm_up_chunks": 1, "hang_prompt": "doomed", "hang_chunk": 1}
    spec = PipelineSpec("tests.engine.faulty_pipeline:build_hung_later_decode", options)
    config = EngineConfig(pipeline=spec, pp=2, pp_timeout_s=3.0, startup_timeout_s=120, **PINNED_LIMITS)
    engine = EngineClient(config)
    await engine.start()
    try:
        doomed = await engine.start_session(StartSession(session_id="d", prompt="doomed", num_chunks=4, **SIZE))
        seen = await collect(doomed, timeout=60)
        await engine.settled()
        after = await engine.start_session(StartSession(session_id="n", prompt="fine", num_chunks=2, **SIZE))
        again = await collect(after, timeout=60)
    finally:
        await engine.shutdown()
    assert isinstance(seen.end, SessionFailed) and seen.end.code == "worker_died", seen.end
    assert "pipeline rank 1 lost: TimeoutError: no decode came back in" in seen.end.message, seen.end.message
    assert [c.generation_chunk_index for c in seen.chunks] == [0]
    assert engine.restarts == 1 and isinstance(again.end, SessionDone) and len(again.chunks) == 2


async def test_a_split_decode_batch_whose_back_fails_for_one_session_fails_that_session_alone():
    """pp_decode split, four sessions: their chunks' back halves go through rank 1
    in batches. A batch that fails there has changed no session's cache, so each
    of its rows goes through the back alone, and only the session that fails on
    its own fails; the batch's failure used to fail every row in it."""
    spec = PipelineSpec("tests.engine.faulty_pipeline:build_failing_back", {"device": "cpu", "bad_prompt": "doomed"})
    config = EngineConfig(
        pipeline=spec, pp=2, pp_decode="split", max_batch_rows=2, max_sessions=6, startup_timeout_s=120, **PINNED_LIMITS
    )
    engine = EngineClient(config)
    await engine.start()
    try:
        ids = ["d", "h0", "h1", "h2"]
        handles = [
            await engine.start_session(
                StartSession(session_id=sid, prompt="doomed" if sid == "d" else f"fine {sid}", num_chunks=4, **SIZE)
            )
            for sid in ids
        ]
        doomed, *healthy = await asyncio.gather(*(collect(handle, timeout=120) for handle in handles))
        probe = await engine.probe()
    finally:
        await engine.shutdown()
    assert isinstance(doomed.end, SessionFailed) and "injected back failure (alone)" in doomed.end.message, doomed.end
    for seen in healthy:
        assert isinstance(seen.end, SessionDone) and len(seen.chunks) == 4, seen.end
    assert probe.sessions == probe.runner_sessions == probe.pipeline_sessions == ()


@pytest.mark.skipif(torch.cuda.is_available(), reason="asks for GPUs where none is visible")
async def test_ranks_with_no_device_to_run_on_fail_the_start_in_one_line_naming_why():
    """Pipeline ranks asked onto GPUs this host does not have: the start fails at
    once with the placement's reason, not a timeout or an opaque rank death."""
    spec = PipelineSpec("tiny", {"device": "cuda", "warm_up_chunks": 1})
    engine = EngineClient(EngineConfig(pipeline=spec, pp=2, startup_timeout_s=60, **PINNED_LIMITS))
    with pytest.raises(
        EngineStartupError, match="PlacementError: pipeline rank 0: the pipeline option device is 'cuda'"
    ):
        await engine.start()
    await engine.shutdown()


async def test_a_pipeline_that_cannot_be_split_fails_the_start_and_leaves_no_rank_behind():
    """The later ranks are forked first thing, before rank 0 knows its pipeline
    cannot be split (the stub has no blocks): the start fails naming why, and
    rank 0 ends them before it exits. Every process of the group was a fork of
    this test process's fork server (its command line and environment, which
    names the test process under xdist): none is left."""
    engine = EngineClient(EngineConfig(pp=2, startup_timeout_s=60, **PINNED_LIMITS))
    with pytest.raises(EngineStartupError, match="pp: the 'stub' pipeline cannot be split over pipeline ranks"):
        await engine.start()
    await engine.shutdown()
    server = fork_server_pid()
    image = _image(server)
    for _ in range(100):
        left = [pid for pid in _pids() if pid != server and _image(pid) == image and not process_gone(pid)]
        if not left:
            break
        await asyncio.sleep(0.05)
    assert left == [], "ranks of the failed group are still running"


def _pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def _image(pid: int) -> tuple[bytes, bytes] | None:
    """A process's command line and environment as it began."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as command, open(f"/proc/{pid}/environ", "rb") as environment:
            return command.read(), environment.read()
    except OSError:
        return None


@pytest.mark.parametrize("stream_batch", [False, True], ids=["exact", "stream-batch"])
async def test_a_prompt_sent_while_chunk_k_enters_the_ring_lands_where_its_acknowledgement_says(stream_batch):
    """Two ranks, the first holding chunk 1's first step at a gate: the prompt
    reaches the worker while chunk 1 is being denoised. Exact, it lands at
    chunk 2; with stream batch at the next chunk still to begin (chunk 2 or 3,
    as far as the loop had planned ahead), and in both exactly where the
    worker's acknowledgement said, behind as many chunks in flight as the
    answer says."""
    gate = make_gate(chunk=1, step=0)
    options = {"device": "cpu", "warm_up_chunks": 1, "gate": gate}
    spec = PipelineSpec("tests.engine.faulty_pipeline:build_gated", options)
    config = EngineConfig(pipeline=spec, pp=2, stream_batch=stream_batch, startup_timeout_s=120, **PINNED_LIMITS)
    engine = EngineClient(config)
    await engine.start()
    try:
        handle = await engine.start_session(StartSession(session_id="s", prompt="a calm sea", **SIZE))
        await wait_reached(gate, timeout=120)
        await handle.interact("e", Interaction(prompt="a storm"))
        seen = Collected()
        queued = await read_until(handle, InteractionQueued, seen, timeout=60)
        gate.release.set()
        applied = await read_until(handle, InteractionApplied, seen, timeout=120)
        await handle.stop()
        await collect(handle, seen, timeout=120)
    finally:
        await engine.shutdown()
    assert applied.generation_chunk_index == queued.expected_chunk_index
    lookahead = config.lookahead("soft")
    if stream_batch:
        assert 2 <= applied.generation_chunk_index <= 1 + lookahead
        assert 1 <= applied.chunks_in_flight <= lookahead
    else:
        assert (queued.in_progress_chunk_index, applied.generation_chunk_index) == (1, 2)
        assert applied.chunks_in_flight == 1
