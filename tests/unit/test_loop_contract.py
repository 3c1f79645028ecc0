"""The engine loop's plans obey the boundary rule, checked on every plan of
randomised runs (in-process: loop, control plane, runner and stub; the
process boundary is covered by tests/engine)."""

from __future__ import annotations

import random

import pytest

from engine.config import EngineConfig
from engine.control import ControlPlane
from engine.loop import EngineLoop
from engine.messages import (
    ChunkReady,
    Interaction,
    InteractionApplied,
    InteractionQueued,
    SessionDone,
    StartSession,
    StopSession,
    SubmitInteraction,
)
from engine.plan import StepPlan
from workers.pipelines.stub import StubPipeline
from workers.runner import ModelRunner


class CheckingRunner(ModelRunner):
    """The real runner, asserting the plan contract before executing each plan."""

    def __init__(self, grouped: bool) -> None:
        super().__init__(StubPipeline())
        self.grouped = grouped
        self.plans = 0

    def execute(self, plan: StepPlan, is_cancelled):
        self.plans += 1
        boundaries = {b.session_id: b.chunk_index for b in plan.boundaries}
        for row in plan.rows:
            assert row.first_step + row.num_steps <= row.steps_per_chunk, "a row crosses its chunk's end"
            expected = row.steps_per_chunk - row.first_step if self.grouped else 1
            assert row.num_steps == expected
            if row.session_id in boundaries:
                # The boundary opens this row's chunk: nothing of the previous chunk shares the plan.
                assert (row.chunk_index, row.first_step) == (boundaries[row.session_id], 0)
            else:
                assert row.first_step > 0, "a chunk began without its boundary"
        assert not set(plan.release) & {r.session_id for r in plan.rows}
        return super().execute(plan, is_cancelled)


@pytest.mark.parametrize("grouped", [True, False])
@pytest.mark.parametrize("seed", range(5))
def test_every_plan_keeps_the_boundary_rule(grouped, seed):
    rng = random.Random(seed)
    config = EngineConfig(max_sessions=3)
    runner = CheckingRunner(grouped)
    sent: list = []
    control = ControlPlane(config, runner.describe, sent.append)
    loop = EngineLoop(config, control, runner, sent.append, grouping=grouped, max_rows=rng.choice([1, 2]))
    for i in range(3):
        steps = rng.randint(1, 4)
        control.handle(StartSession(session_id=f"s{i}", prompt=f"p{i}", num_chunks=6, num_inference_steps=steps))
    event = 0
    for _ in range(10_000):
        for sid in list(loop.sessions):
            roll = rng.random()
            if roll < 0.3:
                event += 1
                interaction = Interaction(prompt=f"q{event}", transition_chunks=rng.choice([0, 2]))
                control.handle(SubmitInteraction(session_id=sid, event_id=f"e{event}", interaction=interaction))
            elif roll < 0.32:
                control.handle(StopSession(session_id=sid))
        loop.run_once()
        if not loop.sessions and not control.open_sessions():
            break
    else:
        raise AssertionError("the sessions never ended")
    assert runner.plans > 0
    assert sum(isinstance(m, SessionDone) for m in sent) == 3
    assert runner.states == {} and runner.pipeline.held_sessions() == ()
    # Every acknowledged interaction that applied did so at the chunk it was promised.
    promised = {m.event_id: m.expected_chunk_index for m in sent if isinstance(m, InteractionQueued)}
    for applied in (m for m in sent if isinstance(m, InteractionApplied)):
        assert applied.generation_chunk_index == promised[applied.event_id]
    assert any(isinstance(m, ChunkReady) for m in sent)


def test_a_describe_that_raises_anything_refuses_the_start_and_control_goes_on():
    class Broken(CheckingRunner):
        def describe(self, start):
            if start.prompt == "boom":
                raise TypeError("unexpected failure")
            return super().describe(start)

    runner = Broken(grouped=True)
    sent: list = []
    control = ControlPlane(EngineConfig(), runner.describe, sent.append)
    control.handle(StartSession(session_id="a", prompt="boom"))
    control.handle(StartSession(session_id="b", prompt="fine"))
    rejected, started = sent
    assert rejected.code == "invalid_request" and "TypeError: unexpected failure" in rejected.message
    assert started.session_id == "b"


def test_a_release_that_raises_still_ends_the_session_and_the_loop_goes_on():
    class LeakyRelease(StubPipeline):
        def release(self, state):
            super().release(state)
            raise RuntimeError("release failed")

    runner = ModelRunner(LeakyRelease())
    sent: list = []
    config = EngineConfig()
    control = ControlPlane(config, runner.describe, sent.append)
    loop = EngineLoop(config, control, runner, sent.append, grouping=True, max_rows=1)
    control.handle(StartSession(session_id="a", prompt="p", num_chunks=1))
    control.handle(StartSession(session_id="b", prompt="q", num_chunks=2))
    for _ in range(20):
        loop.run_once()
        if not loop.sessions and not control.open_sessions():
            break
    done = [m for m in sent if isinstance(m, SessionDone)]
    assert sorted(d.session_id for d in done) == ["a", "b"] and runner.states == {}
