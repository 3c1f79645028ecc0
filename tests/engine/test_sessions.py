"""Session behaviour through a real worker: stop, the mailbox rules,
transitions, admission, isolation and fair sharing."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from rtvideo.engine.client.errors import SessionRejectedError
from rtvideo.engine.limits import MAX_TRANSITION_CHUNKS
from rtvideo.engine.messages import (
    ChunkReady,
    Interaction,
    InteractionApplied,
    InteractionQueued,
    InteractionRejected,
    InteractionSuperseded,
    ScheduledInteraction,
    SessionDone,
    StartSession,
)
from tests.support import (
    Collected,
    collect,
    conditioning_of,
    expected_blend_row,
    expected_row,
    make_gate,
    read_until,
    wait_reached,
)


async def test_stop_mid_chunk_frees_the_session(make_engine):
    gate = make_gate(chunk=1, step=1)
    engine = await make_engine(gates=[gate])
    handle = await engine.start_session(StartSession(session_id="s", prompt="p", num_inference_steps=4))
    await wait_reached(gate)  # inside a grouped invocation, between steps of chunk 1
    seen = Collected()
    # Chunk 0 decodes on the decode stage beside the held step; a stop before its
    # decode ran would rightly cancel it, so the stop waits until it is out.
    await read_until(handle, ChunkReady, seen)
    await handle.stop()
    # Control is handled in order: once an interaction sent after the stop is
    # refused as "session_ended", the worker has seen the stop.
    await handle.interact("probe", Interaction(prompt="after the stop"))
    refused = await read_until(handle, InteractionRejected, seen)
    assert refused.code == "session_ended"
    gate.release.set()
    result = await collect(handle, seen)

    assert isinstance(result.end, SessionDone)
    assert result.end.stopped and result.end.reason == "stopped" and result.end.chunks == 1
    assert [c.generation_chunk_index for c in result.chunks] == [0]  # the cut chunk is discarded
    after = await engine.probe()
    assert after.sessions == after.runner_sessions == after.pipeline_sessions == ()
    assert after.steps == 4 + 1  # chunk 0, step 0 of chunk 1; step 1, under way at the stop, was abandoned


async def test_probe_reports_what_the_runner_and_pipeline_hold(make_engine):
    engine = await make_engine()
    handle = await engine.start_session(StartSession(session_id="s", prompt="p"))
    await read_until(handle, ChunkReady, Collected())
    held = await engine.probe()
    assert held.sessions == held.runner_sessions == held.pipeline_sessions == ("s",)
    await handle.stop()
    await collect(handle)
    released = await engine.probe()
    assert released.sessions == released.runner_sessions == released.pipeline_sessions == ()


async def test_last_write_wins_and_the_superseded_one_is_reported(make_engine):
    gate = make_gate(chunk=0, step=0)
    engine = await make_engine(gates=[gate])
    handle = await engine.start_session(StartSession(session_id="s", prompt="base", num_chunks=3))
    await wait_reached(gate)
    seen = Collected()
    await handle.interact("first", Interaction(prompt="first"))
    await read_until(handle, InteractionQueued, seen)
    await handle.interact("second", Interaction(prompt="second"))
    superseded = await read_until(handle, InteractionSuperseded, seen)
    gate.release.set()
    result = await collect(handle, seen)

    assert (superseded.event_id, superseded.by_event_id) == ("first", "second")
    [applied] = result.of(InteractionApplied)
    assert (applied.event_id, applied.generation_chunk_index) == ("second", 1)
    assert np.array_equal(conditioning_of(result.chunks[1]), expected_row("second", handle.geometry.width))
    assert result.chunks[1].completed_event_ids == ("first", "second")
    assert [a.event_id for a in result.end.applied] == ["second"]


async def test_event_id_is_an_idempotency_key(make_engine):
    gate = make_gate(chunk=0, step=0)
    engine = await make_engine(gates=[gate])
    handle = await engine.start_session(StartSession(session_id="s", prompt="base", num_chunks=3))
    await wait_reached(gate)
    seen = Collected()
    await handle.interact("e", Interaction(prompt="update"))
    first = await read_until(handle, InteractionQueued, seen)
    await handle.interact("e", Interaction(prompt="update"))  # same body: a no-op
    again = await read_until(handle, InteractionQueued, seen)
    await handle.interact("e", Interaction(prompt="something else"))  # same id, other body
    conflict = await read_until(handle, InteractionRejected, seen)
    gate.release.set()
    result = await collect(handle, seen)

    assert not first.duplicate and again.duplicate
    assert conflict.code == "event_id_conflict" and "'e'" in conflict.message
    assert [a.event_id for a in result.of(InteractionApplied)] == ["e"]
    assert not result.of(InteractionSuperseded)
    width = handle.geometry.width
    assert np.array_equal(conditioning_of(result.chunks[1]), expected_row("update", width))


@pytest.mark.parametrize("n", [2, 3, 4])
async def test_transition_blends_over_n_chunks(make_engine, n):
    gate = make_gate(chunk=0, step=0)
    engine = await make_engine(gates=[gate])
    handle = await engine.start_session(StartSession(session_id="s", prompt="old", num_chunks=n + 3))
    await wait_reached(gate)
    seen = Collected()
    await handle.interact("t", Interaction(prompt="new", transition_chunks=n))
    await read_until(handle, InteractionQueued, seen)
    gate.release.set()
    result = await collect(handle, seen)

    width = handle.geometry.width
    rows = [conditioning_of(chunk) for chunk in result.chunks]
    assert np.array_equal(rows[0], expected_row("old", width))
    for j in range(n):  # chunk 1 + j weighs the new prompt by (j + 1) / n
        assert np.array_equal(rows[1 + j], expected_blend_row("old", "new", (j + 1) / n, width)), j
    assert all(np.array_equal(row, expected_row("new", width)) for row in rows[1 + n :])
    events = [(c.started_event_ids, c.active_event_ids, c.completed_event_ids) for c in result.chunks]
    assert events[1] == (("t",), ("t",), ())
    assert events[n] == ((), ("t",), ("t",))
    assert events[n + 1] == ((), (), ())


async def test_hard_cut_with_zero_or_one_transition_chunks(make_engine):
    engine = await make_engine()
    for n in (0, 1):
        start = StartSession(
            session_id=f"s{n}",
            prompt="old",
            num_chunks=3,
            transition_chunks=n,  # the session default, used by the scheduled interaction
            scheduled=(ScheduledInteraction(at_chunk=1, event_id="cut", interaction=Interaction(prompt="new")),),
        )
        handle = await engine.start_session(start)
        result = await collect(handle)
        width = handle.geometry.width
        assert np.array_equal(conditioning_of(result.chunks[1]), expected_row("new", width))
        assert result.chunks[1].completed_event_ids == ("cut",)


async def test_admission_limit_refuses_with_a_reason_and_frees_the_slot(make_engine):
    gate = make_gate(chunk=0, step=0, prompt="holder")
    engine = await make_engine(max_sessions=2, gates=[gate])
    first = await engine.start_session(StartSession(session_id="a", prompt="holder", num_chunks=1))
    await engine.start_session(StartSession(session_id="b", prompt="p"))
    with pytest.raises(SessionRejectedError) as refused:
        await engine.start_session(StartSession(session_id="c", prompt="p"))
    assert refused.value.code == "server_full" and "max_sessions=2" in refused.value.message

    gate.release.set()
    await collect(first)  # "a" completes; its slot frees
    third = await engine.start_session(StartSession(session_id="c", prompt="p"))
    assert third.geometry.width > 0


@pytest.mark.parametrize(
    ("start", "field"),
    [
        (dict(prompt="  "), "prompt"),
        (dict(prompt="p", num_inference_steps=0), "num_inference_steps"),
        (dict(prompt="p", num_inference_steps=9), "num_inference_steps"),
        (dict(prompt="p", width=-4), "width"),
        (dict(prompt="p", height=100_000), "height"),
        (dict(prompt="p", width=33), "width"),
        (dict(prompt="p", num_chunks=0), "num_chunks"),
        (dict(prompt="p", seed=-1), "seed"),
        (dict(prompt="p", transition_chunks=-1), "transition_chunks"),
    ],
)
async def test_invalid_starts_are_refused_naming_the_field(make_engine, start, field):
    engine = await make_engine()
    with pytest.raises(SessionRejectedError) as refused:
        await engine.start_session(StartSession(session_id="s", **start))
    assert refused.value.code == "invalid_request"
    assert field in refused.value.message
    ok = await engine.start_session(StartSession(session_id="s", prompt="still fine", num_chunks=1))
    assert isinstance((await collect(ok)).end, SessionDone)


async def test_bad_interactions_are_rejected_and_the_session_goes_on(make_engine):
    gate = make_gate(chunk=1, step=0)
    engine = await make_engine(gates=[gate])
    handle = await engine.start_session(StartSession(session_id="s", prompt="p", num_chunks=2))
    await wait_reached(gate)  # chunk 1, the last one, has begun
    seen = Collected()
    for event_id, interaction in [
        ("empty", Interaction(prompt="")),
        ("long", Interaction(prompt="p", transition_chunks=MAX_TRANSITION_CHUNKS + 1)),
        ("late", Interaction(prompt="too late")),
    ]:
        await handle.interact(event_id, interaction)
        rejected = await read_until(handle, InteractionRejected, seen)
        assert rejected.event_id == event_id
    gate.release.set()
    result = await collect(handle, seen)
    codes = [r.code for r in result.of(InteractionRejected)]
    assert codes == ["invalid_interaction", "invalid_interaction", "interaction_too_late"]
    assert isinstance(result.end, SessionDone) and result.end.chunks == 2


async def test_sessions_sharing_a_worker_produce_what_each_produces_alone(make_engine):
    def start(sid: str, prompt: str, seed: int) -> StartSession:
        return StartSession(session_id=sid, prompt=prompt, seed=seed, num_chunks=4)

    alone = await make_engine()
    solo = [await collect(await alone.start_session(start(f"solo{i}", f"prompt {i}", i))) for i in range(3)]

    shared = await make_engine(max_sessions=3)
    handles = [await shared.start_session(start(f"s{i}", f"prompt {i}", i)) for i in range(3)]
    together = await asyncio.gather(*(collect(h) for h in handles))
    for a, b in zip(solo, together, strict=True):
        assert [c.payload for c in a.chunks] == [c.payload for c in b.chunks]


async def test_sessions_take_turns_round_robin(make_engine):
    gate = make_gate(chunk=0, step=0, prompt="p0")
    engine = await make_engine(max_sessions=3, gates=[gate])
    handles = [
        await engine.start_session(StartSession(session_id=f"s{i}", prompt=f"p{i}", num_chunks=3)) for i in range(3)
    ]
    await wait_reached(gate)  # all three are admitted before anything runs further
    gate.release.set()
    results = await asyncio.gather(*(collect(h) for h in handles))
    calls = sorted((chunk.timing.runner_calls[0], index) for index, r in enumerate(results) for chunk in r.chunks)
    order = [index for _, index in calls]
    assert order[:3] == [0, 1, 2]  # after the first plan, strict rotation
    assert order == [0, 1, 2] * 3


async def test_a_device_memory_budget_refuses_sessions_that_would_not_fit(make_engine):
    """The stub says each 32x32 session holds 4 KiB and 10 KiB are free: two fit."""
    gate = make_gate(chunk=0, step=0, prompt="holder")
    engine = await make_engine(max_sessions=8, gates=[gate], memory_budget=10 * 1024)
    assert engine.ready.session_memory_bytes == 10 * 1024
    first = await engine.start_session(StartSession(session_id="a", prompt="holder", num_chunks=1))
    await engine.start_session(StartSession(session_id="b", prompt="p"))
    assert first.geometry.state_bytes == 4096
    with pytest.raises(SessionRejectedError) as refused:
        await engine.start_session(StartSession(session_id="c", prompt="p"))
    assert refused.value.code == "server_full" and "needs 4.00 KiB of device memory" in refused.value.message
    small = await engine.start_session(StartSession(session_id="small", prompt="p", width=16, height=16))
    assert small.geometry.state_bytes == 1024

    gate.release.set()
    await collect(first)  # "a" completes; its memory frees
    third = await engine.start_session(StartSession(session_id="c", prompt="p"))
    assert third.geometry.width == 32


async def test_a_configured_session_memory_overrides_the_pipelines(make_engine):
    engine = await make_engine(memory_budget=10 * 1024, session_memory_bytes=4096)
    assert engine.ready.session_memory_bytes == 4096
    await engine.start_session(StartSession(session_id="a", prompt="p"))
    with pytest.raises(SessionRejectedError, match="0 B of the 4.00 KiB"):
        await engine.start_session(StartSession(session_id="b", prompt="p"))
