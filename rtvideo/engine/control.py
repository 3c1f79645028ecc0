"""The worker's control plane: admission, mailboxes, and the loop's inbox.

Lives in worker rank 0 and is shared by two threads:

- the control-receiver thread calls ``handle`` for every message off the RPC
  queue, the moment it arrives, even while the loop thread is inside a
  pipeline call. Starts are admitted (or refused) and interactions land in
  their session's mailbox right here, and are acknowledged at once;
- the loop thread calls ``drain`` / ``wait`` for the structural messages
  (admitted starts, stops, probes, shutdown), ``pacing_state`` for the
  playheads its pacing decides on, and ``boundary`` at a session's chunk
  boundary.

It keeps, per session, the mailbox, the playhead (and delivered position)
and the stop flag, and nothing of the session's progress: that is the loop's
(``rtvideo.engine.session.EngineSession``), which the loop hands over when it takes
the session (``attach``) and advances only under this lock, with the
mailbox's take (``boundary``); ``InteractionQueued`` reads it there.

One lock guards everything. Whatever may change what the loop would do next
(a message for its inbox, a playback report) bumps a wake-up count under the
lock; the loop reads the count together with the playheads, and ``wait``
returns at once if it moved since, so a report that arrives between the
loop's pacing decision and its wait is never lost. Acknowledgements that
depend on mailbox state are sent while holding it, so the client always sees
``queued`` before ``applied``/``superseded`` of the same event.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from rtvideo.engine.chunk_cost import ChunkCostModel, SessionLoad, chunk_media_s, realtime_load
from rtvideo.engine.config import EngineConfig
from rtvideo.engine.limits import MAX_INPUT_CHUNKS_AHEAD
from rtvideo.engine.mailbox import InteractionMailbox, OfferStatus, PendingInteraction
from rtvideo.engine.messages import (
    ControlMessage,
    Delivered,
    InteractionQueued,
    InteractionRejected,
    InteractionSuperseded,
    Playback,
    Probe,
    ResultMessage,
    SessionGeometry,
    SessionRejected,
    SessionStarted,
    Shutdown,
    StartSession,
    StopSession,
    SubmitInput,
    SubmitInteraction,
)
from rtvideo.engine.pacing import Playhead
from rtvideo.engine.session import chunk_frames
from rtvideo.engine.validation import check_interaction, check_start


class Progress(Protocol):
    """What the control plane reads of a session's progress: the loop's record
    (``rtvideo.engine.session.EngineSession``), read under the lock."""

    @property
    def next_chunk(self) -> int:
        """The chunk whose boundary has not been taken yet."""
        ...

    @property
    def in_progress(self) -> int | None:
        """The newest chunk begun while it is not committed, None between chunks."""
        ...


class Fault(NamedTuple):
    """Why the control plane failed a session: ``SessionFailed``'s code and message."""

    code: str
    message: str


@dataclass
class SessionInputs:
    """A video-to-video session's input frames (``SubmitInput``) that came and
    wait for their chunk's boundary (guarded by the lock; ``next_chunk`` is read
    lock-free by the loop: an int is read whole)."""

    next_chunk: int = 0  # the chunk whose frames come next: frames of chunks before it came
    frames: dict[int, SubmitInput] = field(default_factory=dict)  # by chunk, until its boundary takes them


@dataclass
class SessionControl:
    """What the control plane knows of one admitted session (guarded by the lock)."""

    start: StartSession
    geometry: SessionGeometry
    mailbox: InteractionMailbox
    stop_reason: str | None = None  # the stop flag: a stop came, with this reason
    playback_s: float | None = None
    delivered_s: float | None = None  # media written to the client's socket, as the API process reported
    progress: Progress | None = None  # the loop's record, once it took the session (``attach``); None: none begun
    inputs: SessionInputs | None = None  # video to video: its input frames; None: opened without an input
    fault: Fault | None = None  # the session failed here (bad input frames); the loop ends it

    def boundary_marks(self) -> tuple[int | None, int]:
        """The chunk in progress (None between chunks) and the next chunk whose
        boundary is still to come: an interaction accepted now lands there."""
        if self.progress is None:
            return None, 0
        return self.progress.in_progress, self.progress.next_chunk


