"""The guarantee: an interaction that reaches the worker while chunk k is being
denoised is active from chunk k+1, for 1-4 steps per chunk, grouped or not.

Real path: EngineClient -> ZeroMQ -> control-receiver thread -> mailbox ->
engine loop -> runner -> stub pipeline, in a spawned worker. The stub holds
the worker inside the denoise step of chunk K at a gate; the test sends the
interaction, waits for the worker's own "queued" acknowledgement (which proves
it reached the worker while chunk K was being denoised), then releases.
"""

from __future__ import annotations

import numpy as np
import pytest

from rtvideo.engine.messages import Interaction, InteractionApplied, InteractionQueued, SessionDone, StartSession
from rtvideo.workers.pipelines.stub import DECODE_GATE_STEP
from tests.support import Collected, collect, conditioning_of, expected_row, make_gate, read_until, wait_reached

K = 1  # the chunk being denoised when the interaction arrives


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "ungrouped"])
@pytest.mark.parametrize("steps", [1, 2, 3, 4])
@pytest.mark.parametrize("where", ["first_step", "last_step"])
async def test_interaction_during_chunk_k_is_active_from_k_plus_1(make_engine, steps, grouped, where):
    gate = make_gate(chunk=K, step=0 if where == "first_step" else steps - 1)
    engine = await make_engine(group_chunk_steps=grouped, gates=[gate])
    start = StartSession(session_id="s", prompt="a red fox", num_chunks=4, num_inference_steps=steps)
    handle = await engine.start_session(start)
    seen = Collected()

    await wait_reached(gate)  # the worker is inside denoise step `gate.step` of chunk K
    await handle.interact("update", Interaction(prompt="a blue whale"))
    queued = await read_until(handle, InteractionQueued, seen)
    assert queued.in_progress_chunk_index == K
    assert queued.expected_chunk_index == K + 1
    gate.release.set()

    result = await collect(handle, seen)
    assert isinstance(result.end, SessionDone) and result.end.chunks == 4
    [applied] = result.of(InteractionApplied)
    assert applied.generation_chunk_index == K + 1
    width = handle.geometry.width
    before, after = expected_row("a red fox", width), expected_row("a blue whale", width)
    rows = [conditioning_of(chunk) for chunk in result.chunks]
    assert [np.array_equal(row, before) for row in rows] == [True, True, False, False]
    assert [np.array_equal(row, after) for row in rows] == [False, False, True, True]
    assert result.chunks[K + 1].started_event_ids == ("update",)
    assert applied.first_frame_index == result.chunks[K + 1].first_frame_index
    assert applied.media_start_seconds == pytest.approx(result.chunks[K + 1].media_start_seconds)
    assert applied.queued_to_applied_ms >= 0.0


async def test_interaction_while_chunk_0_is_denoised_applies_at_chunk_1(make_engine):
    gate = make_gate(chunk=0, step=0)
    engine = await make_engine(gates=[gate])
    handle = await engine.start_session(StartSession(session_id="s", prompt="first", num_chunks=2))
    await wait_reached(gate)
    # Chunk 0 is already being denoised: the update belongs to chunk 1.
    await handle.interact("e", Interaction(prompt="second"))
    seen = Collected()
    queued = await read_until(handle, InteractionQueued, seen)
    gate.release.set()
    result = await collect(handle, seen)
    assert (queued.in_progress_chunk_index, queued.expected_chunk_index) == (0, 1)
    assert result.of(InteractionApplied)[0].generation_chunk_index == 1


async def test_with_the_decode_stage_one_sent_while_chunk_k_decodes_lands_at_the_next_chunk_not_begun(make_engine):
    """With the decode stage, chunk k+1 begins as soon as chunk k is committed,
    while k still decodes: an interaction accepted then (k's decode held at a
    gate, k+1's first step held at another) lands at k+2, the next chunk whose
    boundary is still to come, and the acknowledgement says so."""
    decoding = make_gate(chunk=0, step=DECODE_GATE_STEP)
    denoising = make_gate(chunk=1, step=0)
    engine = await make_engine(overlap_decode=True, gates=[decoding, denoising])
    handle = await engine.start_session(StartSession(session_id="s", prompt="first", num_chunks=4))
    await wait_reached(decoding)  # chunk 0 committed, its decode held
    await wait_reached(denoising)  # chunk 1 begun meanwhile: its boundary is taken
    await handle.interact("e", Interaction(prompt="second"))
    seen = Collected()
    queued = await read_until(handle, InteractionQueued, seen)
    decoding.release.set()
    denoising.release.set()
    result = await collect(handle, seen)
    assert (queued.in_progress_chunk_index, queued.expected_chunk_index) == (1, 2)
    [applied] = result.of(InteractionApplied)
    assert applied.generation_chunk_index == 2
    assert result.chunks[2].started_event_ids == ("e",)
