"""The model runner: executes one ``StepPlan`` per invocation over a ``ChunkPipeline``.

Runs on the loop thread of worker rank 0. Owns one ``PipelineState`` per open
session (never shared, never global) and implements ``engine.plan.Runner``.
Every pipeline call goes through ``_call``: timed, and guarded per session, so
an exception fails that session only, releases it at once, and the other rows
go on. When a batched forward raises, each of its rows is rerun alone, so only
the row that fails on its own loses its session.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from time import perf_counter
from typing import Any

from engine.messages import SessionGeometry, StartSession
from engine.plan import BoundaryTask, PlanResult, PlanRow, StepPlan
from workers.pipelines.base import BatchRow, ChunkPipeline, PipelineState, StepBatch

log = logging.getLogger(__name__)
_FAILED = object()  # what _call returns when the pipeline raised


class ModelRunner:
    def __init__(self, pipeline: ChunkPipeline) -> None:
        self.pipeline = pipeline
        self.states: dict[str, PipelineState] = {}

    # -- engine.plan.Runner --------------------------------------------------

    def describe(self, start: StartSession) -> SessionGeometry:
        return self.pipeline.describe(start)

    def held_sessions(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        return tuple(self.states), self.pipeline.held_sessions()

    def execute(self, plan: StepPlan, is_cancelled: Callable[[str], bool]) -> PlanResult:
        """Release, open, cross boundaries, then run the denoise rows of ``plan``."""
        result = PlanResult()
        for session_id in plan.release:
            try:
                self._release(session_id)
            except Exception:  # the session is over either way; its state is already dropped
                log.exception("release of session %s failed", session_id)
        for start in plan.open:
            self._call(result, start.session_id, "prepare_encode", self._open, start)
            result.row(start.session_id).boundary_ms += self._last_ms
        for task in plan.boundaries:
            if task.session_id in self.states:  # not failed earlier in this plan
                self._call(result, task.session_id, "chunk boundary", self._boundary, task)
                result.row(task.session_id).boundary_ms += self._last_ms
        self._run_rows(plan, result, is_cancelled)
        return result

    # -- internals -------------------------------------------------------------

    def _open(self, start: StartSession) -> None:
        state = PipelineState(start.session_id, start, self.pipeline.describe(start))
        self.states[start.session_id] = state
        self.pipeline.prepare_encode(state)

    def _boundary(self, task: BoundaryTask) -> None:
        state = self.states[task.session_id]
        state.chunk_index = task.chunk_index
        if task.prompt is not None:
            self.pipeline.apply_interaction_at_chunk_boundary(state, task.prompt, task.transition_chunks)
        self.pipeline.prepare_next_chunk(state)

    def _run_rows(self, plan: StepPlan, result: PlanResult, is_cancelled: Callable[[str], bool]) -> None:
        """Step the rows in lockstep: one batched forward per step, until each row
        ran the steps it was granted or reached the end of its chunk. A row whose
        session was stopped leaves between two steps."""
        left = {row.session_id: row.num_steps for row in plan.rows if row.session_id in self.states}
        rows = {row.session_id: row for row in plan.rows}
        width = self.pipeline.max_batch_rows
        while True:
            live: list[PlanRow] = []
            for session_id, steps in left.items():
                if steps <= 0 or session_id not in self.states:
                    continue
                if is_cancelled(session_id):
                    result.row(session_id).cancelled = True
                    left[session_id] = 0
                    continue
                live.append(rows[session_id])
            if not live:
                return
            for first in range(0, len(live), width):
                self._step(live[first : first + width], plan.invocation, result, left)

    def _step(self, batch_rows: list[PlanRow], invocation: int, result: PlanResult, left: dict[str, int]) -> None:
        """One forward over ``batch_rows``, then each row's sampler update (and
        ``post_decode`` for a row whose chunk just ended)."""
        states = [self.states[row.session_id] for row in batch_rows]
        batch = StepBatch(tuple(BatchRow(s.session_id, s.chunk_index, s.step_in_chunk) for s in states))
        if len(states) == 1:
            predictions = self._call(
                result, states[0].session_id, "denoise_step", self.pipeline.denoise_step, batch, states
            )
            if predictions is _FAILED:
                return
        else:
            started = perf_counter()
            try:
                predictions = self.pipeline.denoise_step(batch, states)
            except Exception:
                # Find the culprit: rerun each row alone (denoise_step leaves state
                # untouched), so one bad row fails only its own session.
                result.pipeline_s += perf_counter() - started
                for row in batch_rows:
                    self._step([row], invocation, result, left)
                return
            self._last_ms = (perf_counter() - started) * 1000.0
            result.pipeline_s += self._last_ms / 1000.0
        share = self._last_ms / len(states)
        for row, state, prediction in zip(batch_rows, states, predictions, strict=True):
            sid = row.session_id
            before = state.step_in_chunk
            if self._call(result, sid, "step_scheduler", self._update, state, prediction) is _FAILED:
                continue
            out = result.row(sid)
            out.denoise_ms += share + self._last_ms
            out.steps_run += 1
            out.step_calls.append(invocation)
            left[sid] -= 1
            if before + 1 < row.steps_per_chunk:
                continue
            left[sid] = 0  # never past the end of the chunk
            chunk = self._call(result, sid, "post_decode", self.pipeline.post_decode, state)
            if chunk is not _FAILED:
                out.chunk = chunk
                out.decode_ms += self._last_ms

    def _update(self, state: PipelineState, prediction: Any) -> None:
        before = state.step_in_chunk
        self.pipeline.step_scheduler(state, prediction)
        if state.step_in_chunk != before + 1:
            raise RuntimeError("step_scheduler did not advance step_in_chunk by one")

    def _call(self, result: PlanResult, session_id: str, stage: str, function: Callable, *args: Any) -> Any:
        """Run one pipeline call for one session: time it (``self._last_ms``, and
        the plan's pipeline time); on an exception, fail and release the session
        and return ``_FAILED``. A pipeline bug never takes the worker down."""
        started = perf_counter()
        try:
            return function(*args)
        except Exception as error:
            row = result.row(session_id)
            row.error = f"{stage} failed: {type(error).__name__}: {error}"
            try:
                self._release(session_id)
            except Exception as release_error:
                row.error += f" (release also failed: {type(release_error).__name__}: {release_error})"
            return _FAILED
        finally:
            self._last_ms = (perf_counter() - started) * 1000.0
            result.pipeline_s += self._last_ms / 1000.0

    def _release(self, session_id: str) -> None:
        state = self.states.pop(session_id, None)
        if state is not None:
            self.pipeline.release(state)

    _last_ms: float = 0.0  # duration of the latest pipeline call
