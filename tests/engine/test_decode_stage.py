"""Decode as a stage of its own: a chunk decodes while the session's next chunk
denoises, and nothing a client sees changes (real worker processes, stub)."""

from __future__ import annotations

import asyncio

from rtvideo.engine.messages import (
    Interaction,
    InteractionApplied,
    ScheduledInteraction,
    SessionDone,
    SessionFailed,
    StartSession,
)
from rtvideo.workers.pipelines.stub import DECODE_GATE_STEP
from tests.support import collect, make_gate, wait_reached


def _start(prompt: str = "a harbour at night") -> StartSession:
    scheduled = (ScheduledInteraction(at_chunk=2, event_id="e", interaction=Interaction(prompt="fog")),)
    return StartSession(session_id="s", prompt=prompt, seed=3, num_chunks=5, transition_chunks=2, scheduled=scheduled)


async def test_the_next_chunk_denoises_while_a_chunk_decodes(make_engine):
    decode_0 = make_gate(chunk=0, step=DECODE_GATE_STEP)
    step_1 = make_gate(chunk=1, step=0)
    engine = await make_engine(gates=[decode_0, step_1])  # the stub says overlapping pays
    assert engine.ready.overlap_decode is True
    assert engine.ready.cpu_threads is None  # the stub runs no kernels: no thread count to choose
    handle = await engine.start_session(_start())
    await wait_reached(decode_0)  # chunk 0 is committed, and its decode is held
    await wait_reached(step_1)  # chunk 1 denoises meanwhile (in line, the decode would hold it back)
    probe = await engine.probe()  # the loop answers while both stages are held
    assert (probe.steps, probe.chunks) == (4, 0), "a chunk went out before its decode ended"
    decode_0.release.set()
    step_1.release.set()
    result = await collect(handle)
    assert isinstance(result.end, SessionDone) and result.end.chunks == 5
    assert [c.generation_chunk_index for c in result.chunks] == [0, 1, 2, 3, 4]


async def test_overlapped_and_in_line_decodes_give_the_same_session(make_engine):
    results = []
    for overlap in (True, False):
        engine = await make_engine(overlap_decode=overlap, step_time_s=0.002, decode_time_s=0.004)
        assert engine.ready.overlap_decode is overlap
        results.append(await collect(await engine.start_session(_start())))
    overlapped, in_line = results
    assert [c.payload for c in overlapped.chunks] == [c.payload for c in in_line.chunks]
    for field in ("first_frame_index", "media_start_seconds", "started_event_ids", "completed_event_ids"):
        assert [getattr(c, field) for c in overlapped.chunks] == [getattr(c, field) for c in in_line.chunks]
    assert overlapped.of(InteractionApplied)[0].generation_chunk_index == 2
    assert overlapped.end == in_line.end


async def test_a_failed_decode_fails_the_session_after_the_chunks_before_it(make_engine):
    engine = await make_engine(fail_prompt="doomed", fail_chunk=2, fail_in_decode=True, overlap_decode=True)
    doomed, healthy = await asyncio.gather(
        collect(await engine.start_session(StartSession(session_id="bad", prompt="doomed", num_chunks=5))),
        collect(await engine.start_session(StartSession(session_id="good", prompt="fine", num_chunks=5))),
    )
    assert isinstance(doomed.end, SessionFailed) and "injected decode failure at chunk 2" in doomed.end.message
    assert [c.generation_chunk_index for c in doomed.chunks] == [0, 1]
    assert isinstance(healthy.end, SessionDone) and healthy.end.chunks == 5
    probe = await engine.probe()
    assert probe.sessions == probe.runner_sessions == probe.pipeline_sessions == ()
