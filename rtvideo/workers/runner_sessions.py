"""The open sessions of rank 0, and the pipeline calls about them that every runner makes.

Runs on the executor's thread of worker rank 0 (``rtvideo.workers.executor``), and on
the decode stage's threads for the decodes it defers. Both runners hold one
``RunnerSessions``: the one-rank ``rtvideo.workers.runner.ModelRunner`` and the ring
runner over pipeline ranks (``rtvideo.workers.parallel.ring.RingRunner``); they
differ only in how a micro-step's rows go through the blocks. It holds each
open session's state (the pipeline's ``SessionState``, never shared, never
global) and the ``RowExecutor`` every call goes through (timed, guarded per
session, abandonable; outcomes ``Ok``, ``Failed``, ``Cancelled``), and does
what is the same for both runners:

- ``prepare``: a micro-step's releases, opens (prompt encode, allocate) and
  boundaries (an interaction's prompt encode; video to video, the chunk's
  input frames, ``take_input``; then the boundary);
- ``forwards``: a forward over rows as one batch, each row alone when the
  batch raises (so only a row that fails on its own fails its session);
- ``committed``: the chunks whose commit finished, decoded now or left to
  the decode stage (``defer_decode``), and that stage's ``decode``,
  ``decode_many``, ``hand_off_decode`` and ``decode_returned``;
- a session a call failed is released at once, or, while decodes of its
  committed chunks are still pending, kept for them and run no more.

A stop is honoured mid-call (``is_stopping``): a forward, commit or decode
whose rows' sessions are all stopping ends at the pipeline's next
``abandon_point``; its rows are reported ``cancelled``, never failed, and
nothing is released here (the engine releases the session in a micro-step
of its own). A decode not begun when its session is stopping is not run.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from time import perf_counter
from typing import Any, NamedTuple

import numpy as np

from rtvideo.engine.messages import SessionGeometry, StartSession
from rtvideo.engine.plan import BoundaryTask, DecodeResult, MicroStep, StepResult, StepRow
from rtvideo.workers.pipelines.base import Abandoned, BatchRow, ChunkPipeline, SessionState, StepBatch, abandon_when
from rtvideo.workers.row_executor import Cancelled, Failed, Ok, Outcome, RowExecutor, StageCall

log = logging.getLogger("rtvideo.workers.runner")


class Forward(NamedTuple):
    """A forward that ran (``RunnerSessions.forwards``): its rows, the batch and
    the sessions' states it ran over, and its outcome (``value``: the pipeline's)."""

    rows: list[StepRow]
    batch: StepBatch
    sessions: list[SessionState]
    outcome: Ok


class RunnerSessions:
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
            batch_invariant=lambda: pipeline.batch_invariant,
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

    def describe(self, start: StartSession) -> SessionGeometry:
        """The pipeline's ``describe``; a start with an ``input`` is refused here,
        naming the pipeline, where it does not declare ``video_input``."""
        if start.input is not None and not self.pipeline.capabilities.video_input:
            raise ValueError(
                f"input: the {self.pipeline.name!r} pipeline takes no input video (it does not declare video_input)"
            )
        return self.pipeline.describe(start)

    def held_sessions(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        return tuple(self.states), self.pipeline.held_sessions()

    def running(self, rows: Iterable[StepRow]) -> list[StepRow]:
        """The rows of ``rows`` whose session is open and has not failed."""
        return [row for row in rows if row.session_id in self.states and row.session_id not in self._failed]

    # -- a micro-step's parts ------------------------------------------------------

    def prepare(self, step: MicroStep, result: StepResult) -> None:
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

    def forwards(self, result: StepResult, rows: list[StepRow], *blocks: range) -> Iterator[Forward]:
        """The pipeline's forward over ``rows`` (over ``blocks``, where given: a
        pipeline rank's), as one batch; when the batch raises, each row alone
        (a forward leaves state untouched), so only a row that fails on its own
        fails its session. Yields each forward that ran, as it ran: the caller
        finishes its rows before the next one runs. A forward abandoned because
        its sessions are all stopping yields nothing (its rows are cancelled)."""
        sessions = [self.states[row.session_id] for row in rows]
        batch = StepBatch(tuple(BatchRow(row.session_id, row.chunk_index, row.step) for row in rows))
        if len(rows) == 1:
            sid, index = rows[0].session_id, rows[0].chunk_index
            outcome = self.rows.call(
                result, sid, index, "forward", self.pipeline.forward, batch, sessions, *blocks, stoppable=True
            )
        else:
            keys = [(row.session_id, row.chunk_index) for row in rows]
            outcome = self.rows.call_batch(result, keys, "forward", self.pipeline.forward, batch, sessions, *blocks)
            if isinstance(outcome, Failed):  # find the culprit: each row alone
                for row in rows:
                    yield from self.forwards(result, [row], *blocks)
                return
        if isinstance(outcome, Ok):
            yield Forward(rows, batch, sessions, outcome)

    def batched(self, result: StepResult, keys: list[tuple[str, int]], stage: str, method: str) -> Outcome | None:
        """The pipeline's optional batched ``method`` (``commit_batch``,
        ``decode_batch``: each the capability of that name) over the sessions and
        chunk indices of ``keys``, through ``RowExecutor.call_batch``; None where
        there are fewer than two or the pipeline does not declare it."""
        if len(keys) < 2 or not getattr(self.pipeline.capabilities, method):
            return None
        function = getattr(self.pipeline, method)
        states = [self.states[sid] for sid, _ in keys]
        return self.rows.call_batch(result, keys, stage, function, states, [index for _, index in keys])

    def committed(self, result: StepResult, ended: list[tuple[str, int]]) -> None:
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
        batched = self.batched(result, ended, "decode", "decode_batch")
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

    # -- the decode stage ------------------------------------------------------------

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
        longer pending; None (still pending, nothing changed) where it declares
        none or it raised."""
        if not self.pipeline.capabilities.decode_batch:
            return None
        decode_batch = self.pipeline.decode_batch
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
        """For a decode another rank runs (``rtvideo.workers.parallel.rank_decode``): the
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
        if task.input is not None:  # video to video: the chunk's frames, before its boundary
            given = task.input
            data = bytearray(given.frames)  # writable: a pipeline may hand it to torch as it is
            frames = np.frombuffer(data, dtype=np.uint8).reshape(given.count, given.height, given.width, 3)
            taken = self.rows.call(result, sid, index, "take_input", self.pipeline.take_input, session, index, frames)
            out = result.row(sid, index)
            out.boundary_ms += taken.ms
            out.encode_ms += taken.ms  # counted apart too: the chunk-cost model charges it to input sessions only
            if not isinstance(taken, Ok):
                return
        crossed = self.rows.call(
            result, sid, index, "boundary", self.pipeline.boundary, session, index, prompt, task.transition_chunks
        )
        result.row(sid, index).boundary_ms += crossed.ms

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
