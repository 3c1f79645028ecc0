"""The row executor (``rtvideo.workers.row_executor``): each pipeline call's outcome is
typed (``Ok``, ``Failed``, ``Cancelled``); a failed call fails its session and
says what else went wrong releasing it; a batch that fails fails nothing (its
rows run alone next); a call over stopping sessions is abandoned and its rows
reported cancelled; a row a later pipeline rank failed fails its session as
a call would. And the ring runner is no subclass of the runner (one of its
methods overridden with another signature crashed once): both hold the
sessions' component and define every method of ``WorkerRunner``, with its
signature."""

from __future__ import annotations

import inspect
from typing import Protocol

from rtvideo.engine.plan import StepResult
from rtvideo.workers.pipelines.base import abandon_point
from rtvideo.workers.pipelines.stub import StubPipeline
from rtvideo.workers.row_executor import Cancelled, Failed, Ok, RowExecutor, StageCall


def protocol_methods(protocol: type) -> dict[str, object]:
    """The public methods ``protocol`` and the protocols it extends define."""
    return {
        name: value
        for klass in reversed(protocol.__mro__[: protocol.__mro__.index(Protocol)])
        for name, value in vars(klass).items()
        if inspect.isfunction(value) and not name.startswith("_")
    }


def executor(failures: list[str], also: str | None = None, heard: list | None = None) -> RowExecutor:
    def on_failure(session_id: str) -> str | None:
        failures.append(session_id)
        return also

    return RowExecutor(on_failure, on_stage=None if heard is None else heard.append)


def boom() -> None:
    raise RuntimeError("boom")


def test_a_call_returns_its_value_or_fails_its_session_naming_the_stage():
    failures, heard = [], []
    rows = executor(failures, also="release also failed: OSError: gone", heard=heard)
    result = StepResult(1)
    done = rows.call(result, "a", 0, "boundary", lambda x: x + 1, 41)
    assert isinstance(done, Ok) and done.value == 42 and done.ms >= 0
    failed = rows.call(result, "b", 3, "forward", boom)
    assert isinstance(failed, Failed) and str(failed.error) == "boom"
    assert failures == ["b"]
    assert result.row("b", 3).error == "forward failed: RuntimeError: boom (release also failed: OSError: gone)"
    assert result.row("a", 0).error is None
    reported = [(c.session_id, c.stage, c.error is None) for c in heard]
    assert reported == [("a", "boundary", True), ("b", "forward", False)]
    assert all(isinstance(c, StageCall) for c in heard)


def test_a_batch_that_fails_fails_no_session_and_one_over_stopping_sessions_is_cancelled():
    failures = []
    rows = executor(failures)
    result = StepResult(1)
    keys = [("a", 0), ("b", 0)]
    assert isinstance(rows.call_batch(result, keys, "forward", boom), Failed)
    assert failures == [] and result.row("a", 0).error is None  # each row runs alone next, to find the culprit

    stopping = {"a"}
    rows.is_stopping = stopping.__contains__
    assert isinstance(rows.call_batch(result, keys, "forward", abandon_point), Ok)  # b still wanted: it runs on
    stopping.add("b")
    cancelled = rows.call_batch(result, keys, "forward", abandon_point)
    assert isinstance(cancelled, Cancelled)
    assert result.row("a", 0).cancelled and result.row("b", 0).cancelled
    alone = rows.call(result, "a", 1, "decode", abandon_point, stoppable=True)
    assert isinstance(alone, Cancelled) and result.row("a", 1).cancelled and failures == []
    assert isinstance(rows.call(result, "a", 2, "boundary", abandon_point), Ok)  # not stoppable: it runs


def test_a_failure_elsewhere_fails_the_session_as_a_call_would():
    failures, heard = [], []
    rows = executor(failures, also="release also failed: OSError: gone", heard=heard)
    result = StepResult(1)
    failed = rows.fail(result, "a", 2, "forward", RuntimeError("rank 1: forward failed: boom"))
    assert isinstance(failed, Failed) and failures == ["a"]
    assert result.row("a", 2).error == (
        "forward failed: RuntimeError: rank 1: forward failed: boom (release also failed: OSError: gone)"
    )
    assert [(c.session_id, c.stage, str(c.error)) for c in heard] == [("a", "forward", "rank 1: forward failed: boom")]


def test_both_runners_hold_the_sessions_and_offer_the_same_methods():
    """The ring runner is no subclass of the one-rank runner (a method of one
    overridden with another signature crashed once): both hold a
    ``RunnerSessions``, which the executor and the decode stages take
    (``runner.sessions``), and every method of what the executor drives
    (``WorkerRunner``: ``rtvideo.engine.plan.Runner``'s and ``rank_figures``) is
    defined on both, with the protocol's signature. Neither hands
    session-level calls on: there is one way to reach them."""
    from rtvideo.workers.parallel.ring import RingRunner
    from rtvideo.workers.runner import ModelRunner, WorkerRunner
    from rtvideo.workers.runner_sessions import RunnerSessions

    assert not issubclass(RingRunner, ModelRunner) and not issubclass(ModelRunner, RingRunner)
    methods = protocol_methods(WorkerRunner)
    assert {"describe", "held_sessions", "execute", "rank_figures"} <= set(methods)
    for name, template in methods.items():
        for runner in (RingRunner, ModelRunner):
            assert inspect.signature(getattr(runner, name)) == inspect.signature(template), (runner.__name__, name)
    assert ModelRunner(StubPipeline()).rank_figures() == ()  # one rank
    session_level = ["defer_decode", "is_stopping", "stop_check", "decode", "decode_many"]
    session_level += ["hand_off_decode", "decode_returned"]
    pipeline = StubPipeline()
    one, ring = ModelRunner(pipeline), RingRunner(pipeline, group=None)
    for runner in (one, ring):
        assert isinstance(runner.sessions, RunnerSessions) and runner.rows is runner.sessions.rows
        assert runner.states is runner.sessions.states
        assert not [name for name in session_level if hasattr(runner, name)], type(runner).__name__
