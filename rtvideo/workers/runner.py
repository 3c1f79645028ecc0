"""The model runner: executes one ``MicroStep`` over a ``ChunkPipeline``.

Runs on the executor's thread of worker rank 0 (``rtvideo.workers.executor``); one
rank, so it runs every stage (``rtvideo.workers.pipelines.base``) itself. Implements
``rtvideo.engine.plan.Runner``, and ``WorkerRunner``, what the executor drives
(``rtvideo.workers.executor``): that and ``sessions`` and ``rank_figures``, the ring
runner's figures of each rank (() here: one rank). It holds a ``RunnerSessions``
(``rtvideo.workers.runner_sessions``): the state of each open session and the
``RowExecutor`` (``rtvideo.workers.row_executor``) every pipeline call goes through,
timed and guarded per session, so an exception fails that session only,
releases it at once, and the other rows go on; its outcome is typed (``Ok``,
``Failed``, ``Cancelled``). The ring runner over pipeline ranks
(``rtvideo.workers.parallel.ring.RingRunner``) holds one too; the decode stage and
the executor take it (``runner.sessions``) and call it directly. Which
chunk and step a call is about comes from the plan's rows; the pipeline
refuses a row its session's state cannot take (a chunk never
prepared, a step out of order), which fails that session. When a batched
forward raises, each of its rows is rerun alone, so only the row that fails
on its own loses its session.

A stop is honoured mid-call: with ``RunnerSessions.is_stopping`` set (the
executor sets it to the control plane's), each forward, commit and decode
runs inside ``abandon_when`` (``rtvideo.workers.pipelines.base``), so one whose rows' sessions
are ALL stopping ends at the pipeline's next ``abandon_point`` (between
blocks, between latent frames). Its rows are reported ``cancelled``, never
failed, and nothing is released here: the engine releases the session in a
micro-step of its own. A batched forward with one row still wanted runs on,
so no other session's work is wasted. A decode not begun when its session is
stopping is not run (a decode abandoned part-way leaves the decoder cache
unusable, and the session is being released anyway).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from rtvideo.engine.messages import RankFigures, SessionGeometry, StartSession
from rtvideo.engine.plan import MicroStep, Runner, StepResult, StepRow
from rtvideo.workers.pipelines.base import ChunkPipeline
from rtvideo.workers.row_executor import Cancelled, Ok, StageCall
from rtvideo.workers.runner_sessions import RunnerSessions

__all__ = ["ModelRunner", "StageCall", "WorkerRunner"]


class WorkerRunner(Runner, Protocol):
    """What the executor (``rtvideo.workers.executor.LocalExecutor``) drives: the one-rank
    ``ModelRunner`` or, split over pipeline ranks, rank 0's
    ``rtvideo.workers.parallel.ring.RingRunner``. Neither subclasses the other; each
    has every member here, with these signatures
    (``tests/unit/test_row_executor.py``)."""

    sessions: RunnerSessions
    """The sessions' state and calls, which the executor and the decode stages take."""

    def rank_figures(self) -> tuple[RankFigures, ...]:
        """Split over ranks: each rank's busy and wall seconds, rank 0 first
        (``decoded_chunks`` 0: the executor adds the decode stage's counts);
        () with one rank."""
        ...


class ModelRunner:
    def __init__(
        self,
        pipeline: ChunkPipeline,
        *,
        synchronize: Callable[[str], None] | None = None,
        on_stage: Callable[[StageCall], None] | None = None,
    ) -> None:
        """``synchronize`` (benchmarks) is called with a stage's name before its
        clock starts and before it stops: waiting for the device there makes that
        stage's time the device's; ``on_stage`` hears of every call. A worker
        serving sessions passes neither."""
        self.sessions = RunnerSessions(pipeline, synchronize=synchronize, on_stage=on_stage)
        self.pipeline = pipeline
        self.states = self.sessions.states  # session id -> the pipeline's state (RunnerSessions owns it)
        self.rows = self.sessions.rows

    # -- engine.plan.Runner --------------------------------------------------

    def describe(self, start: StartSession) -> SessionGeometry:
        return self.sessions.describe(start)

    def held_sessions(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        return self.sessions.held_sessions()

    def execute(self, step: MicroStep) -> StepResult:
        """Release, open (encode the prompt, allocate), cross boundaries (encode an
        interaction's prompt, take a chunk's input frames, then the boundary), then
        one forward over the rows of ``step`` (in groups of the pipeline's
        ``max_batch_rows``), each row's sampler step, and commit then decode for
        rows whose chunk ended; a chunk of no denoise step has a commit row only
        (``StepRow.commit``), which commits and decodes it without a forward."""
        result = StepResult(step.number)
        self.sessions.prepare(step, result)
        rows = self.sessions.running(step.rows)
        commits = [(row.session_id, row.chunk_index) for row in rows if row.commit]  # chunks of no denoise step
        rows = [row for row in rows if not row.commit]
        width = self.pipeline.max_batch_rows
        for first in range(0, len(rows), width):
            self._forward(rows[first : first + width], result)
        if commits:
            self.sessions.committed(result, self._commit(result, commits))
        if self.pipeline.capabilities.step_graphs:
            result.step_graphs = self.pipeline.graph_figures()
        return result

    # -- WorkerRunner ----------------------------------------------------------

    def rank_figures(self) -> tuple[RankFigures, ...]:
        """(): one rank (the loop reports its own figures)."""
        return ()

    # -- internals -------------------------------------------------------------

    def _forward(self, rows: list[StepRow], result: StepResult) -> None:
        """One forward over ``rows`` (every block: one rank; each row alone when the
        batch raises), then each row's sampler step, then the commit of the rows
        whose chunk just ended (``_commit``) and the decode of the chunks
        committed (``RunnerSessions.committed``)."""
        for ran in self.sessions.forwards(result, rows):
            share = ran.outcome.ms / len(ran.rows)
            denoised: list[tuple[str, int]] = []  # rows whose chunk this step finished denoising
            for row, batch_row, session, prediction in zip(
                ran.rows, ran.batch.rows, ran.sessions, ran.outcome.value, strict=True
            ):
                sid, index = row.session_id, row.chunk_index
                stepped = self.rows.call(
                    result, sid, index, "sampler_step", self.pipeline.sampler_step, session, batch_row, prediction
                )
                if not isinstance(stepped, Ok):
                    continue
                out = result.row(sid, index)
                out.denoise_ms += share + stepped.ms
                out.stepped = True
                self.rows.note_batch(out, len(ran.rows))
                if row.last:
                    denoised.append((sid, index))
            self.sessions.committed(result, self._commit(result, denoised))

    def _commit(self, result: StepResult, denoised: list[tuple[str, int]]) -> list[tuple[str, int]]:
        """Commit the chunks of ``denoised`` (session, chunk index): in one pass
        where the pipeline commits batches (its optional ``commit_batch``), else,
        or when that raises, each alone. Returns those committed."""
        batched = self.sessions.batched(result, denoised, "commit", "commit_batch")
        if isinstance(batched, Cancelled):
            return []
        if isinstance(batched, Ok):
            for sid, index in denoised:
                out = result.row(sid, index)
                out.decode_ms += batched.ms / len(denoised)
                out.committed = True
            return denoised
        committed = []  # none batched, or the batch failed and changed nothing: each commits alone
        for sid, index in denoised:
            outcome = self.rows.call(
                result, sid, index, "commit", self.pipeline.commit, self.states[sid], index, stoppable=True
            )
            if isinstance(outcome, Ok):
                out = result.row(sid, index)
                out.decode_ms += outcome.ms
                out.committed = True
                committed.append((sid, index))
        return committed
