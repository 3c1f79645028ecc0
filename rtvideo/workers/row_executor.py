"""Pipeline calls for session rows: timed, guarded per session, abandonable.

Worker process, the executor's thread (and the decode stage's threads, for
``run_batch``). Every pipeline call a runner makes for a session's row goes
through one ``RowExecutor`` (``rtvideo.workers.runner_sessions.RunnerSessions``
holds it, and both runners hold that: ``rtvideo.workers.runner.ModelRunner`` and the
ring runner, ``rtvideo.workers.parallel.ring.RingRunner``), which answers with a
typed outcome:

- ``Ok(value, ms)``: the call returned;
- ``Failed(error, ms)``: it raised. Through ``call`` that fails the session
  (its row's error is set and the runner is told, ``on_failure``, which
  releases its state or keeps it for the decodes still pending); through
  ``call_batch`` / ``run_batch`` it fails nothing: the caller runs each row
  alone to find the one that fails on its own;
- ``Cancelled(ms)``: it was abandoned at an ``abandon_point`` because every
  session it carries is stopping (``is_stopping``); its rows are reported
  cancelled, never failed.

Each call is timed (the ``synchronize`` hook waits for the device around it
in benchmarks), added to the micro-step's pipeline time, and reported to the
stage observer; a call that failed a session is logged in one line (the
traceback only at debug).
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from time import perf_counter
from typing import Any, Generic, NamedTuple, TypeVar

from rtvideo.engine.plan import RowResult, StepResult
from rtvideo.workers.pipelines.base import Abandoned, abandon_when

log = logging.getLogger("rtvideo.workers.runner")
T = TypeVar("T")


@dataclass(frozen=True)
class Ok(Generic[T]):
    value: T
    ms: float


@dataclass(frozen=True)
class Failed:
    error: BaseException
    ms: float


@dataclass(frozen=True)
class Cancelled:
    ms: float


Outcome = Ok | Failed | Cancelled


class StageCall(NamedTuple):
    """One pipeline call, as ``ModelRunner(on_stage=...)`` reports it."""

    session_id: str
    stage: str  # encode_prompt, open, boundary, forward, sampler_step, commit, decode
    ms: float  # a batched forward: the whole forward, reported for each of its rows
    error: BaseException | None


class RowExecutor:
    def __init__(
        self,
        on_failure: Callable[[str], str | None],
        *,
        synchronize: Callable[[str], None] | None = None,
        on_stage: Callable[[StageCall], None] | None = None,
        batch_invariant: Callable[[], bool] = lambda: False,
    ) -> None:
        """``on_failure(session_id)``: a call failed the session (the runner frees
        or keeps its state); returns what else went wrong doing so, or None.
        ``synchronize`` (benchmarks) is called with a stage's name before its
        clock starts and before it stops; ``on_stage`` hears of every call;
        ``batch_invariant``: whether a batched forward computes each row as
        alone (``note_batch``)."""
        self._on_failure = on_failure
        self._synchronize = synchronize
        self._on_stage = on_stage
        self._batch_invariant = batch_invariant
        self.is_stopping: Callable[[str], bool] | None = None
        """Whether a session is stopping (the control plane's, read lock-free from
        the executor and decode threads); None: never abandon."""

    def call(
        self,
        result: StepResult,
        session_id: str,
        chunk_index: int,
        stage: str,
        function: Callable,
        *args: Any,
        stoppable: bool = False,
    ) -> Outcome:
        """One pipeline call for one session (about chunk ``chunk_index``, where its
        result is reported). ``Failed``: the session failed (row error set,
        ``on_failure`` told): a pipeline bug never takes the worker down.
        ``stoppable``: abandoned at its next ``abandon_point`` once the session
        is stopping: ``Cancelled``, the row reported cancelled."""
        self.sync(stage)
        started = perf_counter()
        value, failure, cancelled = None, None, False
        try:
            with abandon_when(self.stop_check((session_id,)) if stoppable else None):
                value = function(*args)
        except Abandoned:
            result.row(session_id, chunk_index).cancelled = True
            cancelled = True
        except Exception as error:
            failure = error
            self._fail_row(result, session_id, chunk_index, stage, error)
        self.sync(stage)
        ms = (perf_counter() - started) * 1000.0
        result.pipeline_s += ms / 1000.0
        self.report(session_id, stage, ms, failure)
        if failure is not None:
            return Failed(failure, ms)
        return Cancelled(ms) if cancelled else Ok(value, ms)

    def fail(self, result: StepResult, session_id: str, chunk_index: int, stage: str, error: BaseException) -> Failed:
        """Fail the session as a call of ``stage`` that raised ``error`` would have
        (row error set, ``on_failure`` told, reported), where the call failed
        elsewhere: on another pipeline rank (``rtvideo.workers.parallel.ring``)."""
        self._fail_row(result, session_id, chunk_index, stage, error)
        self.report(session_id, stage, 0.0, error)
        return Failed(error, 0.0)

    def _fail_row(self, result: StepResult, session_id: str, index: int, stage: str, error: BaseException) -> None:
        row = result.row(session_id, index)
        row.error = f"{stage} failed: {type(error).__name__}: {error}"
        also = self._on_failure(session_id)
        if also is not None:
            row.error += f" ({also})"

    def call_batch(
        self, result: StepResult, keys: list[tuple[str, int]], stage: str, function: Callable, *args: Any
    ) -> Outcome:
        """``run_batch`` within a micro-step: its time goes to the micro-step's
        pipeline time, and an abandoned call's rows are reported cancelled."""
        outcome = self.run_batch(keys, stage, function, *args)
        result.pipeline_s += outcome.ms / 1000.0
        if isinstance(outcome, Cancelled):
            for sid, index in keys:
                result.row(sid, index).cancelled = True
        return outcome

    def run_batch(self, keys: list[tuple[str, int]], stage: str, function: Callable, *args: Any) -> Outcome:
        """One pipeline call for several rows (``keys``: session, chunk index),
        timed and, when it ran, reported for each row. ``Cancelled`` once every
        row's session is stopping; ``Failed`` when it raised, and nothing is
        failed here: the caller runs each row alone to find which one fails."""
        self.sync(stage)
        started = perf_counter()
        try:
            with abandon_when(self.stop_check(sid for sid, _ in keys)):
                value = function(*args)
        except Abandoned:
            return Cancelled((perf_counter() - started) * 1000.0)
        except Exception as error:
            log.warning("a batched %s of %d rows failed; running each alone", stage, len(keys), exc_info=True)
            return Failed(error, (perf_counter() - started) * 1000.0)
        self.sync(stage)
        ms = (perf_counter() - started) * 1000.0
        for sid, _ in keys:
            self.report(sid, stage, ms, None)
        return Ok(value, ms)

    def note_batch(self, out: RowResult, rows: int) -> None:
        """A forward of ``rows`` rows ran a step of ``out``'s chunk: its values are
        those of a forward alone unless it had other rows and the pipeline's
        batched forward is not batch-invariant."""
        out.batch_rows = max(out.batch_rows, rows)
        if rows > 1 and not self._batch_invariant():
            out.batch_exact = False

    def stop_check(self, session_ids: Iterable[str]) -> Callable[[], bool] | None:
        """A check that is true once every one of ``session_ids`` is stopping
        (None without ``is_stopping``): a call over them may then be abandoned."""
        is_stopping = self.is_stopping
        if is_stopping is None:
            return None
        ids = tuple(dict.fromkeys(session_ids))
        return lambda: all(is_stopping(sid) for sid in ids)

    def sync(self, stage: str) -> None:
        if self._synchronize is not None:
            self._synchronize(stage)

    def report(self, session_id: str, stage: str, ms: float, error: BaseException | None) -> None:
        """A pipeline call's outcome, to the stage observer; one that failed is logged too."""
        if error is not None:
            _log_failure(stage, session_id, error)
        if self._on_stage is not None:
            self._on_stage(StageCall(session_id, stage, ms, error))


def _log_failure(stage: str, session_id: str, error: BaseException) -> None:
    """One warning line for a pipeline call that failed a session: the stage,
    the session, the exception and where it was raised (the innermost frame),
    which the error the client gets does not say. The whole traceback follows
    it only where the worker logs at debug (``EngineConfig.log_level``): a
    failing model call is the model's to fix, and one per chunk would fill
    the log."""
    frames = traceback.extract_tb(error.__traceback__)
    where = f" at {frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}" if frames else ""
    detail = error if log.isEnabledFor(logging.DEBUG) else None
    log.warning(
        "%s of session %s failed%s: %s: %s", stage, session_id, where, type(error).__name__, error, exc_info=detail
    )
