"""Grouping merges the denoise steps of a chunk into one runner invocation and
changes nothing else: same frames, and the boundary never joins the group."""

from __future__ import annotations

import pytest

from engine.messages import Interaction, InteractionApplied, ScheduledInteraction, SessionDone, StartSession
from tests.support import collect

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
async def test_call_pattern_one_invocation_per_chunk_grouped_one_per_step_ungrouped(make_engine, steps):
    grouped = await _run(make_engine, steps, grouped=True)
    ungrouped = await _run(make_engine, steps, grouped=False)
    # Invocation numbers count non-empty plans from 1; a lone session runs in all of them.
    assert [c.timing.runner_calls for c in grouped.chunks] == [(k + 1,) * steps for k in range(CHUNKS)]
    assert [c.timing.runner_calls for c in ungrouped.chunks] == [
        tuple(range(k * steps + 1, (k + 1) * steps + 1)) for k in range(CHUNKS)
    ]
    assert all(c.timing.steps == steps for c in grouped.chunks + ungrouped.chunks)
