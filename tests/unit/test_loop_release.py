"""A session's state is freed only once nothing of it runs: the engine loop plans
its release only after every micro-step that carries it came back (an
executor holds two: the one still running may be committing a chunk whose
decode the loop has not heard of yet) and every decode of it did. In process:
the loop, the control plane, the real runner over the stub, and an executor
whose micro-steps finish when the test says (``tests.unit.fakes.HeldExecutor``)."""

from __future__ import annotations

from rtvideo.engine.config import EngineConfig
from rtvideo.engine.control import ControlPlane
from rtvideo.engine.loop import EngineLoop
from rtvideo.engine.messages import SessionDone, StartSession, StopSession
from rtvideo.workers.pipelines.stub import StubPipeline
from rtvideo.workers.runner import ModelRunner
from tests.unit.fakes import HeldExecutor


def test_a_stopped_session_is_released_only_after_its_micro_steps_in_flight_came_back():
    sent: list = []
    config = EngineConfig()
    runner = ModelRunner(StubPipeline())
    control = ControlPlane(config, runner.describe, sent.append)
    executor = HeldExecutor(runner, depth=2)  # two micro-steps in flight, like the threaded executor
    loop = EngineLoop(config, control, executor, sent.append, grouping=True, max_rows=1)

    def turn() -> None:  # one loop iteration, without its wait
        seen, playheads = control.pacing_state()
        loop.collect()
        loop.drain_control()
        loop.submit(playheads)

    control.handle(StartSession(session_id="s", prompt="p", num_chunks=8, num_inference_steps=4))
    turn()
    assert len(executor.waiting) == 2  # planned ahead: two micro-steps of session s in flight
    executor.finish_oldest()
    control.handle(StopSession(session_id="s"))
    turn()  # one of s's micro-steps is still in flight: its release must wait for it
    assert not any("s" in step.release for step in executor.submitted)
    executor.finish_oldest()
    turn()
    assert [step.release for step in executor.waiting] == [["s"]]
    executor.finish_oldest()
    turn()
    done = [m for m in sent if isinstance(m, SessionDone)]
    assert len(done) == 1 and done[0].stopped
    assert runner.held_sessions() == ((), ())
