"""The model runner: executes one ``MicroStep`` over a ``ChunkPipeline``.

Runs on the executor's thread of worker rank 0 (``workers.executor``). Owns
one ``PipelineState`` per open session (never shared, never global) and
implements ``engine.plan.Runner``. Every pipeline call goes through ``_call``:
timed, and guarded per session, so an exception fails that session only,
releases it at once, and the other rows go on. When a batched forward raises,
each of its rows is rerun alone, so only the row that fails on its own loses
its session.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from time import perf_counter
from typing import Any

from engine.messages import SessionGeometry, StartSession
from engine.plan import BoundaryTask, MicroStep, StepResult, StepRow
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

    def execute(self, step: MicroStep) -> StepResult:
        """Release, open, cross boundaries, then one forward over the rows of ``step``
        (in groups of the pipeline's ``max_batch_rows``), each row's sampler update,
        and commit + decode for rows whose chunk ended."""
        result = StepResult(step.number)
        for session_id in step.release:
            try:
                self._release(session_id)
            except Exception:  # the session is over either way; its state is already dropped
                log.exception("release of session %s failed", session_id)
            result.released.append(session_id)
        for start in step.open:
            _, ms = self._call(result, start.session_id, "prepare_encode", self._open, start)
            result.row(start.session_id).boundary_ms += ms
        for task in step.boundaries:
            if task.session_id in self.states:  # not failed earlier in this micro-step
                _, ms = self._call(result, task.session_id, "chunk boundary", self._boundary, task)
                result.row(task.session_id).boundary_ms += ms
        rows = [row for row in step.rows if row.session_id in self.states]
        width = self.pipeline.max_batch_rows
        for first in range(0, len(rows), width):
            self._forward(rows[first : first + width], result)
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

    def _forward(self, rows: list[StepRow], result: StepResult) -> None:
        """One forward over ``rows``, then each row's sampler update (and
        ``post_decode`` for a row whose chunk just ended)."""
        states = [self.states[row.session_id] for row in rows]
        for row, state in zip(rows, states, strict=True):
            if (state.chunk_index, state.step_in_chunk) != (row.chunk_index, row.step):
                raise RuntimeError(
                    f"session {row.session_id} is at chunk {state.chunk_index} step {state.step_in_chunk}, "
                    f"but the plan says chunk {row.chunk_index} step {row.step}"
                )
        batch = StepBatch(tuple(BatchRow(s.session_id, s.chunk_index, s.step_in_chunk) for s in states))
        if len(states) == 1:
            predictions, forward_ms = self._call(
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
                for row in rows:
                    self._forward([row], result)
                return
            forward_ms = (perf_counter() - started) * 1000.0
            result.pipeline_s += forward_ms / 1000.0
        share = forward_ms / len(states)
        for row, state, prediction in zip(rows, states, predictions, strict=True):
            sid = row.session_id
            updated, update_ms = self._call(result, sid, "step_scheduler", self._update, state, prediction)
            if updated is _FAILED:
                continue
            out = result.row(sid)
            out.denoise_ms += share + update_ms
            out.stepped = True
            if not row.last:
                continue
            chunk, decode_ms = self._call(result, sid, "post_decode", self.pipeline.post_decode, state)
            if chunk is not _FAILED:
                out.chunk = chunk
                out.decode_ms += decode_ms

    def _update(self, state: PipelineState, prediction: Any) -> None:
        before = state.step_in_chunk
        self.pipeline.step_scheduler(state, prediction)
        if state.step_in_chunk != before + 1:
            raise RuntimeError("step_scheduler did not advance step_in_chunk by one")

    def _call(
        self, result: StepResult, session_id: str, stage: str, function: Callable, *args: Any
    ) -> tuple[Any, float]:
        """Run one pipeline call for one session; returns (its value, ms), and adds
        the time to the micro-step's pipeline time. On an exception the session
        fails and is released, and the value is ``_FAILED``: a pipeline bug never
        takes the worker down."""
        started = perf_counter()
        try:
            value = function(*args)
        except Exception as error:
            row = result.row(session_id)
            row.error = f"{stage} failed: {type(error).__name__}: {error}"
            try:
                self._release(session_id)
            except Exception as release_error:
                row.error += f" (release also failed: {type(release_error).__name__}: {release_error})"
            value = _FAILED
        ms = (perf_counter() - started) * 1000.0
        result.pipeline_s += ms / 1000.0
        return value, ms

    def _release(self, session_id: str) -> None:
        state = self.states.pop(session_id, None)
        if state is not None:
            self.pipeline.release(state)