class ControlPlane:
    def __init__(
        self,
        config: EngineConfig,
        describe: Callable[[StartSession], SessionGeometry],
        send: Callable[[ResultMessage], None],
        memory_budget: int | None = None,
        costs: ChunkCostModel | None = None,
        max_pixels: int | None = None,
        pixels_derived: bool = False,
    ) -> None:
        """``memory_budget``: bytes of memory the sessions' state may hold (None:
        unlimited). ``costs``: what a chunk costs, for admission by chunk cost
        (``config.max_realtime_load``; None: not checked). ``max_pixels``: the
        largest width x height admitted (None: any the pipeline takes);
        ``pixels_derived`` says it was measured, not configured (the refusal says
        which)."""
        self._config = config
        self._memory_budget = memory_budget
        self._costs = costs
        self._max_pixels = max_pixels
        self._pixels_derived = pixels_derived
        self._describe = describe
        self._send = send
        self._lock = threading.Lock()
        self._inbox_ready = threading.Condition(self._lock)
        self._inbox: deque[ControlMessage] = deque()
        self._wakeups = 0  # bumped with every notify: what arrived for the loop since it last looked
        self._sessions: dict[str, SessionControl] = {}
        self._shutdown_reason: str | None = None  # a Shutdown came: every session stops, with this reason
        self._handlers: dict[type, Callable] = {
            StartSession: self._on_start,
            SubmitInteraction: self._on_interaction,
            SubmitInput: self._on_input,
            Playback: self._on_playback,
            Delivered: self._on_delivered,
            StopSession: self._on_stop,
            Probe: self._to_inbox,
            Shutdown: self._on_shutdown,
        }

    # ------------------------------------------------------------------
    # Receiver thread
    # ------------------------------------------------------------------

    def handle(self, message: ControlMessage) -> None:
        """Dispatch one control message by type (receiver thread)."""
        with self._lock:
            self._handlers[type(message)](message)

    def _on_start(self, start: StartSession) -> None:
        sid = start.session_id
        if self._shutdown_reason is not None:
            return self._reject(sid, "shutting_down", "the server is shutting down")
        if sid in self._sessions:
            return self._reject(sid, "duplicate_session", f"session {sid!r} is already open")
        if len(self._sessions) >= self._config.max_sessions:
            limit = self._config.max_sessions
            return self._reject(sid, "server_full", f"server full: max_sessions={limit} are open")
        try:
            check_start(start)
            geometry = self._describe(start)
        except ValueError as error:
            return self._reject(sid, "invalid_request", str(error))
        except Exception as error:  # a pipeline's describe must never take the control thread down
            return self._reject(sid, "invalid_request", f"{type(error).__name__}: {error}")
        if self._max_pixels is not None and geometry.width * geometry.height > self._max_pixels:
            return self._reject(sid, "invalid_request", self._pixels_message(geometry))
        if self._memory_budget is not None and geometry.state_bytes > self._memory_budget:
            # Never fits, even alone: asking again later would not help.
            return self._reject(sid, "invalid_request", self._memory_message(geometry, "too large: "))
        if not self._fits(geometry):
            return self._reject(sid, "server_full", self._memory_message(geometry, "server full: "))
        if (why := self._over_load(start, geometry)) is not None:
            return self._reject(sid, "server_full", why)
        mailbox = InteractionMailbox(start.transition_chunks, start.scheduled, time.monotonic())
        delivered = 0.0 if start.reports_delivery else None  # a reported session: nothing written until it says
        inputs = None if start.input is None else SessionInputs()
        self._sessions[sid] = SessionControl(start, geometry, mailbox, delivered_s=delivered, inputs=inputs)
        self._send(SessionStarted(session_id=sid, geometry=geometry))
        self._to_inbox(start)

    def _on_interaction(self, submit: SubmitInteraction) -> None:
        sid, eid = submit.session_id, submit.event_id
        control = self._sessions.get(sid)
        if control is None:
            return self._reject_interaction(sid, eid, "unknown_session", f"no open session {sid!r}")
        if control.stop_reason is not None:
            return self._reject_interaction(sid, eid, "session_ended", "the session is stopping")
        try:
            check_interaction(submit.interaction)
        except ValueError as error:
            return self._reject_interaction(sid, eid, "invalid_interaction", str(error))
        in_progress, expected = control.boundary_marks()
        last = control.geometry.num_chunks
        if last is not None and expected >= last:
            message = f"the last chunk ({last - 1}) has already begun"
            return self._reject_interaction(sid, eid, "interaction_too_late", message)
        offer = control.mailbox.offer(eid, submit.interaction, time.monotonic())
        if offer.status is OfferStatus.CONFLICT:
            message = f"event_id {eid!r} was already used with a different body"
            return self._reject_interaction(sid, eid, "event_id_conflict", message)
        if offer.superseded is not None:
            old = offer.superseded.event_id
            self._send(InteractionSuperseded(session_id=sid, event_id=old, by_event_id=eid))
        self._send(
            InteractionQueued(
                session_id=sid,
                event_id=eid,
                in_progress_chunk_index=in_progress,
                expected_chunk_index=expected,
                duplicate=offer.status is OfferStatus.DUPLICATE,
            )
        )

    def _on_input(self, submit: SubmitInput) -> None:
        """A chunk's input frames: kept for its boundary, or, when they are not
        what the session takes, the session fails (``invalid_input``, naming the
        fault; the loop ends it). Frames for a session not open or stopping, or
        past its last chunk, are dropped: nothing would read them."""
        control = self._sessions.get(submit.session_id)
        if control is None or control.stop_reason is not None or control.fault is not None:
            return
        last = control.geometry.num_chunks
        if last is not None and submit.chunk_index >= last:
            return
        fault = self._input_fault(submit, control)
        if fault is not None:
            control.fault = Fault(code="invalid_input", message=f"session {submit.session_id}: {fault}")
            if control.inputs is not None:
                control.inputs.frames.clear()
            self._wake()
            return
        control.inputs.frames[submit.chunk_index] = submit
        control.inputs.next_chunk += 1
        self._wake()

    def _input_fault(self, submit: SubmitInput, control: SessionControl) -> str | None:
        """What is wrong with ``submit`` for this session, or None."""
        index, inputs, g = submit.chunk_index, control.inputs, control.geometry
        if inputs is None:
            return f"input frames for chunk {index}, but the session was opened without an input: it takes no frames"
        if index != inputs.next_chunk:
            said = "already came" if 0 <= index < inputs.next_chunk else "came out of order"
            return f"input frames for chunk {index} {said}: chunk {inputs.next_chunk}'s come next"
        begun = 0 if control.progress is None else control.progress.next_chunk
        if index - begun >= MAX_INPUT_CHUNKS_AHEAD:
            return (
                f"input frames for chunk {index} came {index - begun} chunks ahead of the chunk about to begin "
                f"({begun}); at most {MAX_INPUT_CHUNKS_AHEAD} chunks of input may wait"
            )
        count = chunk_frames(g, index)
        if submit.count != count or (submit.height, submit.width) != (g.height, g.width):
            return (
                f"chunk {index} takes {count} input frames of {g.width}x{g.height} "
                f"([{count}, {g.height}, {g.width}, 3]), got {submit.count} of {submit.width}x{submit.height}"
            )
        size = submit.count * submit.height * submit.width * 3
        if len(submit.frames) != size:
            return (
                f"chunk {index}'s input frames are {len(submit.frames)} bytes; {submit.count} uint8 RGB frames "
                f"of {submit.width}x{submit.height} are {size}"
            )
        return None

    def _on_playback(self, playback: Playback) -> None:
        control = self._sessions.get(playback.session_id)
        if control is not None:
            control.playback_s = playback.position_seconds
            self._wake()

    def _on_delivered(self, delivered: Delivered) -> None:
        control = self._sessions.get(delivered.session_id)
        if control is not None:
            control.delivered_s = delivered.media_seconds
            self._wake()

    def _on_stop(self, stop: StopSession) -> None:
        control = self._sessions.get(stop.session_id)
        if control is not None and control.stop_reason is None:
            control.stop_reason = stop.reason
            self._to_inbox(stop)

    def _on_shutdown(self, shutdown: Shutdown) -> None:
        if self._shutdown_reason is None:
            self._shutdown_reason = shutdown.reason
        self._to_inbox(shutdown)

    def _held_bytes(self) -> int:
        return sum(session.geometry.state_bytes for session in self._sessions.values())

    def _fits(self, geometry: SessionGeometry) -> bool:
        return self._memory_budget is None or self._held_bytes() + geometry.state_bytes <= self._memory_budget

    def _memory_message(self, geometry: SessionGeometry, prefix: str) -> str:
        free = max(0, self._memory_budget - self._held_bytes())
        return (
            f"{prefix}a {geometry.width}x{geometry.height} session needs {_size(geometry.state_bytes)} of "
            f"device memory; {_size(free)} of the {_size(self._memory_budget)} for sessions is free"
        )

    def _pixels_message(self, geometry: SessionGeometry) -> str:
        w, h = geometry.width, geometry.height
        why = (
            f"the largest frame it measured to make a chunk within {self._config.max_realtime_load or 1:g} "
            "of the chunk's media time (max_pixels sets another bound)"
            if self._pixels_derived
            else "max_pixels"
        )
        return f"width x height: {w}x{h} is {w * h} pixels; this server takes at most {self._max_pixels} ({why})"

    def _load(self, start: StartSession, geometry: SessionGeometry) -> SessionLoad:
        encode = start.input is not None  # video to video: its frames' encode too (at strength 1 an upper bound)
        cost = self._costs.estimate(geometry.width, geometry.height, geometry.num_inference_steps, encode)
        return SessionLoad(cost or 0.0, chunk_media_s(geometry), paced=start.max_lead_seconds is not None)

    def _over_load(self, start: StartSession, geometry: SessionGeometry) -> str | None:
        """Why admitting this session would break the paced sessions' deadlines
        (``rtvideo.engine.chunk_cost.realtime_load`` over ``max_realtime_load``), or None.
        A session alone is always admitted: it has no one else's deadline to break."""
        limit = self._config.max_realtime_load
        if limit is None or self._costs is None or not self._sessions:
            return None
        new = self._load(start, geometry)
        loads = [self._load(c.start, c.geometry) for c in self._sessions.values()]
        load = realtime_load([*loads, new])
        if load <= limit:
            return None
        return (
            f"server full: a {geometry.width}x{geometry.height} chunk takes about {new.chunk_s:.3f} s of the "
            f"worker for {new.media_s:.3f} s of media; with the {len(loads)} open session(s) the realtime ones "
            f"would need {load:.2f} of the worker's time, over the {limit:g} it keeps them to (max_realtime_load)"
        )

    def _to_inbox(self, message: ControlMessage) -> None:
        self._inbox.append(message)
        self._wake()

    def wake(self) -> None:
        """Wake the loop's ``wait`` from another thread: the executor calls it when
        a micro-step's result is ready (the wake-up count carries it, so it is
        never lost)."""
        with self._lock:
            self._wake()

    def _wake(self) -> None:
        self._wakeups += 1
        self._inbox_ready.notify()

    def _reject(self, sid: str, code: str, message: str) -> None:
        self._send(SessionRejected(session_id=sid, code=code, message=message))

    def _reject_interaction(self, sid: str, eid: str, code: str, message: str) -> None:
        self._send(InteractionRejected(session_id=sid, event_id=eid, code=code, message=message))

    # ------------------------------------------------------------------
    # Loop thread
    # ------------------------------------------------------------------

    def drain(self) -> list[ControlMessage]:
        """Every structural message received since the last drain, in order."""
        with self._lock:
            messages = list(self._inbox)
            self._inbox.clear()
        return messages

    def pacing_state(self) -> tuple[int, dict[str, Playhead]]:
        """The wake-up count and every session's last reported playhead and
        delivered position, read together: the loop decides its pacing on these
        and hands the count to ``wait``."""
        with self._lock:
            playheads = {sid: Playhead(c.playback_s, c.delivered_s) for sid, c in self._sessions.items()}
            return self._wakeups, playheads

    def wait(self, seen: int, timeout: float | None = None) -> bool:
        """Block until the inbox has something or anything arrived after the
        ``pacing_state`` read that returned ``seen`` (so a playback report that
        came in between that read and this call returns at once), or until
        ``timeout`` passes. True when woken by something new, False on timeout."""
        with self._lock:
            return self._inbox_ready.wait_for(lambda: bool(self._inbox) or self._wakeups != seen, timeout)

    def attach(self, session_id: str, progress: Progress) -> None:
        """The loop took the session: from now on where an interaction lands is
        read from ``progress``, the loop's own record (under the lock)."""
        with self._lock:
            self._sessions[session_id].progress = progress

    @contextmanager
    def boundary(self, session_id: str) -> Iterator[InteractionMailbox]:
        """Hold the lock while the loop takes the session's mailbox at a chunk
        boundary and records the chunk begun (advancing its ``next_chunk``): an
        interaction accepted before is in this chunk, one accepted after is
        promised to the next, and its ``InteractionQueued`` says so."""
        with self._lock:
            yield self._sessions[session_id].mailbox

    def is_stopping(self, session_id: str) -> bool:
        """Whether a stop arrived for the session (read between denoise steps);
        one no longer open is stopping too.

        Lock-free on purpose, it runs once per denoise step: a dict lookup and
        an attribute read are atomic, and a stop seen one step late is fine.
        At shutdown every session is stopping: its work is abandoned too."""
        control = self._sessions.get(session_id)
        return control is None or control.stop_reason is not None or self._shutdown_reason is not None

    def stop_reason(self, session_id: str) -> str | None:
        """The session's stop flag: the reason of its stop, else the shutdown's,
        None while neither came (lock-free, as ``is_stopping``)."""
        control = self._sessions.get(session_id)
        reason = None if control is None else control.stop_reason
        return self._shutdown_reason if reason is None else reason

    def fault(self, session_id: str) -> Fault | None:
        """Why the control plane failed the session (bad input frames), else None;
        lock-free, as ``is_stopping``."""
        control = self._sessions.get(session_id)
        return None if control is None else control.fault

    def inputs_through(self, session_id: str) -> int | None:
        """Video to video: the chunks whose input frames came (chunks 0 .. n - 1),
        None for a session opened without an input; lock-free (an int read whole:
        frames that land after the read wake the loop's wait)."""
        control = self._sessions.get(session_id)
        inputs = None if control is None else control.inputs
        return None if inputs is None else inputs.next_chunk

    def take_input(self, session_id: str, chunk_index: int) -> SubmitInput | None:
        """The frames of chunk ``chunk_index``, handed to its boundary once (None:
        the session has no input, or they have not come)."""
        with self._lock:
            control = self._sessions.get(session_id)
            if control is None or control.inputs is None:
                return None
            return control.inputs.frames.pop(chunk_index, None)

    def unregister(self, session_id: str) -> list[PendingInteraction]:
        """Forget a session (its admission slot frees); returns what never applied."""
        with self._lock:
            control = self._sessions.pop(session_id, None)
            return [] if control is None else control.mailbox.drain()

    def geometry(self, session_id: str) -> SessionGeometry:
        with self._lock:
            return self._sessions[session_id].geometry

    def open_sessions(self) -> tuple[str, ...]:
        with self._lock:
            return tuple(self._sessions)

    @property
    def shutting_down(self) -> bool:
        with self._lock:
            return self._shutdown_reason is not None


def _size(n: int) -> str:
    for name, unit in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= unit:
            return f"{n / unit:.2f} {name}"
    return f"{n} B"
