"""The engine loop's plans obey the boundary rule, checked on every plan of
randomised runs, and every acknowledged interaction ends exactly once, with
pipeline failures injected at a chunk boundary or in a denoise step
(in-process: loop, control plane, runner and stub; the process boundary is
covered by tests/engine)."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable

import pytest

from rtvideo.engine.config import EngineConfig
from rtvideo.engine.control import ControlPlane
from rtvideo.engine.messages import (
    ChunkReady,
    EngineStats,
    Interaction,
    InteractionApplied,
    InteractionQueued,
    InteractionRejected,
    InteractionSuperseded,
    ScheduledInteraction,
    SessionDone,
    SessionFailed,
    StartSession,
    StopSession,
    SubmitInteraction,
)
from rtvideo.engine.plan import MicroStep
from rtvideo.workers.pipelines.stub import StubPipeline
from rtvideo.workers.runner import ModelRunner
from tests.support import inline_loop

STAGES = ("apply", "prepare", "denoise")


class FailingStub(StubPipeline):
    """The stub, raising for a session at chunk ``chunk`` in ``stage``: applying
    an interaction at the boundary, preparing the chunk, or its first denoise
    step. ``before_raise`` runs first (a stand-in for the control-receiver
    thread accepting a message while the call is in progress)."""

    def __init__(self, fail: dict[str, tuple[str, int]] | None = None) -> None:
        super().__init__()
        self.fail = dict(fail or {})
        self.before_raise: Callable[[], None] | None = None

    def _maybe_fail(self, state, stage: str, chunk: int) -> None:
        if self.fail.get(state.session_id) == (stage, chunk):
            if self.before_raise is not None:
                self.before_raise()
            raise RuntimeError(f"injected {stage} failure at chunk {chunk}")

    def boundary(self, state, chunk_index, prompt=None, transition_chunks=0):
        if prompt is not None:
            self._maybe_fail(state, "apply", chunk_index)
        self._maybe_fail(state, "prepare", chunk_index)
        super().boundary(state, chunk_index, prompt, transition_chunks)

    def forward(self, batch, states, blocks=None, hidden=None):
        for row, state in zip(batch.rows, states, strict=True):
            if row.step == 0:
                self._maybe_fail(state, "denoise", row.chunk_index)
        return super().forward(batch, states, blocks, hidden)


def assert_each_interaction_ends_once(sent: list) -> None:
    """Every acknowledged interaction ends exactly once (applied, superseded or
    rejected), before its session's last message (which ends the client's stream)."""
    queued = {(m.session_id, m.event_id) for m in sent if isinstance(m, InteractionQueued)}
    ended: Counter = Counter()
    terminal: set[str] = set()
    for m in sent:
        if isinstance(m, InteractionApplied | InteractionSuperseded | InteractionRejected):
            key = (m.session_id, m.event_id)
            if key in queued:
                assert m.session_id not in terminal, f"{m} came after its session's end"
                ended[key] += 1
        elif isinstance(m, SessionDone | SessionFailed):
            assert m.session_id not in terminal, f"{m.session_id} ended twice"
            terminal.add(m.session_id)
    assert {key for key, count in ended.items() if count == 1} == queued, (
        f"never ended: {sorted(queued - set(ended))}; ended more than once: "
        f"{sorted(key for key, count in ended.items() if count > 1)}"
    )


class CheckingRunner(ModelRunner):
    """The real runner, asserting the plan contract before executing each micro-step:
    one row a session; a chunk begins with its boundary, only after the previous
    chunk's last step ran; the steps of a chunk run in order, one a micro-step;
    with grouping, a begun chunk's next step is in every micro-step until it ends."""

    def __init__(self, grouped: bool, fail: dict[str, tuple[str, int]] | None = None) -> None:
        super().__init__(FailingStub(fail))
        self.grouped = grouped
        self.plans = 0
        self.last_ran: dict[str, tuple[int, int, int]] = {}  # session -> (chunk, step, steps) of its latest row
        self.stopping: Callable[[str], bool] = lambda session_id: False  # the control plane's, once it exists

    def execute(self, step: MicroStep):
        self.plans += 1
        boundaries = {b.session_id: b.chunk_index for b in step.boundaries}
        rows = step.rows
        assert len({r.session_id for r in rows}) == len(rows), "a session has two rows in one forward"
        if self.grouped:
            begun = {sid for sid, (_, s, n) in self.last_ran.items() if s + 1 < n and sid in self.states}
            ending = set(step.release) | {sid for sid in begun if self.stopping(sid)}  # a stop cuts a chunk
            assert begun - ending <= {r.session_id for r in rows}, "grouping left a begun chunk out of a micro-step"
        for row in rows:
            assert 0 <= row.step < row.steps_per_chunk, "a row past its chunk's end"
            before = self.last_ran.get(row.session_id)
            if row.session_id in boundaries:
                # The boundary opens this row's chunk, once the previous chunk's last step ran.
                assert (row.chunk_index, row.step) == (boundaries[row.session_id], 0)
                assert before is None or (before[0] + 1, before[1] + 1) == (row.chunk_index, before[2])
            else:
                assert before is not None and before[:2] == (row.chunk_index, row.step - 1), "steps out of order"
            self.last_ran[row.session_id] = (row.chunk_index, row.step, row.steps_per_chunk)
        assert not set(step.release) & {r.session_id for r in rows}
        return super().execute(step)


