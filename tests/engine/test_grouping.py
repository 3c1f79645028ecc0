"""Grouping issues a chunk's micro-steps back to back and changes nothing else:
same frames, and the boundary never joins the group."""

from __future__ import annotations

import pytest

from rtvideo.engine.messages import Interaction, InteractionApplied, ScheduledInteraction, SessionDone, StartSession
from tests.support import collect, make_gate, wait_reached

CHUNKS = 4


def _start(steps: int) -> StartSession:
    return StartSession(
        session_id="s",
        prompt="a lighthouse at dusk",
        seed=7,
        num_chunks=CHUNKS,
        num_inference_steps=steps,
        transition_chunks=2,
        scheduled=(ScheduledInteraction(at_chunk=2, event_id="e", interaction=Interaction(prompt="a storm")),),
    )


async def _run(make_engine, steps: int, grouped: bool):
    engine = await make_engine(group_chunk_steps=grouped)
    assert engine.ready.grouping is grouped
    result = await collect(await engine.start_session(_start(steps)))
    assert isinstance(result.end, SessionDone) and result.end.chunks == CHUNKS
    return result


@pytest.mark.parametrize("steps", [1, 2, 3, 4])
async def test_grouped_and_ungrouped_runs_give_identical_outputs(make_engine, steps):
    grouped = await _run(make_engine, steps, grouped=True)
    ungrouped = await _run(make_engine, steps, grouped=False)
    assert [c.payload for c in grouped.chunks] == [c.payload for c in ungrouped.chunks]
    assert [c.started_event_ids for c in grouped.chunks] == [c.started_event_ids for c in ungrouped.chunks]
    assert grouped.of(InteractionApplied)[0].generation_chunk_index == 2
    assert ungrouped.of(InteractionApplied)[0].generation_chunk_index == 2


@pytest.mark.parametrize("steps", [2, 3])
async def test_grouped_chunks_run_their_micro_steps_back_to_back_ungrouped_take_turns(make_engine, steps):
    """Two sessions, one row a forward: grouped, each chunk's steps are consecutive
    micro-steps; ungrouped, the sessions alternate step by step while both run."""
    for grouped in (True, False):
        gate = make_gate(chunk=0, step=0, prompt="first")
        engine = await make_engine(group_chunk_steps=grouped, gates=[gate])
        starts = [
            StartSession(session_id=sid, prompt=sid, num_chunks=CHUNKS, num_inference_steps=steps)
            for sid in ("first", "second")
        ]
        first = await engine.start_session(starts[0])
        await wait_reached(gate)
        second = await engine.start_session(starts[1])  # admitted while the first one's step 0 runs
        gate.release.set()
        results = [await collect(h) for h in (first, second)]
        for result in results:
            assert isinstance(result.end, SessionDone) and all(c.timing.steps == steps for c in result.chunks)
            calls = [c.timing.runner_calls for c in result.chunks]
            if grouped:
                assert all(c == tuple(range(c[0], c[0] + steps)) for c in calls), calls
            else:  # chunk 1 of either session runs while the other one runs too
                assert calls[1] == tuple(range(calls[1][0], calls[1][0] + 2 * steps, 2)), calls
