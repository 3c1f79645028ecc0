"""The engine loop of worker rank 0.

Each iteration:

    drain control  ->  schedule  ->  boundary work  ->  execute  ->  emit

- **drain control**: admitted starts, stops, probes and shutdown, off the
  control plane's inbox (interactions are already in their mailboxes);
- **schedule**: the sessions that run this iteration (``ChunkScheduler``),
  skipping those pacing holds back (``engine.pacing``);
- **boundary work**: for each of them that sits between chunks, take what its
  mailbox holds for the next chunk. This happens after the drain, in a fresh
  iteration, and only for sessions about to run, so a session that waits
  keeps collecting interactions for its next chunk;
- **execute**: one runner invocation runs the plan (release, open,
  boundaries, then the denoise rows; a row never crosses a chunk boundary);
- **emit**: acknowledgements and finished chunks go out as results.

With nothing to run, the loop waits on the control plane until a message, a
playback report that may free a paced session, or the soonest time a paced
session may run again. The wait is handed the wake-up count read together
with the playheads it decided on, so a report that lands between the
decision and the wait wakes it at once.

Hence the guarantee: an interaction accepted while chunk k is being denoised
(or decoded) is in the mailbox before the boundary of chunk k+1 is taken, and
is active from chunk k+1, for any number of steps per chunk, grouped or not.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.control import ControlPlane
from engine.mailbox import PendingInteraction
from engine.messages import (
    AppliedInteraction,
    ChunkReady,
    ChunkTiming,
    InteractionApplied,
    InteractionRejected,
    InteractionSuperseded,
    Probe,
    ProbeReply,
    ResultMessage,
    SessionDone,
    SessionFailed,
    Shutdown,
    StartSession,
    StopSession,
)
from engine.pacing import wait_seconds
from engine.plan import BoundaryTask, PlanResult, PlanRow, RowResult, Runner, StepPlan
from engine.scheduler import ChunkScheduler
from engine.session import EngineSession, Phase


@dataclass
class LoopStats:
    iterations: int = 0  # iterations that executed a plan
    busy_s: float = 0.0  # wall time of those iterations, schedule to emit
    pipeline_s: float = 0.0  # of which inside pipeline calls
    steps: int = 0
    chunks: int = 0


@dataclass
class _Boundary:
    """A boundary decided in this iteration, reported once the runner ran it."""

    applied: PendingInteraction | None
    superseded: list[tuple[PendingInteraction, str]]
    taken_at: float
    first_frame: int


@dataclass
class _Iteration:
    plan: StepPlan
    boundaries: dict[str, _Boundary] = field(default_factory=dict)
    wake_in: float | None = None  # with nothing to run: when a paced session may run again
    seen: int = 0  # the control plane's wake-up count the pacing decision was made on


class EngineLoop:
    def __init__(
        self,
        config: EngineConfig,
        control: ControlPlane,
        runner: Runner,
        send: Callable[[ResultMessage], None],
        grouping: bool,
        max_rows: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.clock = clock  # the pacing clock: first emit and the real-time playhead estimate
        self.control = control
        self.runner = runner
        self.send = send
        self.scheduler = ChunkScheduler(grouping, max_rows)
        self.sessions: dict[str, EngineSession] = {}
        self.stats = LoopStats()
        self._running = True
        self._invocation = 0
        self._handlers: dict[type, Callable] = {
            StartSession: self._on_start,
            StopSession: self._on_stop,
            Probe: self._on_probe,
            Shutdown: self._on_shutdown,
        }

    def run(self) -> None:
        """Iterate until shutdown, and until every session was released."""
        while self._running or self.sessions:
            self.run_once()

    def run_once(self) -> None:
        started = time.perf_counter()
        self.drain_control()
        iteration = self.schedule()
        if iteration.plan.is_empty():
            if self._running:
                self.control.wait(iteration.seen, iteration.wake_in)
            return
        result = self.execute(iteration.plan)
        self.emit(iteration, result)
        self.stats.iterations += 1
        self.stats.busy_s += time.perf_counter() - started

    # ------------------------------------------------------------------
    # drain control
    # ------------------------------------------------------------------

    def drain_control(self) -> None:
        for message in self.control.drain():
            self._handlers[type(message)](message)

    def _on_start(self, start: StartSession) -> None:
        geometry = self.control.geometry(start.session_id)
        self.sessions[start.session_id] = EngineSession(
            start.session_id, geometry, start=start, max_lead_seconds=start.max_lead_seconds
        )

    def _on_stop(self, stop: StopSession) -> None:
        session = self.sessions.get(stop.session_id)
        if session is not None:
            session.finish(stop.reason)

    def _on_shutdown(self, shutdown: Shutdown) -> None:
        self._running = False
        for session in self.sessions.values():
            session.finish(shutdown.reason)

    def _on_probe(self, probe: Probe) -> None:
        runner_held, pipeline_held = self.runner.held_sessions()
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
            )
        )

    # ------------------------------------------------------------------
    # schedule + boundary work
    # ------------------------------------------------------------------

    def schedule(self) -> _Iteration:
        plan = StepPlan(invocation=self._invocation + 1)
        iteration = _Iteration(plan)
        plan.release = [sid for sid, s in self.sessions.items() if s.phase is Phase.FINISHING]
        held, iteration.wake_in, iteration.seen = self._paced()
        for session in self.scheduler.select(self.sessions.values(), held):
            if session.phase is Phase.NEW:
                plan.open.append(session.start)
                session.phase = Phase.BOUNDARY
            if session.phase is Phase.BOUNDARY:
                self.boundary_work(session, iteration)
            plan.rows.append(
                PlanRow(
                    session_id=session.session_id,
                    chunk_index=session.chunk_index,
                    first_step=session.step_in_chunk,
                    num_steps=self.scheduler.steps_for(session),
                    steps_per_chunk=session.steps_per_chunk,
                )
            )
        if not plan.is_empty():
            self._invocation = plan.invocation
        return iteration

    def _paced(self) -> tuple[set[str], float | None, int]:
        """Sessions held back by pacing, the soonest one of them may run, and the
        control plane's wake-up count read with the playheads decided on."""
        seen, playheads = self.control.pacing_state()
        now = self.clock()
        held: set[str] = set()
        wake: float | None = None
        for sid, session in self.sessions.items():
            wait = wait_seconds(session, playheads.get(sid), now)
            if wait == 0.0:
                continue
            held.add(sid)
            if wait is not None:
                wake = wait if wake is None else min(wake, wait)
        return held, wake, seen

    def boundary_work(self, session: EngineSession, iteration: _Iteration) -> None:
        """Take the mailbox for the session's next chunk and plan the boundary."""
        chunk = session.chunk_index
        taken = self.control.take_boundary(session.session_id, chunk)
        applied = taken.applied
        iteration.plan.boundaries.append(
            BoundaryTask(
                session_id=session.session_id,
                chunk_index=chunk,
                prompt=None if applied is None else applied.prompt,
                transition_chunks=0 if applied is None else applied.transition_chunks,
            )
        )
        iteration.boundaries[session.session_id] = _Boundary(
            applied, taken.superseded, time.monotonic(), session.frames_done
        )
        session.chunk_events = session.events.begin_chunk(
            chunk,
            None if applied is None else (applied.event_id, applied.transition_chunks),
            taken.retired,
        )
        session.phase = Phase.DENOISING
        session.step_in_chunk = 0
        session.boundary_ms = session.denoise_ms = 0.0
        session.step_calls = []

    # ------------------------------------------------------------------
    # execute
    # ------------------------------------------------------------------

    def execute(self, plan: StepPlan) -> PlanResult:
        result = self.runner.execute(plan, self.control.is_stopping)
        self.stats.pipeline_s += result.pipeline_s
        return result

    # ------------------------------------------------------------------
    # emit
    # ------------------------------------------------------------------

    def emit(self, iteration: _Iteration, result: PlanResult) -> None:
        plan = iteration.plan
        for sid in plan.release:
            self._end(sid)
        for sid, boundary in iteration.boundaries.items():
            row = result.rows.get(sid)
            self._report_boundary(self.sessions[sid], boundary, None if row is None else row.error)
        for planned in plan.rows:
            row = result.rows.get(planned.session_id)
            if row is not None:
                self._account_row(self.sessions[planned.session_id], row)

    def _report_boundary(self, session: EngineSession, boundary: _Boundary, error: str | None) -> None:
        """End every interaction the boundary took: the ones it replaced are
        superseded; the one it took is applied, or, when the session failed in
        the invocation that crossed the boundary (its chunk will never be
        delivered), rejected as ``session_failed``."""
        sid = session.session_id
        for old, by in boundary.superseded:
            self.send(InteractionSuperseded(session_id=sid, event_id=old.event_id, by_event_id=by))
        applied = boundary.applied
        if applied is None:
            return
        if error is not None:
            message = f"the session failed at chunk {session.chunk_index} before this interaction took effect: {error}"
            self._reject(sid, applied.event_id, "session_failed", message)
            return
        media_start = boundary.first_frame / session.geometry.fps
        session.applied.append(
            AppliedInteraction(
                event_id=applied.event_id,
                at_chunk=session.chunk_index,
                prompt=applied.prompt,
                transition_chunks=applied.transition_chunks,
            )
        )
        self.send(
            InteractionApplied(
                session_id=sid,
                event_id=applied.event_id,
                generation_chunk_index=session.chunk_index,
                first_frame_index=boundary.first_frame,
                media_start_seconds=media_start,
                queued_to_applied_ms=(boundary.taken_at - applied.queued_at) * 1000.0,
                transition_chunks=applied.transition_chunks,
            )
        )

    def _account_row(self, session: EngineSession, row: RowResult) -> None:
        if row.error is not None:
            self._fail(session, row.error)
            return
        self.stats.steps += row.steps_run
        session.step_in_chunk += row.steps_run
        session.boundary_ms += row.boundary_ms
        session.denoise_ms += row.denoise_ms
        session.step_calls.extend(row.step_calls)
        if row.chunk is None:
            return
        chunk = row.chunk
        events = session.chunk_events
        self.send(
            ChunkReady(
                session_id=session.session_id,
                generation_chunk_index=session.chunk_index,
                num_frames=chunk.num_frames,
                first_frame_index=session.frames_done,
                media_start_seconds=session.media_seconds_done,
                width=chunk.width,
                height=chunk.height,
                started_event_ids=events.started,
                active_event_ids=events.active,
                completed_event_ids=events.completed,
                timing=ChunkTiming(
                    boundary_ms=session.boundary_ms,
                    denoise_ms=session.denoise_ms,
                    decode_ms=row.decode_ms,
                    steps=session.step_in_chunk,
                    runner_calls=tuple(session.step_calls),
                ),
                payload=chunk.payload,
            )
        )
        self.stats.chunks += 1
        if session.first_emit_at is None:
            session.first_emit_at = self.clock()
        self.control.chunk_finished(session.session_id)
        session.frames_done += chunk.num_frames
        session.chunks_done += 1
        if session.is_last_chunk(session.chunk_index):
            session.finish("completed")
        else:
            session.phase = Phase.BOUNDARY
        session.chunk_index += 1
        session.step_in_chunk = 0

    def _end(self, sid: str) -> None:
        """The runner released a finishing session: say so, with its replay log."""
        session = self.sessions.pop(sid)
        message = "the session ended before this interaction reached a chunk boundary"
        self._reject_leftovers(sid, "session_ended", message)
        reason = session.end_reason or "completed"
        self.send(
            SessionDone(
                session_id=sid,
                chunks=session.chunks_done,
                frames=session.frames_done,
                stopped=reason != "completed",
                reason=reason,
                applied=tuple(session.applied),
            )
        )

    def _fail(self, session: EngineSession, error: str) -> None:
        sid = session.session_id
        self.sessions.pop(sid, None)
        message = f"the session failed before this interaction reached a chunk boundary: {error}"
        self._reject_leftovers(sid, "session_failed", message)
        self.send(SessionFailed(session_id=sid, code="pipeline_error", message=error))

    def _reject_leftovers(self, sid: str, code: str, message: str) -> None:
        """Reject what the session's mailbox still holds; before the session's
        last message, which ends its stream."""
        for left in self.control.unregister(sid):
            self._reject(sid, left.event_id, code, message)

    def _reject(self, sid: str, event_id: str, code: str, message: str) -> None:
        self.send(InteractionRejected(session_id=sid, event_id=event_id, code=code, message=message))