@pytest.mark.parametrize("grouped", [True, False])
@pytest.mark.parametrize("seed", range(5))
def test_every_plan_keeps_the_boundary_rule(grouped, seed):
    rng = random.Random(seed)
    config = EngineConfig(max_sessions=3)
    # Session s1 may fail, at a boundary or in a denoise step, at a random chunk.
    failure = rng.choice([None, *((stage, rng.randrange(6)) for stage in STAGES)])
    runner = CheckingRunner(grouped, {"s1": failure} if failure else None)
    sent: list = []
    control = ControlPlane(config, runner.describe, sent.append)
    runner.stopping = control.is_stopping
    loop = inline_loop(config, control, runner, sent.append, grouping=grouped, max_rows=rng.choice([1, 2]))
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
    assert sum(isinstance(m, SessionDone | SessionFailed) for m in sent) == 3
    assert runner.states == {} and runner.pipeline.held_sessions() == ()
    assert_each_interaction_ends_once(sent)
    # Every acknowledged interaction that applied did so at the chunk it was promised.
    promised = {m.event_id: m.expected_chunk_index for m in sent if isinstance(m, InteractionQueued)}
    for applied in (m for m in sent if isinstance(m, InteractionApplied)):
        assert applied.generation_chunk_index == promised[applied.event_id]
    assert any(isinstance(m, ChunkReady) for m in sent)


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "ungrouped"])
@pytest.mark.parametrize("stage", STAGES)
def test_every_queued_interaction_ends_once_when_the_boundary_that_took_it_fails(grouped, stage):
    config = EngineConfig()
    runner = CheckingRunner(grouped, {"s": (stage, 1)})
    sent: list = []
    control = ControlPlane(config, runner.describe, sent.append)
    loop = inline_loop(config, control, runner, sent.append, grouping=grouped, max_rows=1)

    def submit(event_id: str, prompt: str) -> None:
        control.handle(SubmitInteraction(session_id="s", event_id=event_id, interaction=Interaction(prompt=prompt)))

    scheduled = tuple(
        ScheduledInteraction(at_chunk=chunk, event_id=eid, interaction=Interaction(prompt=eid))
        for chunk, eid in ((1, "planned"), (3, "later"))
    )
    control.handle(StartSession(session_id="s", prompt="p", num_chunks=6, scheduled=scheduled))
    loop.run_once()  # chunk 0 begins
    submit("e1", "first")
    submit("e2", "second")  # replaces e1, and at chunk 1 the planned one
    # Accepted while chunk 1's boundary call is in progress: promised to chunk 2.
    runner.pipeline.before_raise = lambda: submit("e3", "third")
    for _ in range(100):
        loop.run_once()
        if not loop.sessions:
            break

    failed = [m for m in sent if not isinstance(m, EngineStats)][-1]  # the session's last word (figures aside)
    assert isinstance(failed, SessionFailed) and failed.code == "pipeline_error"
    assert f"injected {stage} failure at chunk 1" in failed.message
    assert not any(isinstance(m, ChunkReady) and m.generation_chunk_index >= 1 for m in sent)
    assert_each_interaction_ends_once(sent)
    ends = {
        m.event_id: m for m in sent if isinstance(m, InteractionApplied | InteractionSuperseded | InteractionRejected)
    }
    assert set(ends) == {"e1", "e2", "e3", "planned", "later"}
    assert isinstance(ends["e1"], InteractionSuperseded) and ends["e1"].by_event_id == "e2"
    assert isinstance(ends["planned"], InteractionSuperseded) and ends["planned"].by_event_id == "e2"
    for eid in ("e2", "e3", "later"):  # none took effect: the session failed first
        assert isinstance(ends[eid], InteractionRejected) and ends[eid].code == "session_failed", ends[eid]
        assert "injected" in ends[eid].message
    assert "failed at chunk 1 before this interaction took effect" in ends["e2"].message
    assert control.open_sessions() == () and runner.states == {} and runner.pipeline.held_sessions() == ()


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
    loop = inline_loop(config, control, runner, sent.append, grouping=True, max_rows=1)
    control.handle(StartSession(session_id="a", prompt="p", num_chunks=1))
    control.handle(StartSession(session_id="b", prompt="q", num_chunks=2))
    for _ in range(100):
        loop.run_once()
        if not loop.sessions and not control.open_sessions():
            break
    done = [m for m in sent if isinstance(m, SessionDone)]
    assert sorted(d.session_id for d in done) == ["a", "b"] and runner.states == {}


