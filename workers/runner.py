"""The model runner: executes one ``MicroStep`` over a ``ChunkPipeline``.

Runs on the executor's thread of worker rank 0 (``workers.executor``); one
rank, so it runs every stage (``workers.pipelines.base``) itself. Holds the
state of each open session (the pipeline's ``SessionState``, never shared,
never global) and implements ``engine.plan.Runner``. Which chunk and step a
call is about comes from the plan's rows; the pipeline refuses a row its
session's state cannot take (a chunk never prepared, a step out of order),
which fails that session. Every pipeline call goes through the runner's
``RowExecutor`` (``workers.row_executor``): timed, and guarded per session,
so an exception fails that session only, releases it at once, and the other
rows go on; its outcome is typed (``Ok``, ``Failed``, ``Cancelled``). When a
batched forward raises, each of its rows is rerun alone, so only the row
that fails on its own loses its session.

A stop is honoured mid-call: with ``is_stopping`` set (the executor sets it to
the control plane's), each forward, commit and decode runs inside
``abandon_when`` (``workers.pipelines.base``), so one whose rows' sessions
are ALL stopping ends at the pipeline's next ``abandon_point`` (between
blocks, between latent frames). Its rows are reported ``cancelled``, never
failed, and nothing is released here: the engine releases the session in a
micro-step of its own. A batched forward with one row still wanted runs on,
so no other session's work is wasted. A decode not begun when its session is
stopping is not run (a decode abandoned part-way leaves the decoder cache
unusable, and the session is being released anyway).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from time import perf_counter
from typing import Any

from engine.messages import SessionGeometry, StartSession
from engine.plan import BoundaryTask, DecodeResult, MicroStep, StepResult, StepRow
from workers.pipelines.base import Abandoned, BatchRow, ChunkPipeline, SessionState, StepBatch, abandon_when
from workers.row_executor import Cancelled, Failed, Ok, Outcome, RowExecutor, StageCall

__all__ = ["ModelRunner", "StageCall"]

log = logging.getLogger(__name__)


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
        self.pipeline = pipeline
        self.states: dict[str, SessionState] = {}
        self.rows = RowExecutor(
            self._session_failed,
            synchronize=synchronize,
            on_stage=on_stage,
            batch_invariant=lambda: getattr(pipeline, "batch_invariant", False),
        )
        self.defer_decode = False
        """True: a committed chunk is left for ``decode`` (the decode stage, on a
        thread of its own) and listed in ``StepResult.decodes``; False: it is
        decoded in the micro-step that committed it."""
        self._decodes_lock = threading.Lock()
        self._decodes_pending: dict[str, int] = {}  # deferred decodes not yet run, per session
        self._failed: set[str] = set()  # failed with decodes pending: kept for them, run no more

    @property
    def is_stopping(self) -> Callable[[str], bool] | None:
        """Whether a session is stopping (the control plane's ``is_stopping``, read
        lock-free from the executor and decode threads); None: never abandon."""
        return self.rows.is_stopping

    @is_stopping.setter
    def is_stopping(self, check: Callable[[str], bool] | None) -> None:
        self.rows.is_stopping = check

    def stop_check(self, session_ids: Iterable[str]) -> Callable[[], bool] | None:
        """A check that is true once every one of ``session_ids`` is stopping."""
        return self.rows.stop_check(session_ids)

    # -- engine.plan.Runner --------------------------------------------------

    def describe(self, start: StartSession) -> SessionGeometry:
        return self.pipeline.describe(start)

    def held_sessions(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        return tuple(self.states), self.pipeline.held_sessions()

    def execute(self, step: MicroStep) -> StepResult:
        """Release, open (encode the prompt, allocate), cross boundaries (encode an
        interaction's prompt, then the boundary), then one forward over the rows of
        ``step`` (in groups of the pipeline's ``max_batch_rows``), each row's sampler
        step, and commit then decode for rows whose chunk ended."""
        result = StepResult(step.number)
        self._prepare(step, result)
        rows = [row for row in step.rows if row.session_id in self.states and row.session_id not in self._failed]
        width = self.pipeline.max_batch_rows
        for first in range(0, len(rows), width):
            self._forward(rows[first : first + width], result)
        return result

    def _prepare(self, step: MicroStep, result: StepResult) -> None:
        """Release, open (encode the prompt, allocate), cross boundaries."""
        for session_id in step.release:
            try:
                self._release(session_id)
            except Exception:  # the session is over either way; its state is already dropped
                log.exception("release of session %s failed", session_id)
            result.released.append(session_id)
        for start in step.open:
            sid = start.session_id
            prompt = self.rows.call(result, sid, 0, "encode_prompt", self.pipeline.encode_prompt, start.prompt)
            result.row(sid, 0).boundary_ms += prompt.ms
            if isinstance(prompt, Ok):
                opened = self.rows.call(result, sid, 0, "open", self._open, start, prompt.value)
                result.row(sid, 0).boundary_ms += opened.ms
        for task in step.boundaries:
            self._boundary(task, result)

    def decode(self, session_id: str, chunk_index: int) -> DecodeResult:
        """Decode a chunk a micro-step committed and deferred (the decode stage's
        thread). The pipeline keeps the decoder's state per session and the
        chunk's clean latent in its record, which no later micro-step touches; a
        session is released only once its deferred decodes came back. An error
        is returned, not raised, and releases nothing: the engine releases the
        session in a micro-step of its own. A session that is stopping gets
        ``DecodeResult.cancelled`` (not run, or abandoned between frames)."""
        self.rows.sync("decode")
        started = perf_counter()
        chunk, failure, cancelled = None, None, False
        check = self.stop_check((session_id,))
        try:
            if check is not None and check():
                cancelled = True  # not begun: the session is stopping
            else:
                with abandon_when(check):
                    chunk = self.pipeline.decode(self.states[session_id], chunk_index)
        except Abandoned:
            cancelled = True
        except Exception as error:
            failure = error
        finally:
            self.decode_returned(session_id)
        self.rows.sync("decode")
        ms = (perf_counter() - started) * 1000.0
        if cancelled:
            return DecodeResult(session_id, chunk_index, None, ms, cancelled=True)
        self.rows.report(session_id, "decode", ms, failure)
        error = None if failure is None else f"decode failed: {type(failure).__name__}: {failure}"
        return DecodeResult(session_id, chunk_index, chunk, ms, error)

    def decode_many(self, keys: list[tuple[str, int]]) -> list[DecodeResult]:
        """``decode`` of one deferred chunk of each of several sessions (``keys``:
        session, chunk index; distinct sessions), in one decoder batch where the
        pipeline decodes batches (its optional ``decode_batch``), their results
        in the same order. A stopping session's chunk is not run (cancelled);
        a batch abandoned because every session became stopping is cancelled
        whole; when the batch raises, each chunk decodes alone (``decode``), so
        only a session whose decode fails on its own gets an error."""
        results: dict[tuple[str, int], DecodeResult] = {}
        wanted = []
        for sid, index in keys:
            check = self.stop_check((sid,))
            if check is not None and check():
                results[sid, index] = DecodeResult(sid, index, None, 0.0, cancelled=True)
                self.decode_returned(sid)
            else:
                wanted.append((sid, index))
        together = self._batched_decode(wanted) if len(wanted) > 1 else None
        if together is not None:
            results.update(zip(wanted, together, strict=True))
            wanted = []
        for sid, index in wanted:
            results[sid, index] = self.decode(sid, index)
        return [results[key] for key in keys]

    def _batched_decode(self, keys: list[tuple[str, int]]) -> list[DecodeResult] | None:
        """The chunks of ``keys`` through the pipeline's ``decode_batch``, no
        longer pending; None (still pending, nothing changed) where it has none
        or it raised."""
        decode_batch = getattr(self.pipeline, "decode_batch", None)
        if decode_batch is None:
            return None
        indices = [index for _, index in keys]
        outcome = self.rows.run_batch(
            keys, "decode", lambda: decode_batch([self.states[sid] for sid, _ in keys], indices)
        )
        if isinstance(outcome, Failed):
            return None
        for sid, _ in keys:
            self.decode_returned(sid)
        if isinstance(outcome, Cancelled):  # every session is stopping
            return [DecodeResult(sid, index, None, 0.0, cancelled=True) for sid, index in keys]
        share = outcome.ms / len(keys)
        return [DecodeResult(sid, index, chunk, share) for (sid, index), chunk in zip(keys, outcome.value, strict=True)]

    def hand_off_decode(self, session_id: str, chunk_index: int) -> Any:
        """For a decode another rank runs (``workers.parallel.rank_decode``): the
        chunk's input (``pipeline.decode_input``), or, when it will not run there,
        its ``DecodeResult`` (cancelled: the session is stopping; an error). The
        decode stays pending until ``decode_returned``; a ``DecodeResult``
        returned here is not pending any more."""
        check = self.stop_check((session_id,))
        result = None
        try:
            if check is not None and check():
                result = DecodeResult(session_id, chunk_index, None, 0.0, cancelled=True)
            else:
                return self.pipeline.decode_input(self.states[session_id], chunk_index)
        except Exception as error:
            self.rows.report(session_id, "decode", 0.0, error)
            result = DecodeResult(session_id, chunk_index, None, 0.0, f"decode failed: {type(error).__name__}: {error}")
        self.decode_returned(session_id)
        return result

    def decode_returned(self, session_id: str) -> None:
        """A deferred decode has come back, here or from another rank, or will not
        run: no longer pending."""
        with self._decodes_lock:
            self._decodes_pending[session_id] -= 1
            if not self._decodes_pending[session_id]:
                del self._decodes_pending[session_id]

    # -- internals -------------------------------------------------------------

    def _open(self, start: StartSession, prompt: Any) -> None:
        self.states[start.session_id] = self.pipeline.open(start, self.pipeline.describe(start), prompt)

    def _boundary(self, task: BoundaryTask, result: StepResult) -> None:
        sid, index = task.session_id, task.chunk_index
        if sid not in self.states or sid in self._failed:  # failed earlier
            return
        prompt = None
        if task.prompt is not None:
            encoded = self.rows.call(result, sid, index, "encode_prompt", self.pipeline.encode_prompt, task.prompt)
            result.row(sid, index).boundary_ms += encoded.ms
            if not isinstance(encoded, Ok):
                return
            prompt = encoded.value
        session = self.states[sid]
        crossed = self.rows.call(
            result, sid, index, "boundary", self.pipeline.boundary, session, index, prompt, task.transition_chunks
        )
        result.row(sid, index).boundary_ms += crossed.ms

    def _forward(self, rows: list[StepRow], result: StepResult) -> None:
        """One forward over ``rows`` (every block: one rank), then each row's sampler
        step, then the commit of the rows whose chunk just ended (``_commit``)
        and the decode of the chunks committed (``_committed``)."""
        sessions = [self.states[row.session_id] for row in rows]
        batch = StepBatch(tuple(BatchRow(row.session_id, row.chunk_index, row.step) for row in rows))
        if len(rows) == 1:
            sid, index = rows[0].session_id, rows[0].chunk_index
            outcome = self.rows.call(
                result, sid, index, "forward", self.pipeline.forward, batch, sessions, stoppable=True
            )
        else:
            keys = [(row.session_id, row.chunk_index) for row in rows]
            outcome = self.rows.call_batch(result, keys, "forward", self.pipeline.forward, batch, sessions)
            if isinstance(outcome, Failed):
                # Find the culprit: rerun each row alone (forward leaves state
                # untouched), so one bad row fails only its own session.
                for row in rows:
                    self._forward([row], result)
                return
        if not isinstance(outcome, Ok):
            return
        share = outcome.ms / len(rows)
        denoised: list[tuple[str, int]] = []  # rows whose chunk this step finished denoising
        for row, batch_row, session, prediction in zip(rows, batch.rows, sessions, outcome.value, strict=True):
            sid, index = row.session_id, row.chunk_index
            stepped = self.rows.call(
                result, sid, index, "sampler_step", self.pipeline.sampler_step, session, batch_row, prediction
            )
            if not isinstance(stepped, Ok):
                continue
            out = result.row(sid, index)
            out.denoise_ms += share + stepped.ms
            out.stepped = True
            self.rows.note_batch(out, len(rows))
            if row.last:
                denoised.append((sid, index))
        self._committed(result, self._commit(result, denoised))

    def _commit(self, result: StepResult, denoised: list[tuple[str, int]]) -> list[tuple[str, int]]:
        """Commit the chunks of ``denoised`` (session, chunk index): in one pass
        where the pipeline commits batches (its optional ``commit_batch``), else,
        or when that raises, each alone. Returns those committed."""
        batched = self._batched(result, denoised, "commit", "commit_batch")
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

    def _committed(self, result: StepResult, ended: list[tuple[str, int]]) -> None:
        """The chunks of ``ended`` (session, chunk index) are in every block's
        cache: decode them now, in one batch where the pipeline decodes batches
        (its optional ``decode_batch``), or leave them to the decode stage
        (``defer_decode``)."""
        if self.defer_decode:
            with self._decodes_lock:
                for sid, _ in ended:
                    self._decodes_pending[sid] = self._decodes_pending.get(sid, 0) + 1
            result.decodes.extend(ended)
            return
        batched = self._batched(result, ended, "decode", "decode_batch")
        if isinstance(batched, Cancelled):
            return
        if isinstance(batched, Ok):
            for (sid, index), chunk in zip(ended, batched.value, strict=True):
                out = result.row(sid, index)
                out.chunk = chunk
                out.decode_ms += batched.ms / len(ended)
            return
        for sid, index in ended:  # none batched, or the batch failed and changed nothing: each alone
            outcome = self.rows.call(
                result, sid, index, "decode", self.pipeline.decode, self.states[sid], index, stoppable=True
            )
            if isinstance(outcome, Ok):
                out = result.row(sid, index)
                out.chunk = outcome.value
                out.decode_ms += outcome.ms

    def _batched(self, result: StepResult, keys: list[tuple[str, int]], stage: str, method: str) -> Outcome | None:
        """The pipeline's optional batched ``method`` (``commit_batch``,
        ``decode_batch``) over the sessions and chunk indices of ``keys``, through
        ``RowExecutor.call_batch``; None where there are fewer than two or it has none."""
        function = getattr(self.pipeline, method, None)
        if len(keys) < 2 or function is None:
            return None
        states = [self.states[sid] for sid, _ in keys]
        return self.rows.call_batch(result, keys, stage, function, states, [index for _, index in keys])

    def _session_failed(self, session_id: str) -> str | None:
        """A pipeline call failed the session (``RowExecutor.call``): release it
        at once, or, while its committed chunks still decode from its state,
        keep it for them and run it no more (the engine releases it after).
        Returns what went wrong releasing it, if anything did."""
        with self._decodes_lock:
            decoding = session_id in self._decodes_pending
        if decoding:
            self._failed.add(session_id)
            return None
        try:
            self._release(session_id)
        except Exception as error:
            return f"release also failed: {type(error).__name__}: {error}"
        return None

    def _release(self, session_id: str) -> None:
        self._failed.discard(session_id)
        session = self.states.pop(session_id, None)
        if session is not None:
            self.pipeline.release(session)
