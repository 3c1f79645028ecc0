"""Faults on pipeline ranks, through real worker processes over the tiny model
split over two ranks: a session whose boundary failed on a later rank fails,
naming the rank, instead of running on a cache that missed its boundary, and
the other session goes on; ranks with no device to run on fail the start
naming why."""

from __future__ import annotations

import asyncio

import pytest
import torch

from engine.client import EngineClient, EngineStartupError
from engine.config import EngineConfig, PipelineSpec
from engine.messages import SessionDone, SessionFailed, StartSession
from tests.conftest import PINNED_LIMITS
from tests.support import collect

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
