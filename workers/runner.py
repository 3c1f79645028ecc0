"""The model runner: executes one ``MicroStep`` over a ``ChunkPipeline``.

Runs on the executor's thread of worker rank 0 (``workers.executor``); one
rank, so it runs every stage (``workers.pipelines.base``) itself. Holds the
state of each open session (the pipeline's ``SessionState``, never shared,
never global) and implements ``engine.plan.Runner``. Which chunk and step a
call is about comes from the plan's rows; the pipeline refuses a row its
session's state cannot take (a chunk never prepared, a step out of order),
which fails that session. Every pipeline call goes through ``_call``: timed,
and guarded per session, so an exception fails that session only, releases
it at once, and the other rows go on. When a batched forward raises, each of
its rows is rerun alone, so only the row that fails on its own loses its
session.

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
import traceback
from collections.abc import Callable, Iterable
from time import perf_counter
from typing import Any, NamedTuple

from engine.messages import SessionGeometry, StartSession
from engine.plan import BoundaryTask, DecodeResult, MicroStep, RowResult, StepResult, StepRow
from workers.pipelines.base import Abandoned, BatchRow, ChunkPipeline, SessionState, StepBatch, abandon_when

log = logging.getLogger(__name__)
_FAILED = object()  # what _call returns when the pipeline raised
_CANCELLED = object()  # what _call returns when the call was abandoned (its sessions are stopping)


class StageCall(NamedTuple):
    """One pipeline call, as ``ModelRunner(on_stage=...)`` reports it."""

    session_id: str
    stage: str  # encode_prompt, open, boundary, forward, sampler_step, commit, decode
    ms: float  # a batched forward: the whole forward, reported for each of its rows
    error: BaseException | None


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
        self._synchronize = synchronize
        self._on_stage = on_stage
        self.defer_decode = False
        """True: a committed chunk is left for ``decode`` (the decode stage, on a
        thread of its own) and listed in ``StepResult.decodes``; False: it is
        decoded in the micro-step that committed it."""
        self._decodes_lock = threading.Lock()
        self._decodes_pending: dict[str, int] = {}  # deferred decodes not yet run, per session
        self._failed: set[str] = set()  # failed with decodes pending: kept for them, run no more
        self.is_stopping: Callable[[str], bool] | None = None
        """Whether a session is stopping (the control plane's ``is_stopping``, read
        lock-free from the executor and decode threads); None: never abandon."""

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
            prompt, ms = self._call(result, sid, 0, "encode_prompt", self.pipeline.encode_prompt, start.prompt)
            result.row(sid, 0).boundary_ms += ms
            if prompt is not _FAILED:
                _, ms = self._call(result, sid, 0, "open", self._open, start, prompt)
                result.row(sid, 0).boundary_ms += ms
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
        self._sync("decode")
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
        self._sync("decode")
        ms = (perf_counter() - started) * 1000.0
        if cancelled:
            return DecodeResult(session_id, chunk_index, None, ms, cancelled=True)
        self._report(session_id, "decode", ms, failure)
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
        chunks, seconds = self._run_batch(
            keys, "decode", lambda: decode_batch([self.states[sid] for sid, _ in keys], indices)
        )
        if chunks is _FAILED:
            return None
        for sid, _ in keys:
            self.decode_returned(sid)
        if chunks is _CANCELLED:  # every session is stopping
            return [DecodeResult(sid, index, None, 0.0, cancelled=True) for sid, index in keys]
        share = seconds * 1000.0 / len(keys)
        return [DecodeResult(sid, index, chunk, share) for (sid, index), chunk in zip(keys, chunks, strict=True)]

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
            self._report(session_id, "decode", 0.0, error)
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
            prompt, ms = self._call(result, sid, index, "encode_prompt", self.pipeline.encode_prompt, task.prompt)
            result.row(sid, index).boundary_ms += ms
            if prompt is _FAILED:
                return
        session = self.states[sid]
        _, ms = self._call(
            result, sid, index, "boundary", self.pipeline.boundary, session, index, prompt, task.transition_chunks
        )
        result.row(sid, index).boundary_ms += ms

    def _forward(self, rows: list[StepRow], result: StepResult) -> None:
        """One forward over ``rows`` (every block: one rank), then each row's sampler
        step, then the commit of the rows whose chunk just ended (``_commit``)
        and the decode of the chunks committed (``_committed``)."""
        sessions = [self.states[row.session_id] for row in rows]
        batch = StepBatch(tuple(BatchRow(row.session_id, row.chunk_index, row.step) for row in rows))
        if len(rows) == 1:
            predictions, forward_ms = self._call(
                result,
                rows[0].session_id,
                rows[0].chunk_index,
                "forward",
                self.pipeline.forward,
                batch,
                sessions,
                stoppable=True,
            )
            if predictions is _FAILED or predictions is _CANCELLED:
                return
        else:
            keys = [(row.session_id, row.chunk_index) for row in rows]
            predictions, forward_ms = self._call_batch(result, keys, "forward", self.pipeline.forward, batch, sessions)
            if predictions is _CANCELLED:
                return
            if predictions is _FAILED:
                # Find the culprit: rerun each row alone (forward leaves state
                # untouched), so one bad row fails only its own session.
                for row in rows:
                    self._forward([row], result)
                return
        share = forward_ms / len(rows)
        denoised: list[tuple[str, int]] = []  # rows whose chunk this step finished denoising
        for row, batch_row, session, prediction in zip(rows, batch.rows, sessions, predictions, strict=True):
            sid, index = row.session_id, row.chunk_index
            stepped, update_ms = self._call(
                result, sid, index, "sampler_step", self.pipeline.sampler_step, session, batch_row, prediction
            )
            if stepped is _FAILED:
                continue
            out = result.row(sid, index)
            out.denoise_ms += share + update_ms
            out.stepped = True
            self._note_batch(out, len(rows))
            if row.last:
                denoised.append((sid, index))
        self._committed(result, self._commit(result, denoised))

    def _commit(self, result: StepResult, denoised: list[tuple[str, int]]) -> list[tuple[str, int]]:
        """Commit the chunks of ``denoised`` (session, chunk index): in one pass
        where the pipeline commits batches (its optional ``commit_batch``), else,
        or when that raises, each alone. Returns those committed."""
        batched = self._batched(result, denoised, "commit", "commit_batch")
        if batched is not None:
            value, commit_ms = batched
            if value is _CANCELLED:
                return []
            if value is not _FAILED:  # failed: the pipeline changed nothing, each commits alone below
                for sid, index in denoised:
                    out = result.row(sid, index)
                    out.decode_ms += commit_ms / len(denoised)
                    out.committed = True
                return denoised
        committed = []
        for sid, index in denoised:
            value, commit_ms = self._call(
                result, sid, index, "commit", self.pipeline.commit, self.states[sid], index, stoppable=True
            )
            if value is not _FAILED and value is not _CANCELLED:
                out = result.row(sid, index)
                out.decode_ms += commit_ms
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
        if batched is not None:
            chunks, decode_ms = batched
            if chunks is _CANCELLED:
                return
            if chunks is not _FAILED:  # failed: the pipeline changed nothing, each chunk decodes alone below
                for (sid, index), chunk in zip(ended, chunks, strict=True):
                    out = result.row(sid, index)
                    out.chunk = chunk
                    out.decode_ms += decode_ms / len(ended)
                return
        for sid, index in ended:
            chunk, decode_ms = self._call(
                result, sid, index, "decode", self.pipeline.decode, self.states[sid], index, stoppable=True
            )
            if chunk is not _FAILED and chunk is not _CANCELLED:
                out = result.row(sid, index)
                out.chunk = chunk
                out.decode_ms += decode_ms

    def _batched(
        self, result: StepResult, keys: list[tuple[str, int]], stage: str, method: str
    ) -> tuple[Any, float] | None:
        """The pipeline's optional batched ``method`` (``commit_batch``,
        ``decode_batch``) over the sessions and chunk indices of ``keys``, through
        ``_call_batch``; None where there are fewer than two or it has none."""
        function = getattr(self.pipeline, method, None)
        if len(keys) < 2 or function is None:
            return None
        states = [self.states[sid] for sid, _ in keys]
        return self._call_batch(result, keys, stage, function, states, [index for _, index in keys])

    def _call_batch(
        self, result: StepResult, keys: list[tuple[str, int]], stage: str, function: Callable, *args: Any
    ) -> tuple[Any, float]:
        """``_run_batch`` within a micro-step: its time goes to the micro-step's
        pipeline time, and an abandoned call's rows are cancelled; returns (its
        value, ms), 0 ms unless it ran."""
        value, seconds = self._run_batch(keys, stage, function, *args)
        result.pipeline_s += seconds
        if value is _CANCELLED:
            for sid, index in keys:
                result.row(sid, index).cancelled = True
        if value is _CANCELLED or value is _FAILED:
            return value, 0.0
        return value, seconds * 1000.0

    def _run_batch(self, keys: list[tuple[str, int]], stage: str, function: Callable, *args: Any) -> tuple[Any, float]:
        """One pipeline call for several rows (``keys``: session, chunk index),
        timed and, when it ran, reported for each row; returns (its value,
        seconds). Abandoned once every row's session is stopping: the value is
        ``_CANCELLED``. When it raises the value is ``_FAILED`` and nothing is
        failed here: the caller runs each row alone to find which one fails."""
        self._sync(stage)
        started = perf_counter()
        try:
            with abandon_when(self.stop_check(sid for sid, _ in keys)):
                value = function(*args)
        except Abandoned:
            return _CANCELLED, perf_counter() - started
        except Exception:
            log.warning("a batched %s of %d rows failed; running each alone", stage, len(keys), exc_info=True)
            return _FAILED, perf_counter() - started
        self._sync(stage)
        seconds = perf_counter() - started
        for sid, _ in keys:
            self._report(sid, stage, seconds * 1000.0, None)
        return value, seconds

    def _call(
        self,
        result: StepResult,
        session_id: str,
        chunk_index: int,
        stage: str,
        function: Callable,
        *args: Any,
        stoppable: bool = False,
    ) -> tuple[Any, float]:
        """Run one pipeline call for one session (about chunk ``chunk_index``, where
        its result is reported); returns (its value, ms), and adds
        the time to the micro-step's pipeline time. On an exception the session
        fails and is released, and the value is ``_FAILED``: a pipeline bug never
        takes the worker down. ``stoppable``: the call is abandoned at its next
        ``abandon_point`` once the session is stopping; the row is reported
        cancelled and the value is ``_CANCELLED``."""
        self._sync(stage)
        started = perf_counter()
        failure = None
        try:
            with abandon_when(self.stop_check((session_id,)) if stoppable else None):
                value = function(*args)
        except Abandoned:
            result.row(session_id, chunk_index).cancelled = True
            value = _CANCELLED
        except Exception as error:
            failure = error
            row = result.row(session_id, chunk_index)
            row.error = f"{stage} failed: {type(error).__name__}: {error}"
            with self._decodes_lock:
                decoding = session_id in self._decodes_pending
            if decoding:  # its committed chunks still decode from its state: the engine releases it after
                self._failed.add(session_id)
            else:
                try:
                    self._release(session_id)
                except Exception as release_error:
                    row.error += f" (release also failed: {type(release_error).__name__}: {release_error})"
            value = _FAILED
        self._sync(stage)
        ms = (perf_counter() - started) * 1000.0
        result.pipeline_s += ms / 1000.0
        self._report(session_id, stage, ms, failure)
        return value, ms

    def _note_batch(self, out: RowResult, rows: int) -> None:
        """A forward of ``rows`` rows ran a step of ``out``'s chunk: its values are
        those of a forward alone unless it had other rows and the pipeline's
        batched forward is not batch-invariant (its ``batch_invariant``)."""
        out.batch_rows = max(out.batch_rows, rows)
        if rows > 1 and not getattr(self.pipeline, "batch_invariant", False):
            out.batch_exact = False

    def stop_check(self, session_ids: Iterable[str]) -> Callable[[], bool] | None:
        """A check that is true once every one of ``session_ids`` is stopping
        (None without ``is_stopping``): a call over them may then be abandoned."""
        is_stopping = self.is_stopping
        if is_stopping is None:
            return None
        ids = tuple(dict.fromkeys(session_ids))
        return lambda: all(is_stopping(sid) for sid in ids)

    def _sync(self, stage: str) -> None:
        if self._synchronize is not None:
            self._synchronize(stage)

    def _report(self, session_id: str, stage: str, ms: float, error: BaseException | None) -> None:
        """A pipeline call's outcome, to the stage observer; one that failed is logged too."""
        if error is not None:
            _log_failure(stage, session_id, error)
        if self._on_stage is not None:
            self._on_stage(StageCall(session_id, stage, ms, error))

    def _release(self, session_id: str) -> None:
        self._failed.discard(session_id)
        session = self.states.pop(session_id, None)
        if session is not None:
            self.pipeline.release(session)


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
