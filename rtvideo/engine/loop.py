"""The engine loop of worker rank 0.

The loop plans one forward at a time and never runs one itself: it hands
each ``MicroStep`` to an executor (``rtvideo.engine.plan.Executor``) and goes on while
it runs. Each iteration:

    collect  ->  drain control  ->  boundary work + schedule  ->  submit  ->  wait

- **collect**: the micro-steps the executor finished, in order; their chunks,
  acknowledgements and session ends are emitted (``emit``);
- **drain control**: admitted starts, stops, probes and shutdown, off the
  control plane's inbox (interactions are already in their mailboxes). A
  stop or shutdown only wakes the loop here: the control plane's stop flag,
  set the moment it landed, is its one record, which a session's phase and
  end reason read (``EngineSession.stop_reason``), as the executor does;
- **boundary work + schedule**: the sessions with a row in the next
  micro-step (``ChunkScheduler``), skipping those pacing holds back
  (``rtvideo.engine.pacing``) and, video to video, those whose next chunk's input
  frames have not come (failing one that waited past ``input_timeout_s``,
  ``input_timeout``, and one whose frames the control plane refused,
  ``invalid_input``). For each that sits between chunks, take what its
  mailbox holds for the next chunk: after the drain, in a fresh iteration,
  once the previous chunk came back, and only for sessions about to run, so
  a session that waits keeps collecting interactions for its next chunk; a
  session with an input takes its chunk's frames there too
  (``BoundaryTask.input``), which the runner gives the pipeline before the
  boundary;
- **submit**: up to the executor's depth, so the next micro-step is planned
  while the current one runs (grouped steps of a chunk go out back to back);
- **wait**: on the control plane, until a result (the executor wakes it), a
  control message, a playback report that may free a paced session, input
  frames, or the soonest time a paced session may run again or an input wait
  times out. The wait is handed the wake-up
  count read before anything was collected or decided, so nothing that lands
  in between is slept through.

A session's progress is the loop's (``EngineSession``: the next chunk, the
chunks in flight, decoding and delivered; its phase, end reason and frames
done derived from them); the control plane keeps the mailbox, the playhead
and the stop flag, and reads the loop's next chunk, under its lock, to say
where an interaction lands.

Hence the guarantee: an interaction accepted while chunk k is being denoised
is in the mailbox before the boundary of chunk k+1 is taken, and is active
from chunk k+1, for any number of steps per chunk, grouped or not. Chunk
k+1 begins once k is committed, while k may still be decoding (the decode
stage): one accepted then lands at the next chunk whose boundary is still to
come, k+2 while k+1 is being denoised; its ``InteractionQueued`` says which
(``tests/engine/test_interaction_latency.py`` holds each case at a gate).
With stream batch it lands at the next chunk to enter the pipeline, behind
the chunks in flight, as ``InteractionApplied.chunks_in_flight`` says.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial

from rtvideo.engine.config import EngineConfig
from rtvideo.engine.control import ControlPlane
from rtvideo.engine.messages import (
    ENDED_BEFORE_BOUNDARY,
    AppliedInteraction,
    ChunkReady,
    ChunkTiming,
    EngineStats,
    InteractionApplied,
    InteractionRejected,
    InteractionSuperseded,
    Probe,
    ProbeReply,
    RankFigures,
    ResultMessage,
    SessionDone,
    SessionFailed,
    Shutdown,
    StartSession,
    StopSession,
)
from rtvideo.engine.pacing import Playhead, wait_seconds
from rtvideo.engine.plan import BoundaryTask, ChunkOutput, DecodeResult, Executor, MicroStep, RowResult, StepResult
from rtvideo.engine.scheduler import ChunkScheduler
from rtvideo.engine.session import (
    BoundaryTaken,
    ChunkInFlight,
    EngineSession,
    Phase,
    first_frame,
    output_fault,
    passes_for,
)
from rtvideo.engine.slo import SloController, SloTarget, micro_step_budget
from rtvideo.engine.stream_batch import StreamBatchScheduler


@dataclass
class LoopStats:
    iterations: int = 0  # micro-steps executed
    busy_s: float = 0.0  # wall time with work planned or in flight
    pipeline_s: float = 0.0  # of which inside pipeline calls
    steps: int = 0
    chunks: int = 0
    step_graphs: dict[str, int] = field(default_factory=dict)  # the captured steps' counts, as last reported


class EngineLoop:
    def __init__(
        self,
        config: EngineConfig,
        control: ControlPlane,
        executor: Executor,
        send: Callable[[ResultMessage], None],
        grouping: bool,
        max_rows: int,
        clock: Callable[[], float] = time.monotonic,
        align_chunks: bool = False,
    ) -> None:
        self.config = config
        self.clock = clock  # the pacing clock: first emit and the real-time playhead estimate
        self.control = control
        self.executor = executor
        self.send = send
        self.split = config.pp > 1  # the blocks run on several ranks: a chunk's commit is a pass of its own
        self.scheduler = (
            StreamBatchScheduler(config.pp, grouping, max_rows)
            if self.split
            else ChunkScheduler(grouping, max_rows, align_chunks=align_chunks)
        )
        self.sessions: dict[str, EngineSession] = {}
        self.stats = LoopStats()
        # Split over ranks, the SLO controller picks the rows entering per micro-step.
        self.slo = SloController(max_rows) if self.split else None
        self._entering: dict[int, int] = {}  # micro-step number -> rows that entered in it
        self._carrying: dict[int, set[str]] = {}  # micro-step number in flight -> the sessions it carries
        self._rows_entered = 0
        self._stats_sent_at = 0.0
        self._stats_sent_steps = 0  # micro-steps counted in the figures sent last
        self._running = True
        self._number = 0  # of the latest micro-step planned
        self._busy_since: float | None = None
        self._handlers: dict[type, Callable] = {
            StartSession: self._on_start,
            StopSession: self._on_stop,
            Probe: self._on_probe,
            Shutdown: self._on_shutdown,
        }

    def run(self) -> None:
        """Iterate until shutdown, and until every session was released."""
        try:
            while self._running or self.sessions or self.executor.in_flight():
                self.run_once()
        finally:
            self.executor.close()

    def run_once(self) -> None:
        seen, playheads = self.control.pacing_state()
        self.collect()
        self.drain_control()
        wake_in = self.submit(playheads)
        self.collect()  # what finished meanwhile (at once, with an executor that runs inline)
        if self._running or self.sessions or self.executor.in_flight():
            self.control.wait(seen, None if self.executor.in_flight() else wake_in)

    # ------------------------------------------------------------------
    # collect
    # ------------------------------------------------------------------

    def collect(self) -> None:
        for result in self.executor.results():
            if isinstance(result, DecodeResult):
                self.stats.pipeline_s += result.decode_ms / 1000.0
                self.decoded(result)
                continue
            self.stats.iterations += 1
            self.stats.pipeline_s += result.pipeline_s
            if result.step_graphs is not None:
                self.stats.step_graphs = result.step_graphs
            self._carrying.pop(result.number, None)
            self.emit(result)
            self._control_rows(result)
        self._send_stats()
        if self._busy_since is not None and not self.executor.in_flight():
            self.stats.busy_s += time.perf_counter() - self._busy_since
            self._busy_since = None

    # ------------------------------------------------------------------
    # drain control
    # ------------------------------------------------------------------

    def drain_control(self) -> None:
        for message in self.control.drain():
            self._handlers[type(message)](message)

    def _on_start(self, start: StartSession) -> None:
        sid = start.session_id
        session = EngineSession(
            sid,
            self.control.geometry(sid),
            start=start,
            lookahead=self.config.lookahead(start.prompt_change),
            stop_reason=partial(self.control.stop_reason, sid),
            max_lead_seconds=start.max_lead_seconds,
            max_undelivered_seconds=self.config.max_undelivered_seconds,
        )
        self.sessions[sid] = session
        self.control.attach(sid, session)

    def _on_stop(self, stop: StopSession) -> None:
        """Nothing to record: the control plane's stop flag, set when the stop
        landed, is the one record of it (``EngineSession.stop_reason``); the
        message only wakes the loop to act on it."""

    def _on_shutdown(self, shutdown: Shutdown) -> None:
        self._running = False  # every session is stopping too: the control plane's stop flag says so

    def _on_probe(self, probe: Probe) -> None:
        if self.stats.iterations:  # fresh figures first: a prober reads them once its reply is in
            self.send(self.engine_stats())
        runner_held, pipeline_held = self.executor.held_sessions()
        s = self.stats
        self.send(
            ProbeReply(
                probe_id=probe.probe_id,
                sessions=self.control.open_sessions(),
                runner_sessions=runner_held,
                pipeline_sessions=pipeline_held,
                iterations=s.iterations,
                busy_s=s.busy_s,
                pipeline_s=s.pipeline_s,
                steps=s.steps,
                chunks=s.chunks,
                executing_s=self.executor.executing_s(),
            )
        )

    # ------------------------------------------------------------------
    # boundary work + schedule, submit
    # ------------------------------------------------------------------

    def submit(self, playheads: dict[str, Playhead]) -> float | None:
        """Plan and submit micro-steps while the executor has room; returns when
        a paced session may run again (None: no session is waiting on time)."""
        wake_in = None
        while self.executor.in_flight() < self.executor.depth:
            step, wake_in = self.plan(playheads)
            if step.is_empty():
                break
            if self._busy_since is None:
                self._busy_since = time.perf_counter()
            self.executor.submit(step)
        return wake_in

    def plan(self, playheads: dict[str, Playhead]) -> tuple[MicroStep, float | None]:
        """The next micro-step: sessions to release and open, boundaries, and one
        row per scheduled session."""
        step = MicroStep(number=self._number + 1)
        self._end_faulted()
        held, wake_in = self._paced(playheads)
        waiting, input_wake = self._awaiting_input(held)
        held |= waiting
        if input_wake is not None:
            wake_in = input_wake if wake_in is None else min(wake_in, input_wake)
        # After the faults and input waits above, so a session they just failed is released in this
        # micro-step: nothing else may come to wake the loop for it.
        for sid, session in self.sessions.items():
            if session.phase is Phase.FINISHING and not session.release_planned and self._idle(session):
                step.release.append(sid)
                session.release_planned = True
        for session in self.scheduler.select(self.sessions.values(), held):
            sid = session.session_id
            finishing = self.scheduler.finishing_chunks(sid)
            index = session.next_pass(self.scheduler.busy_chunks(sid), finishing)
            if index is None:
                continue  # a stop landed since it was selected (the stop flag is read live)
            if session.phase is Phase.NEW:
                step.open.append(session.start)
                session.opened = True
            if index not in session.chunks:
                step.boundaries.append(self.boundary_work(session, step.number, finishing))
            chunk = session.chunks[index]
            step.ranks[0].append(chunk.next_row(session.session_id))
            chunk.planned += 1
        entering = step.ranks[0]
        step.ranks, step.returning = self.scheduler.place(entering)
        if not step.is_empty():
            self._number = step.number
            self.scheduler.advance(entering)
            self._entering[step.number] = len(entering)
            self._rows_entered += len(entering)
            self._carrying[step.number] = step.sessions()
        return step, wake_in

    def _idle(self, session: EngineSession) -> bool:
        """Whether nothing of the session runs anywhere: no micro-step that carries
        it is in flight (an executor holds several: one may still be committing
        a chunk whose decode the loop has not heard of), no pass of it is in the
        ring, and no chunk of it is decoding. Only then may its state be freed:
        a release runs in a micro-step of its own, while the decode stage may
        still be reading that state on another thread."""
        sid = session.session_id
        carried = any(sid in sessions for sessions in self._carrying.values())  # at most the executor's depth
        return not carried and not session.decoding and not self.scheduler.in_flight(sid)

    def _end_faulted(self) -> None:
        """Fail the sessions the control plane failed (input frames it refused):
        ``SessionFailed`` with its code once nothing of them runs."""
        for session in self.sessions.values():
            if session.failure is None and (fault := self.control.fault(session.session_id)) is not None:
                self._fail(session, fault.message, fault.code)

    def _awaiting_input(self, held: set[str]) -> tuple[set[str], float | None]:
        """Video to video: the sessions whose next chunk is about to begin (pacing
        does not hold them, ``held``) but whose input frames have not come; they
        wait, other sessions run. One that has waited ``input_timeout_s`` for a
        chunk fails (``input_timeout``). Returns them, and the soonest a wait
        times out (None: none waits)."""
        now = self.clock()
        limit = self.config.input_timeout_s
        waiting: set[str] = set()
        wake: float | None = None
        for sid, session in self.sessions.items():
            if not session.takes_input or session.phase is Phase.FINISHING or sid in held:
                session.input_wait = None
                continue
            index = session.next_pass(self.scheduler.busy_chunks(sid), self.scheduler.finishing_chunks(sid))
            came = self.control.inputs_through(sid) or 0
            if index is None or index in session.chunks or index < came:
                session.input_wait = None  # mid-chunk, or its frames are here
                continue
            if session.input_wait is None or session.input_wait[0] != index:
                session.input_wait = (index, now)
            left = session.input_wait[1] + limit - now
            if left <= 0:
                message = (
                    f"session {sid}: the input frames of chunk {index} did not come within {limit:g} s "
                    "(input_timeout_s)"
                )
                self._fail(session, message, code="input_timeout")
                continue
            waiting.add(sid)
            wake = left if wake is None else min(wake, left)
        return waiting, wake

    def _paced(self, playheads: dict[str, Playhead]) -> tuple[set[str], float | None]:
        """Sessions held back by pacing, and the soonest one of them may run."""
        now = self.clock()
        held: set[str] = set()
        wake: float | None = None
        for sid, session in self.sessions.items():
            playhead = playheads.get(sid, Playhead(None, None))
            index = session.next_pass(self.scheduler.busy_chunks(sid), self.scheduler.finishing_chunks(sid))
            begins = session.phase is not Phase.NEW and index is not None and index not in session.chunks
            wait = wait_seconds(session, playhead.reported, now, playhead.delivered, begins)
            if wait == 0.0:
                continue
            held.add(sid)
            if wait is not None:
                wake = wait if wake is None else min(wake, wait)
        return held, wake

    def boundary_work(
        self, session: EngineSession, number: int, finishing: frozenset[int] = frozenset()
    ) -> BoundaryTask:
        """Take the mailbox for the session's next chunk and open its record
        (the boundary runs in micro-step ``number``, where the commits of
        ``finishing`` chunks finish first). The take, the record and the
        session's next chunk change together, under the control plane's lock:
        an interaction accepted meanwhile is told the chunk it lands at."""
        in_flight = 1 + sum(1 for i in session.chunks if i not in finishing)
        given = self.control.take_input(session.session_id, session.next_chunk) if session.takes_input else None
        with self.control.boundary(session.session_id) as mailbox:
            index = session.next_chunk
            taken = mailbox.take(index)
            applied = taken.applied
            session.chunks[index] = ChunkInFlight(
                index=index,
                steps=session.steps_per_chunk,
                passes=passes_for(session.steps_per_chunk, self.split),
                events=session.events.begin_chunk(
                    index,
                    None if applied is None else (applied.event_id, applied.transition_chunks),
                    taken.retired,
                ),
                boundary=BoundaryTaken(applied, taken.superseded, time.monotonic()),
                boundary_step=number,
                chunks_in_flight=in_flight,
            )
            session.next_chunk = index + 1
        return BoundaryTask(
            session_id=session.session_id,
            chunk_index=index,
            prompt=None if applied is None else applied.prompt,
            transition_chunks=0 if applied is None else applied.transition_chunks,
            input=given,
        )

    # ------------------------------------------------------------------
    # rows per micro-step (SLO), and the figures metrics read
    # ------------------------------------------------------------------

    def _control_rows(self, result: StepResult) -> None:
        """Split over ranks: feed the SLO controller one finished micro-step (its
        wall time against the tightest budget of the sessions running) and let
        the scheduler admit the rows it decides."""
        rows_used = self._entering.pop(result.number, 0)
        if self.slo is None:
            return
        decision = self.slo.observe(result.wall_s, self._micro_step_budget(), rows_used)
        self.scheduler.rows = decision.rows

    def _micro_step_budget(self) -> float | None:
        """The tightest micro-step budget of the sessions running (None: none)."""
        budgets = []
        for session in self.sessions.values():
            if session.phase is Phase.FINISHING:
                continue
            g = session.geometry
            target = SloTarget(fps=g.fps, first_chunk_s=self.config.slo_first_chunk_s)
            budgets.append(
                micro_step_budget(
                    target,
                    frames_per_chunk=g.frames_per_chunk,
                    first_chunk_frames=g.first_chunk_frames,
                    passes_per_chunk=g.num_inference_steps + 1,
                    ranks=self.config.pp,
                    chunks_in_flight=session.lookahead,
                    first_chunk_pending=session.chunks_done == 0,
                )
            )
        return min(budgets, default=None)

    def _send_stats(self, every_s: float = 1.0) -> None:
        """``EngineStats``, at most every ``every_s`` while micro-steps run, and once
        more when the work runs out (so the last figures are never stale)."""
        now = time.monotonic()
        fresh = self.stats.iterations != self._stats_sent_steps
        idle = not self.sessions and not self.executor.in_flight()
        if not fresh or (now - self._stats_sent_at < every_s and not idle):
            return
        self._stats_sent_at, self._stats_sent_steps = now, self.stats.iterations
        self.send(self.engine_stats())

    def engine_stats(self) -> EngineStats:
        figures = self.executor.rank_figures()
        if not figures:  # one rank: its busy time is the pipeline's, its wall the loop's busy time
            wall_s = max(self.stats.busy_s, self.stats.pipeline_s)
            figures = (RankFigures(rank=0, busy_s=self.stats.pipeline_s, wall_s=wall_s),)
        slo = self.slo
        return EngineStats(
            micro_steps=self.stats.iterations,
            rows=self._rows_entered,
            rows_per_micro_step=slo.rows if slo is not None else self.scheduler.max_rows,
            micro_step_s=(slo.ema_s or 0.0) if slo is not None else 0.0,
            slo_decisions=dict(slo.decisions) if slo is not None else {},
            ranks=tuple(figures),
            step_graphs=dict(self.stats.step_graphs),
        )

    # ------------------------------------------------------------------
    # emit
    # ------------------------------------------------------------------

    def emit(self, result: StepResult) -> None:
        """Account one finished micro-step: its rows' progress, the boundaries it
        crossed, chunks that finished, sessions it released or that failed."""
        for sid in result.released:
            if sid in self.sessions:
                self._end(sid)
        for (sid, index), row in sorted(result.rows.items()):
            session = self.sessions.get(sid)
            if session is None:
                continue  # ended earlier (failed in a micro-step before this one)
            chunk = session.chunks.get(index)
            if chunk is not None and chunk.boundary is not None and result.number >= chunk.boundary_step:
                # This micro-step crossed the chunk's boundary (or failed first): end what it took.
                self._report_boundary(session, chunk, row.error)
            self._account_row(session, row, result.number)

    def _report_boundary(self, session: EngineSession, chunk: ChunkInFlight, error: str | None) -> None:
        """End every interaction the boundary took: the ones it replaced are
        superseded; the one it took is applied, or, when the session failed in
        the micro-step that crossed the boundary (its chunk will never be
        delivered), rejected as ``session_failed``."""
        sid = session.session_id
        taken, chunk.boundary = chunk.boundary, None
        for old, by in taken.superseded:
            self.send(InteractionSuperseded(session_id=sid, event_id=old.event_id, by_event_id=by))
        applied = taken.applied
        if applied is None:
            return
        if error is not None:
            message = f"the session failed at chunk {chunk.index} before this interaction took effect: {error}"
            self._reject(sid, applied.event_id, "session_failed", message)
            return
        session.applied.append(
            AppliedInteraction(
                event_id=applied.event_id,
                at_chunk=chunk.index,
                prompt=applied.prompt,
                transition_chunks=applied.transition_chunks,
            )
        )
        frame = first_frame(session.geometry, chunk.index)
        self.send(
            InteractionApplied(
                session_id=sid,
                event_id=applied.event_id,
                generation_chunk_index=chunk.index,
                first_frame_index=frame,
                media_start_seconds=frame / session.geometry.fps,
                queued_to_applied_ms=(taken.taken_at - applied.queued_at) * 1000.0,
                transition_chunks=applied.transition_chunks,
                chunks_in_flight=chunk.chunks_in_flight,
            )
        )

    def _account_row(self, session: EngineSession, row: RowResult, number: int) -> None:
        if row.error is not None:
            self._fail(session, row.error, code="pipeline_error")
            return
        chunk = session.chunks.get(row.chunk_index)
        if chunk is None:
            return
        chunk.boundary_ms += row.boundary_ms
        chunk.encode_ms += row.encode_ms
        if row.cancelled:
            return  # its session is stopping: the chunk is discarded with it
        chunk.batch_rows = max(chunk.batch_rows, row.batch_rows)
        chunk.batch_exact = chunk.batch_exact and row.batch_exact
        if row.stepped:
            self.stats.steps += 1
            chunk.done += 1
            chunk.denoise_ms += row.denoise_ms
            chunk.micro_steps.append(number)
        elif self.split:
            chunk.denoise_ms += row.denoise_ms  # its share of the first rank's commit pass
        if row.committed:
            chunk.commit_ms += row.decode_ms
            self._committed(session, chunk)
            if row.chunk is not None:  # decoded in the same micro-step
                self._emit_chunk(session, session.decoding.pop(chunk.index), row.chunk, 0.0)

    def _committed(self, session: EngineSession, chunk: ChunkInFlight) -> None:
        """The chunk is in the cache: the session's next chunk may begin while this
        one decodes (its frames count from now, for pacing: ``frames_done``);
        after its last chunk the session finishes (``end_reason``), and is
        released once every decode came back."""
        session.decoding[chunk.index] = chunk
        del session.chunks[chunk.index]

    def decoded(self, result: DecodeResult) -> None:
        """A chunk the decode stage finished: emit it, in the session's chunk order.
        A failed decode fails the session, and the chunks after it are not emitted;
        a cancelled one (the session is stopping) drops them without a failure."""
        session = self.sessions.get(result.session_id)
        if session is None:
            return
        chunk = session.decoding.pop(result.chunk_index)  # its frames count no more unless emitted
        if result.cancelled and session.stop_reason() is None:
            # Only a stop abandons a decode: anything else dropping a chunk would leave the session
            # making chunks nobody gets, so it fails, naming what happened.
            result = replace(
                result,
                cancelled=False,
                error=f"the decode of chunk {chunk.index} was abandoned, but the session was not stopping",
            )
        if result.cancelled:  # the session is stopping: this chunk and the ones after it are not emitted
            session.decodes_dropped = True
        elif result.error is not None and not session.decodes_dropped:
            session.decodes_dropped = True
            self._fail(session, result.error, code="pipeline_error")
        elif not session.decodes_dropped:
            self._emit_chunk(session, chunk, result.chunk, result.decode_ms)

    def _emit_chunk(self, session: EngineSession, chunk: ChunkInFlight, output: ChunkOutput, decode_ms: float) -> None:
        """Send a decoded chunk, once ``output_fault`` finds nothing wrong with it; a
        malformed one fails the session, and neither it nor a later chunk is sent."""
        if session.decodes_dropped:
            return
        if (fault := output_fault(output, session.geometry, chunk.index)) is not None:
            session.decodes_dropped = True
            self._fail(session, f"the decode of chunk {chunk.index} returned {fault}", code="pipeline_error")
            return
        frame = first_frame(session.geometry, chunk.index)
        self.send(
            ChunkReady(
                session_id=session.session_id,
                generation_chunk_index=chunk.index,
                num_frames=output.num_frames,
                first_frame_index=frame,
                media_start_seconds=frame / session.geometry.fps,
                width=output.width,
                height=output.height,
                started_event_ids=chunk.events.started,
                active_event_ids=chunk.events.active,
                completed_event_ids=chunk.events.completed,
                timing=ChunkTiming(
                    boundary_ms=chunk.boundary_ms,
                    denoise_ms=chunk.denoise_ms,
                    decode_ms=chunk.commit_ms + decode_ms,
                    steps=chunk.done,
                    runner_calls=tuple(chunk.micro_steps),
                    batch_rows=max(1, chunk.batch_rows),
                    batch_exact=chunk.batch_exact,
                    chunks_in_flight=chunk.chunks_in_flight,
                    encode_ms=chunk.encode_ms,
                ),
                payload=output.payload,
            )
        )
        self.stats.chunks += 1
        if session.first_emit_at is None:
            session.first_emit_at = self.clock()
        session.chunks_done += 1

    def _end(self, sid: str) -> None:
        """The runner released a finishing session: say so (``SessionDone`` with
        its replay log, or ``SessionFailed``), so that a session's last message
        always means the worker holds nothing of it any more."""
        session = self.sessions.pop(sid)
        reason = session.end_reason or "completed"  # read before the control plane forgets its stop flag
        if session.failure is not None:
            message = f"the session failed before this interaction reached a chunk boundary: {session.failure}"
            self._reject_leftovers(sid, "session_failed", message)
            self.send(SessionFailed(session_id=sid, code=session.failure_code, message=session.failure))
            return
        self._reject_leftovers(sid, "session_ended", ENDED_BEFORE_BOUNDARY)
        self.send(
            SessionDone(
                session_id=sid,
                chunks=session.chunks_done,
                frames=session.frames_done,
                stopped=reason != "completed",
                reason=reason,
                # The delivered chunks' log: a stopped session may have begun chunks it never emitted.
                applied=tuple(a for a in session.applied if a.at_chunk < session.chunks_done),
            )
        )

    def _fail(self, session: EngineSession, error: str, code: str) -> None:
        """A pipeline call failed the session (or, ``code`` other than
        pipeline_error, its input did). Chunks it committed before are still
        decoding: they are emitted first; once they are back a micro-step frees its
        state (the runner freed it at once when a call failed and nothing was left
        to decode), and then ``SessionFailed``, its stream's last message, goes out
        (``_end``)."""
        if session.failure is None:
            session.failure, session.failure_code = error, code
        for chunk in session.chunks.values():  # boundaries taken that no micro-step will report
            if chunk.boundary is not None:
                self._report_boundary(session, chunk, error)

    def _reject_leftovers(self, sid: str, code: str, message: str) -> None:
        """Reject what the session's mailbox still holds; before the session's
        last message, which ends its stream."""
        for left in self.control.unregister(sid):
            self._reject(sid, left.event_id, code, message)

    def _reject(self, sid: str, event_id: str, code: str, message: str) -> None:
        self.send(InteractionRejected(session_id=sid, event_id=event_id, code=code, message=message))
