"""The local executor: one rank, in process, on a thread of its own.

Worker rank 0. Implements ``rtvideo.engine.plan.Executor``: the engine loop submits
micro-steps and goes on draining control and planning while this thread runs
them, one after the other in submission order, through the ``ModelRunner``.
Each finished micro-step's result is queued for the loop, and ``on_result``
wakes it. Before a micro-step starts, rows of sessions that are stopping are
taken out (reported cancelled), so a stop cuts a grouped chunk between two
steps; and the runner abandons a forward, commit or decode under way once
every session it is for is stopping (``RunnerSessions.is_stopping``), so a stop
waits for one transformer block or one decoded latent frame, not a chunk.
This is the one-rank case of the executor seam; the ring of several
ranks plugs in at the same seam.

With ``overlap_decode`` (the default when threaded), a chunk's decode is the
decode stage's (``rtvideo.workers.decode_stage``): the micro-step that ends a chunk
commits it and returns, and the decode runs on a thread of its own while the
next chunk denoises; its ``DecodeResult`` comes back through ``results`` after
that micro-step's result.

``threaded=False`` runs each micro-step inside ``submit``, on the caller's
thread, through the same runner, decodes included: in-process tests drive the
loop one micro-step per ``run_once`` that way, deterministically.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

import msgspec

from rtvideo.engine.messages import RankFigures
from rtvideo.engine.plan import DecodeResult, MicroStep, StepResult
from rtvideo.workers.decode_stage import DecodeStage, DecodeStages
from rtvideo.workers.ordered_thread import OrderedThread
from rtvideo.workers.runner import WorkerRunner
from rtvideo.workers.runner_sessions import RunnerSessions

log = logging.getLogger(__name__)


class LocalExecutor:
    def __init__(
        self,
        runner: WorkerRunner,
        is_cancelled: Callable[[str], bool],
        on_result: Callable[[], None],
        depth: int = 2,
        threaded: bool = True,
        overlap_decode: bool = True,
        decode_lanes: int = 1,
        batch_decodes: int = 1,
        decode_stage: Callable[[RunnerSessions, Callable[[DecodeResult], None]], DecodeStages] | None = None,
        decode_nice: int = 0,
    ) -> None:
        """``runner``: the one-rank ``ModelRunner`` or the ring runner
        (``rtvideo.workers.runner.WorkerRunner``). ``decode_stage``: builds the decode
        stage from the runner's sessions (``runner.sessions``, whose deferred
        decodes it runs) and the callback for its results (default:
        ``DecodeStage`` with ``decode_lanes`` lanes, each decoding what waits on
        it in batches of at most ``batch_decodes`` chunks, ``decode_nice`` steps
        of ``nice`` below the worker: ``rtvideo.workers.os_threads``); a
        ``rtvideo.workers.decode_stage.DecodeStages``."""
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self.depth = depth if threaded else 1
        self._runner = runner
        self._is_cancelled = is_cancelled
        # a forward or decode of stopping sessions only is abandoned part-way
        runner.sessions.is_stopping = is_cancelled
        self._on_result = on_result
        self._lock = threading.Lock()
        self._done: deque[StepResult | DecodeResult] = deque()
        self._failure: BaseException | None = None
        self._submitted = 0
        self._returned = 0
        self._running_since: float | None = None
        self._held = runner.held_sessions()
        self._decoder: DecodeStages | None = None
        if threaded and overlap_decode:
            runner.sessions.defer_decode = True
            if decode_stage is None:
                self._decoder = DecodeStage(
                    runner.sessions, self._decoded, lanes=decode_lanes, batch=batch_decodes, nice=decode_nice
                )
            else:
                self._decoder = decode_stage(runner.sessions, self._decoded)
        self._thread: OrderedThread[MicroStep] | None = OrderedThread("executor", self._run) if threaded else None

    # -- engine.plan.Executor -------------------------------------------------

    def submit(self, step: MicroStep) -> None:
        with self._lock:
            self._submitted += 1
        if self._thread is None:
            self._run(step)
        else:
            self._thread.submit(step)

    def results(self) -> list[StepResult | DecodeResult]:
        with self._lock:
            if self._failure is not None:
                raise self._failure
            done = list(self._done)
            self._done.clear()
            self._returned += sum(isinstance(result, StepResult) for result in done)
            return done

    def in_flight(self) -> int:
        with self._lock:
            return self._submitted - self._returned

    def executing_s(self) -> float:
        with self._lock:
            return 0.0 if self._running_since is None else time.monotonic() - self._running_since

    def held_sessions(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        with self._lock:
            return self._held

    def rank_figures(self) -> tuple[RankFigures, ...]:
        """The ring runner's figures of each rank, with the chunks the decode
        stage decoded on it; () with one rank."""
        figures = self._runner.rank_figures()
        if not figures:
            return ()
        decoded = () if self._decoder is None else self._decoder.decodes  # none: decoded in micro-steps
        return tuple(
            msgspec.structs.replace(f, decoded_chunks=decoded[f.rank] if f.rank < len(decoded) else 0) for f in figures
        )

    def close(self) -> None:
        if self._thread is not None:
            self._thread.close()
        if self._decoder is not None:
            self._decoder.close()

    # -- the executor thread ---------------------------------------------------

    def _run(self, step: MicroStep) -> bool:
        """Run one micro-step; False when the runner raised (the loop gets the
        error from ``results``, and nothing more runs)."""
        with self._lock:
            self._running_since = time.monotonic()
        try:
            result = self._execute(step)
        except BaseException as error:  # a runner bug: hand it to the loop, which fails with it
            log.exception("micro-step %d failed", step.number)
            with self._lock:
                self._failure = error
                self._running_since = None
            self._on_result()
            return False
        held = self._runner.held_sessions()
        with self._lock:
            self._done.append(result)
            self._held = held
            self._running_since = None
        for session_id, chunk_index in result.decodes:  # after its micro-step's result, so it comes back after it
            self._decoder.submit(session_id, chunk_index)
        if self._decoder is not None:
            for session_id in result.released:
                self._decoder.forget(session_id)
            self._decoder.step_done(self._thread is None or self._thread.pending == 0)
        self._on_result()
        return True

    def _decoded(self, result: DecodeResult) -> None:
        with self._lock:
            self._done.append(result)
        self._on_result()

    def _execute(self, step: MicroStep) -> StepResult:
        # Only rows entering now: split over ranks, later ranks' rows are already on their way.
        cancelled = [row for row in step.ranks[0] if self._is_cancelled(row.session_id)]
        if cancelled:
            gone = {row.session_id for row in cancelled}
            step.ranks[0] = [row for row in step.ranks[0] if row.session_id not in gone]
            step.cancelled = cancelled
        result = self._runner.execute(step)
        for row in cancelled:
            result.row(row.session_id, row.chunk_index).cancelled = True
        return result
