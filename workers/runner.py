"""The model runner: executes one ``StepPlan`` per invocation over a ``ChunkPipeline``.

Runs on the loop thread of worker rank 0. Owns one ``PipelineState`` per open
session (never shared, never global) and implements ``engine.plan.Runner``.
Every pipeline call is timed, and guarded per session: an exception fails
that session only, releases it at once, and the other rows go on. When a
batched forward raises, each of its rows is rerun alone, so only the row that
fails on its own loses its session.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from engine.messages import SessionGeometry, StartSession
from engine.plan import PlanResult, PlanRow, StepPlan
from workers.pipelines.base import BatchRow, ChunkPipeline, PipelineState, StepBatch


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
            self._release(session_id)
        for start in plan.open:
            self._open(start, result)
        for task in plan.boundaries:
            state = self.states.get(task.session_id)
            if state is None:
                continue  # failed earlier in this plan
            with self._guard(result, task.session_id, "chunk boundary") as timer:
                state.chunk_index = task.chunk_index
                if task.prompt is not None:
                    self.pipeline.apply_interaction_at_chunk_boundary(state, task.prompt, task.transition_chunks)
                self.pipeline.prepare_next_chunk(state)
            result.row(task.session_id).boundary_ms += timer.ms
        self._run_rows(plan, result, is_cancelled)
        return result

    # -- internals -------------------------------------------------------------

    def _open(self, start: StartSession, result: PlanResult) -> None:
        with self._guard(result, start.session_id, "prepare_encode") as timer:
            state = PipelineState(start.session_id, start, self.pipeline.describe(start))
            self.states[start.session_id] = state
            self.pipeline.prepare_encode(state)
        result.row(start.session_id).boundary_ms += timer.ms

    def _run_rows(self, plan: StepPlan, result: PlanResult, is_cancelled: Callable[[str], bool]) -> None:
        """Step the rows in lockstep: one batched forward per step, until each row
        ran the steps it was granted or reached the end of its chunk."""
        left = {row.session_id: row.num_steps for row in plan.rows if row.session_id in self.states}
        rows = {row.session_id: row for row in plan.rows}
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
            for start in range(0, len(live), self.pipeline.max_batch_rows):
                self._step(live[start : start + self.pipeline.max_batch_rows], plan.invocation, result, left)

    def _step(self, batch_rows: list[PlanRow], invocation: int, result: PlanResult, left: dict[str, int]) -> None:
        states = [self.states[row.session_id] for row in batch_rows]
        batch = StepBatch(tuple(BatchRow(s.session_id, s.chunk_index, s.step_in_chunk) for s in states))
        if len(batch_rows) > 1:
            try:
                with _timed(result) as forward:
                    predictions = self.pipeline.denoise_step(batch, states)
            except Exception:
                # Find the culprit: rerun each row alone (denoise_step has no side
                # effects on state), so one bad row fails only its own session.
                for row in batch_rows:
                    self._step([row], invocation, result, left)
                return
        else:
            with self._guard(result, batch_rows[0].session_id, "denoise_step") as forward:
                predictions = self.pipeline.denoise_step(batch, states)
            if forward.failed:
                return
        share = forward.ms / len(states)
        for row, state, prediction in zip(batch_rows, states, predictions, strict=True):
            sid = row.session_id
            out = result.row(sid)
            with self._guard(result, sid, "step_scheduler") as update:
                before = state.step_in_chunk
                self.pipeline.step_scheduler(state, prediction)
                if state.step_in_chunk != before + 1:
                    raise RuntimeError("step_scheduler did not advance step_in_chunk by one")
            if update.failed:
                continue
            out.denoise_ms += share + update.ms
            out.steps_run += 1
            out.step_calls.append(invocation)
            left[sid] -= 1
            if state.step_in_chunk < row.steps_per_chunk:
                continue
            left[sid] = 0  # never past the end of the chunk
            with self._guard(result, sid, "post_decode") as decode:
                out.chunk = self.pipeline.post_decode(state)
            out.decode_ms += decode.ms

    def _release(self, session_id: str) -> None:
        state = self.states.pop(session_id, None)
        if state is not None:
            self.pipeline.release(state)

    @contextmanager
    def _guard(self, result: PlanResult, session_id: str, stage: str) -> Iterator[_Timer]:
        """Time a pipeline call; on an exception, fail and release the session."""
        with _timed(result) as timer:
            try:
                yield timer
            except Exception as error:  # a pipeline bug must not take the worker down
                timer.failed = True
                row = result.row(session_id)
                row.error = f"{stage} failed: {type(error).__name__}: {error}"
                try:
                    self._release(session_id)
                except Exception as release_error:
                    row.error += f" (release also failed: {release_error})"


@contextmanager
def _timed(result: PlanResult) -> Iterator[_Timer]:
    """Time a pipeline call and add it to the plan's pipeline time."""
    timer = _Timer()
    try:
        yield timer
    finally:
        timer.stop()
        result.pipeline_s += timer.ms / 1000.0


class _Timer:
    def __init__(self) -> None:
        self.failed = False
        self.ms = 0.0
        self._started = time.perf_counter()

    def stop(self) -> None:
        self.ms = (time.perf_counter() - self._started) * 1000.0