def test_a_memory_budget_admits_sessions_while_their_state_fits():
    """Each stub session holds 4 bytes a pixel: 32x32 = 4 KiB, 16x16 = 1 KiB."""
    sent: list = []
    control = ControlPlane(EngineConfig(max_sessions=8), StubPipeline().describe, sent.append, memory_budget=9 * 1024)
    for sid in ("a", "b"):
        control.handle(StartSession(session_id=sid, prompt="p"))
    control.handle(StartSession(session_id="c", prompt="p"))
    control.handle(StartSession(session_id="small", prompt="p", width=16, height=16))
    started_a, started_b, refused, started_small = sent
    assert [m.session_id for m in (started_a, started_b, started_small)] == ["a", "b", "small"]
    assert refused.session_id == "c" and refused.code == "server_full"
    assert "a 32x32 session needs 4.00 KiB of device memory; 1.00 KiB of the 9.00 KiB" in refused.message
    control.unregister("a")  # a session ends: its memory frees
    control.handle(StartSession(session_id="c", prompt="p"))
    assert sent[-1].session_id == "c" and not hasattr(sent[-1], "code")
    control.handle(StartSession(session_id="huge", prompt="p", width=64, height=64))  # 16 KiB: never fits
    assert sent[-1].code == "invalid_request" and sent[-1].message.startswith("too large: a 64x64 session needs")


def test_without_a_memory_budget_state_bytes_do_not_limit():
    sent: list = []
    control = ControlPlane(EngineConfig(max_sessions=8), StubPipeline().describe, sent.append)
    for sid in "abcdefgh":
        control.handle(StartSession(session_id=sid, prompt="p", width=512, height=512))
    assert len(control.open_sessions()) == 8
