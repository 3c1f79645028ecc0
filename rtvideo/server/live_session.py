"""A realtime session that outlives its connections, and its fan-out.

API process, asyncio. A ``LiveSession`` owns what a realtime session is in the
server: the engine handle, the output (one encoder: each chunk is encoded
once), the resume buffer of its newest chunks (``rtvideo.server.resume_buffer``), and
the connections attached to it (``rtvideo.server.realtime``), each a ``Viewer``:

- **controllers** steer it (interactions, playback, stop). The one that
  started it is controller ``c1`` and holds its ``resume_token``; a
  ``shared_control`` session takes further controllers (``c2``, ``c3``, ...)
  by its ``control_token``. Only chunks written to a controller's socket count
  as delivered, so the engine's pacing follows the controllers alone;
- **spectators** (by its ``watch_token``) get the same media from the next
  chunk on, and nothing they do reaches the engine. A spectator may ask for
  another format than the session's (``?watch=TOKEN&format=fmp4``): each such
  format is encoded once, by a ``rtvideo.server.rendition.Rendition``, for all of its
  viewers, on a task of its own. A session takes at most ``max_spectators``
  (one more is refused, ``too_many_spectators``).

Controllers' interactions pass a token bucket per session
(``max_interactions_per_s``, ``interaction_burst``): one past it is answered
``rate_limited`` here and never reaches the engine.

One task, the pump, turns engine results into events, each by its type (one
handler per result type, ``rtvideo.server.dispatch``): every chunk goes into
the buffer and to every viewer's own bounded outbox, the controllers' first
(never awaited, so a slow viewer holds nobody; every viewer of a format gets
the same chunk object, whose bytes its connection writes as they are); an
interaction's answer goes to the controller that sent it, its outcome
(applied, superseded) to every controller, naming the controller whose event
won; the end to everyone.

When the last controller's socket drops (no close, a close without a code, or
1001 going away; not stopped),
the session is **detached**: it is kept for ``resume_grace_s``, and what was
written counts as delivered, so pacing (``max_undelivered_seconds``) holds its
generation. A ``session.resume`` attaches a new connection as ``c1``:
``video.start`` again, then everything ``c1`` was sent after the chunk the
client names, in the order it was first sent: the chunks from the buffer, and
between them the results addressed to ``c1`` (``c1``'s answers and every
controller's outcomes, kept in a bounded log with the chunk they followed; a
result the lost socket did deliver may so arrive twice, by its ``event_id``),
then the live stream. Past the grace the session is stopped, reason
``abandoned``.

A session's end is owed to ``c1`` like its chunks: until its end (the last
event and the close) reached the client holding ``c1`` (written to its
socket, and the close frame answered where the server tells:
``rtvideo.server.realtime``), the session stays resumable by its resume
token, for at most ``resume_grace_s`` from when that connection dropped (a
session that ends while detached; a socket that drops with the end still
queued on it, or unanswered). A resume then gets what it missed, the end and
the close. Its watch and control tokens find nothing from the end on, and
its buffer is freed once the end reached ``c1`` or the grace is over
(``_forget``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from rtvideo.engine.client.engine_client import EngineClient
from rtvideo.engine.client.errors import EngineDeadError, UnknownSessionError
from rtvideo.engine.client.session_handle import SessionHandle
from rtvideo.engine.messages import (
    ENDED_BEFORE_BOUNDARY,
    ChunkReady,
    Interaction,
    InteractionApplied,
    InteractionQueued,
    InteractionRejected,
    InteractionSuperseded,
    ResultMessage,
    SessionDone,
    SessionFailed,
    VideoInput,
)
from rtvideo.server.dispatch import TypeDispatcher
from rtvideo.server.events import VideoStart
from rtvideo.server.metrics import Metrics
from rtvideo.server.output import SessionOutput, error_event
from rtvideo.server.prompt_policy import PromptPolicy, PromptRefused
from rtvideo.server.rate_limit import TokenBucket
from rtvideo.server.rendition import Rendition
from rtvideo.server.resume_buffer import BufferedChunk, ChunkBuffer, ResumeGapError
from rtvideo.server.session_registry import SessionRegistry, new_token
from rtvideo.server.settings import ServerSettings
from rtvideo.server.video_input import FrameError, InputFeeder

log = logging.getLogger(__name__)

PRIMARY = "c1"  # the controller that started the session; a resume attaches as it again
MAX_KEPT_EVENTS = 1000  # results for c1 kept for a resume
CLOSE_NORMAL, CLOSE_POLICY, CLOSE_ERROR, CLOSE_FULL = 1000, 1008, 1011, 1013


class Viewer(Protocol):
    """A connection attached to a session (``rtvideo.server.realtime.RealtimeConnection``).
    Every call queues and returns at once."""

    role: str  # controller or spectator
    controller_id: str | None
    format: str | None  # the media format it gets (None until attached: the session's)

    def send_event(self, event: dict[str, Any]) -> None: ...

    def send_chunk(self, chunk: BufferedChunk) -> None: ...

    def session_ended(self, close_code: int, reason: str) -> None: ...

    def drop_slow(self, why: str) -> None:
        """Close it as a slow client (``slow_client: why``)."""


class Refused(Exception):
    """A connection the session cannot take: its error ``code``, ``message`` and
    the close code its socket gets (1013: it may succeed later)."""

    def __init__(self, code: str, message: str, close_code: int = CLOSE_POLICY) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.close_code = close_code


class JoinRefused(Refused):
    """A spectator's or controller's join cannot be served."""


class ResumeRefused(Refused):
    """A ``session.resume`` cannot be served."""


class LiveSession:
    def __init__(
        self,
        handle: SessionHandle,
        output: SessionOutput,
        engine: EngineClient,
        settings: ServerSettings,
        metrics: Metrics,
        registry: SessionRegistry,
        shared_control: bool = False,
        on_end: Callable[[], Awaitable[None]] | None = None,
        video_input: VideoInput | None = None,
        prompt_policy: PromptPolicy | None = None,
    ) -> None:
        self.handle = handle
        self.prompt_policy = prompt_policy
        self.output = output
        self.engine = engine
        self.settings = settings
        self.metrics = metrics
        self.registry = registry
        self.on_end = on_end
        self.request_id = output.request_id
        self.session_id = handle.session_id
        self.resume_token = new_token()
        self.watch_token = new_token()
        self.control_token = new_token() if shared_control else None
        self.viewers: list[Viewer] = []
        self.format = output.config.format  # the session's own: its controllers' and its buffer's
        self.renditions: dict[str, Rendition] = {}  # the other formats its spectators watch in
        self.buffer = ChunkBuffer(settings.resume_buffer_seconds)
        # Results addressed to c1, each with the newest chunk sent before it, for a resume.
        self.kept: deque[tuple[int, dict[str, Any]]] = deque(maxlen=MAX_KEPT_EVENTS)
        self.ended = False
        self._final: tuple[dict[str, Any] | None, int, str] | None = None  # the end: event, close code, reason
        self._forgotten = False  # ended and nothing owed any more: its resume token finds nothing
        self._detached_counted = False  # counted in rtvideo_sessions_detached
        self._controller_ids = itertools.count(2)
        self._answer_to: dict[str, deque[str | None]] = {}  # event_id -> controllers awaiting its answer
        self._delivered_s = 0.0  # the furthest media written to a controller's socket
        self._counted = -1  # the newest chunk counted as delivered on /metrics
        self._grace: asyncio.Task | None = None
        self._abandoning = False  # the grace ran out: the session is being stopped as abandoned
        self._end_to: Viewer | None = None  # a resume taking this ended session's end to its client
        # Interactions from all its controllers together (max_interactions_per_s, interaction_burst).
        self._interactions = TokenBucket(settings.max_interactions_per_s, settings.interaction_burst, time.monotonic())
        # What a session's handle yields, by type: one entry per result.
        self._results: TypeDispatcher[Awaitable[None]] = TypeDispatcher(
            "LiveSession result",
            {
                ChunkReady: self._on_chunk,
                InteractionQueued: self._on_answer,
                InteractionRejected: self._on_answer,
                InteractionApplied: self._on_outcome,
                InteractionSuperseded: self._on_outcome,
                SessionFailed: self._on_failed,
                SessionDone: self._on_done,
            },
        )
        registry.add(self, {"resume": self.resume_token, "watch": self.watch_token, "control": self.control_token})
        metrics.sessions_active.inc()
        # Video to video: the controllers' binary frames, gathered into chunks and handed to the engine.
        self.input: InputFeeder | None = None
        self._input_task: asyncio.Task | None = None
        if video_input is not None:
            self.input = InputFeeder(video_input, handle, metrics, self._input_refused, output.config.num_chunks)
            self._input_task = asyncio.create_task(self._feed(), name=f"session-input-{self.request_id}")
        self._pump_task = asyncio.create_task(self._pump(), name=f"session-pump-{self.request_id}")
        self._limit_task = asyncio.create_task(self._duration_limit(), name=f"session-limit-{self.request_id}")

    # ------------------------------------------------------------------
    # attaching and leaving
    # ------------------------------------------------------------------

    def controllers(self) -> list[Viewer]:
        return [v for v in self.viewers if v.role == "controller"]

    @property
    def detached(self) -> bool:
        return self._grace is not None

    def video_start(self, viewer: Viewer, resumed: bool = False) -> dict[str, Any]:
        controller = viewer.role == "controller"
        config = self.output.config.wire()
        return VideoStart(
            request_id=self.request_id,
            format=viewer.format,
            config={**config, "format": viewer.format},
            role=viewer.role,
            controller_id=viewer.controller_id,
            resumed=True if resumed else None,
            resume_token=self.resume_token if viewer.controller_id == PRIMARY else None,
            watch_token=self.watch_token if controller else None,
            control_token=self.control_token if controller else None,
        ).wire()

    def attach_first(self, viewer: Viewer) -> None:
        """The connection that started the session: controller ``c1``."""
        viewer.controller_id = PRIMARY
        viewer.format = self.format
        viewer.send_event(self.video_start(viewer))
        self._add(viewer)

    def resume(self, viewer: Viewer, last_chunk_index: int) -> None:
        """Attach ``viewer`` as ``c1`` again, sending what it missed (and the end,
        when the session has ended since); ``ResumeRefused`` when it cannot: also
        once the grace is over and the session is being abandoned, and while
        another resume is taking an ended session's end to its client."""
        if self._forgotten:
            raise ResumeRefused("unknown_resume_token", "the session has ended")
        if self._abandoning:
            raise ResumeRefused("unknown_resume_token", "the session was abandoned: no resume within resume_grace_s")
        if any(v.controller_id == PRIMARY for v in self.viewers) or self._end_to is not None:
            raise ResumeRefused(
                "resume_token_in_use",
                "another connection holds this session's resume_token (if it was yours and just dropped, "
                "the server has not noticed yet: try again)",
            )
        try:
            missed = self.buffer.after(last_chunk_index)
        except ResumeGapError as error:
            raise ResumeRefused("resume_gap", str(error)) from None
        viewer.controller_id = PRIMARY
        viewer.format = self.format
        viewer.send_event(self.video_start(viewer, resumed=True))
        events = [(after, event) for after, event in self.kept if after >= last_chunk_index]
        for chunk in missed:
            while events and events[0][0] < chunk.index:
                viewer.send_event(events.pop(0)[1])
            viewer.send_chunk(chunk)
        for _, event in events:
            viewer.send_event(event)
        log.info("session %s resumed after chunk %d (%d chunks resent)", self.request_id, last_chunk_index, len(missed))
        if self._final is None:
            self._add(viewer)
            return
        event, close_code, reason = self._final  # it ended meanwhile: the end, and nothing after it
        self._end_to = viewer  # c1 again until its connection is over (``connection_finished``)
        if event is not None:
            viewer.send_event(event)
        viewer.session_ended(close_code, reason)

    def join(self, viewer: Viewer) -> None:
        """A spectator (``watch_token``) or a further controller (``control_token``):
        it gets the chunks from the next one on, a spectator in its own ``format``
        if it asked for one (None: the session's). ``JoinRefused`` when that
        format cannot carry this session's frames, or when a spectator would be
        one more than ``max_spectators``."""
        limit = self.settings.max_spectators
        if viewer.role == "spectator" and sum(v.role == "spectator" for v in self.viewers) >= limit:
            message = (
                f"this session has {limit} spectators, the most it takes (max_spectators = {limit}); "
                "try again when one has left"
            )
            raise JoinRefused("too_many_spectators", message, CLOSE_FULL)
        wanted = viewer.format or self.format
        if wanted != self.format and wanted not in self.renditions:
            c = self.output.config
            try:
                self.renditions[wanted] = Rendition(
                    wanted,
                    c.width,
                    c.height,
                    c.fps,
                    viewers=lambda fmt=wanted: [v for v in self.viewers if v.format == fmt],
                    on_too_slow=lambda why, fmt=wanted: self._rendition_gave_up(fmt, why),
                )
            except ValueError as error:
                raise JoinRefused("invalid_request", f"format: {error}") from None
        viewer.format = wanted
        viewer.controller_id = f"c{next(self._controller_ids)}" if viewer.role == "controller" else None
        viewer.send_event(self.video_start(viewer))
        self._add(viewer)

    def _rendition_gave_up(self, fmt: str, why: str) -> None:
        self.renditions.pop(fmt, None)
        for viewer in [v for v in self.viewers if v.format == fmt]:
            viewer.drop_slow(why)

    def _add(self, viewer: Viewer) -> None:
        self.viewers.append(viewer)
        self.metrics.viewers.labels(viewer.role).inc()
        if viewer.role == "controller" and self._grace is not None:
            self._grace.cancel()
            self._grace = None
            self._count_detached(False)

    def _count_detached(self, detached: bool) -> None:
        if detached != self._detached_counted:
            self._detached_counted = detached
            self.metrics.sessions_detached.inc() if detached else self.metrics.sessions_detached.dec()

    def only_controller(self, viewer: Viewer) -> bool:
        return self.controllers() == [viewer]

    async def leave(self, viewer: Viewer, why: str) -> None:
        """``viewer``'s connection is over. ``why`` ``dropped``: its socket went as a
        drop (a last controller leaves the session detached);
        anything else ends the session when no controller is left, with ``why``
        as its reason."""
        if viewer not in self.viewers:
            return
        self.viewers.remove(viewer)
        self.metrics.viewers.labels(viewer.role).dec()
        rendition = self.renditions.get(viewer.format)
        if rendition is not None and not any(v.format == viewer.format for v in self.viewers):
            del self.renditions[viewer.format]  # nobody watches in it any more
            rendition.close()
        if viewer.role != "controller" or self.ended or self.controllers():
            return
        if why != "dropped":
            await self.stop(why)
            return
        self._count_detached(True)
        self._start_grace()
        log.info("session %s detached: kept %g s for a resume", self.request_id, self.settings.resume_grace_s)
        # What was written counts as delivered (also when nothing was yet), so the
        # engine's max_undelivered_seconds holds generation until a client is back.
        with contextlib.suppress(EngineDeadError, UnknownSessionError):
            await self.engine.delivered(self.session_id, self._delivered_s)

    def _start_grace(self) -> None:
        """``resume_grace_s`` from now, for a resume of ``c1`` (``_abandon_after``)."""
        self._grace = asyncio.create_task(self._abandon_after(), name=f"session-grace-{self.request_id}")

    async def _abandon_after(self) -> None:
        """The grace: past it a detached session is stopped (``abandoned``), and an
        ended one whose end ``c1`` never got is forgotten."""
        await asyncio.sleep(self.settings.resume_grace_s)
        self._grace = None  # over: nothing is owed to c1 past it
        if self.ended:
            log.info("session %s: its end was not resumed within %g s", self.request_id, self.settings.resume_grace_s)
            self._forget()
            return
        log.info("session %s abandoned: no resume within %g s", self.request_id, self.settings.resume_grace_s)
        self._abandoning = True  # before the stop's wait: a resume meanwhile is refused, not let in to its end
        await self.stop("abandoned")

    def connection_finished(self, viewer: Viewer, end_reached: bool) -> None:
        """``viewer``'s connection is over (``end_reached``: the session's end and
        the close reached its client). For ``c1`` of an ended session that is what
        it was owed: the session is forgotten; otherwise its end waits for a
        resume, ``resume_grace_s`` at most."""
        if viewer is self._end_to:
            self._end_to = None  # its resume is over: the end reached it, or a later resume may take it
        if viewer.controller_id != PRIMARY or not self.ended or self._forgotten:
            return
        if end_reached:
            self._forget()
        elif self._grace is None:
            self._start_grace()

    def _forget(self) -> None:
        """Nothing is owed to anyone any more: the resume token finds nothing, the
        buffer and the kept results are freed, a running grace ends."""
        self._forgotten = True
        self.registry.remove(self)
        if self._grace is not None:
            self._grace.cancel()
            self._grace = None
        self.kept.clear()
        self.buffer.clear()  # now, not when the cyclic collector gets to this object
        if self.input is not None:
            self.input.release()  # its frames waiting and its decoder's pictures, now too

    # ------------------------------------------------------------------
    # what controllers do
    # ------------------------------------------------------------------

    async def stop(self, reason: str) -> None:
        with contextlib.suppress(EngineDeadError, UnknownSessionError):
            await self.engine.stop(self.session_id, reason)

    async def interact(self, viewer: Viewer, event_id: str, interaction: Interaction) -> None:
        """Hand a controller's interaction to the engine, unless the session sent more than
        ``max_interactions_per_s`` allows: then ``viewer`` gets ``error{code: "rate_limited"}``
        (kept for a resume like any answer to it), nothing is queued, and the session goes on;
        or unless the prompt policy refuses its prompt: ``error{code: "prompt_refused"}``, the same way.
        A policy's check holds this connection's later messages until it answers (in order:
        ``prompt_policy_timeout_s`` at most)."""
        wait = self._interactions.take(time.monotonic())
        if wait is not None:
            self.metrics.interactions.labels("rejected").inc()
            rate, burst = self.settings.max_interactions_per_s, self.settings.interaction_burst
            message = (
                f"too many interactions: this session takes at most {rate:g} per second "
                f"(max_interactions_per_s), {burst} at once (interaction_burst); this one was not queued: "
                f"send it again in {wait:.2f} s or later"
            )
            event = error_event("rate_limited", message, request_id=self.request_id, event_id=event_id)
            return self._to_controller(viewer.controller_id, event)
        if self.prompt_policy is not None:
            try:
                await self.prompt_policy.check({"interaction.event.prompt": interaction.prompt})
            except PromptRefused as refused:
                self.metrics.interactions.labels("rejected").inc()
                self.metrics.prompts_refused.labels("interaction").inc()
                event = error_event("prompt_refused", str(refused), request_id=self.request_id, event_id=event_id)
                return self._to_controller(viewer.controller_id, event)
        self.output.senders.setdefault(event_id, viewer.controller_id)
        self._answer_to.setdefault(event_id, deque()).append(viewer.controller_id)
        try:
            await self.engine.interact(self.session_id, event_id, interaction)
        except UnknownSessionError:  # the session's end has come from the engine, not yet to its viewers
            self._answer(event_id)  # no answer will come from the engine
            self.metrics.interactions.labels("rejected").inc()
            event = error_event("session_ended", ENDED_BEFORE_BOUNDARY, request_id=self.request_id, event_id=event_id)
            self._to_controller(viewer.controller_id, event)

    async def playback(self, position_seconds: float) -> None:
        """A controller's playhead (pacing); not answered, also after the session's end."""
        self.output.clock.playhead = position_seconds
        await self.engine.playback(self.session_id, position_seconds)

    def input_frame(self, data: bytes, received_at: float) -> dict[str, Any] | None:
        """A controller's binary frame (the session has an ``input``): taken, or the
        ``error`` event (``invalid_input_frame``, naming the frame) for its sender."""
        try:
            self.input.receive(data, received_at)
        except FrameError as error:
            return self._frame_error(error)
        return None

    def _frame_error(self, error: FrameError) -> dict[str, Any]:
        return error_event("invalid_input_frame", str(error), request_id=self.request_id, frame_index=error.frame_index)

    def _input_refused(self, error: FrameError) -> None:
        """A frame refused as its chunk was gathered (a JPEG that does not decode, or
        of another size): every controller is told (any of them may have sent it)."""
        self._to_controllers(self._frame_error(error))

    async def _feed(self) -> None:
        """The input feeder's task: a failure here (a server bug) is logged and
        stops the session, whose end then reaches every viewer."""
        try:
            await self.input.run()
        except Exception:
            log.exception("session %s: its input failed in the server", self.request_id)
            await self.stop("server_error")

    async def written(self, viewer: Viewer, chunk: BufferedChunk) -> None:
        """``chunk`` was written to ``viewer``'s socket. A controller's counts as
        delivered: on /metrics once per chunk, and for the engine's pacing; with
        an input, each of its frames' latency from the input frame it came from."""
        if viewer.role != "controller":
            return
        if chunk.index > self._counted:
            self._counted = chunk.index
            frames = chunk.metadata["num_frames"]
            self.output.clock.chunk(chunk.metadata["media_start_seconds"], chunk.media_seconds, frames, chunk.compute_s)
            if self.input is not None:
                self.input.written(chunk.index, frames)
        if chunk.media_end_seconds > self._delivered_s:
            self._delivered_s = chunk.media_end_seconds
            with contextlib.suppress(EngineDeadError, UnknownSessionError):
                await self.engine.delivered(self.session_id, self._delivered_s)

    async def _duration_limit(self) -> None:
        await asyncio.sleep(self.settings.max_session_seconds)
        await self.stop("max_duration")

    # ------------------------------------------------------------------
    # results
    # ------------------------------------------------------------------

    async def _pump(self) -> None:
        """Engine results to every viewer, until the session ends. A failure here
        (a server bug: a result type without a handler is one, named in the log)
        fails the session: ``_fail_internally``."""
        try:
            async for message in self.handle:
                await self._result(message)
        except Exception:
            log.exception("session %s failed in the server", self.request_id)
            if not self.ended:
                await self._fail_internally()

    async def _result(self, message: ResultMessage) -> None:
        """One engine result, by its type (``_results``): ``UnhandledMessageError``
        for a type that is no session result (the pump then fails the session)."""
        await self._results(message)

    async def _on_chunk(self, message: ChunkReady) -> None:
        """Encode the chunk once, keep it for a resume and queue it on every viewer
        of the session's format (controllers first) and on each rendition. With an
        input, its metadata names the input frames it was made from and the frames
        dropped so far, and the next chunks' input may go to the engine."""
        taken = None
        if self.input is not None:
            self.input.made(message.generation_chunk_index)
            known = self.input.sent.get(message.generation_chunk_index)
            taken = (known.indexes if known is not None else (), self.input.dropped)
        chunk = await self.output.chunk(message, taken)
        if chunk is None:
            return
        buffered = BufferedChunk(
            index=message.generation_chunk_index,
            metadata=chunk.metadata,
            fragment=chunk.payload[chunk.init_length :],
            init=self.output.init_segment,
            compute_s=chunk.compute_s,
            fps=chunk.fps,
        )
        self.buffer.add(buffered)
        # Controllers first: their writers are woken first, so spectators never come before them.
        for viewer in sorted(self.viewers, key=lambda v: v.role != "controller"):
            if viewer.format == self.format:
                viewer.send_chunk(buffered)
        for rendition in self.renditions.values():
            rendition.offer(buffered.index, chunk.metadata, chunk.frames, chunk.compute_s)

    async def _on_answer(self, message: InteractionQueued | InteractionRejected) -> None:
        """An interaction's answer: to the controller that sent it."""
        self._to_controller(self._answer(message.event_id), self.output.event(message))

    async def _on_outcome(self, message: InteractionApplied | InteractionSuperseded) -> None:
        """An interaction's outcome: to every controller."""
        self._to_controllers(self.output.event(message))

    async def _on_failed(self, message: SessionFailed) -> None:
        event = self.output.event(message)
        log.warning("session %s failed: %s: %s", self.request_id, message.code, message.message)
        self._end("failed", event, CLOSE_ERROR, "generation failed")

    async def _on_done(self, message: SessionDone) -> None:
        self._end(message.reason, self.output.event(message), CLOSE_NORMAL, "session done")

    def _answer(self, event_id: str) -> str | None:
        """The controller an answer about ``event_id`` goes to: the one whose
        submission it answers (answers come in order), else the one that sent it first."""
        waiting = self._answer_to.get(event_id)
        if waiting:
            who = waiting.popleft()
            if not waiting:
                del self._answer_to[event_id]
            return who
        return self.output.senders.get(event_id)

    def _to_controller(self, controller_id: str | None, event: dict[str, Any]) -> None:
        if controller_id == PRIMARY:
            self._keep(event)
        for viewer in self.viewers:
            if viewer.controller_id == controller_id:
                viewer.send_event(event)
                return

    def _to_controllers(self, event: dict[str, Any]) -> None:
        self._keep(event)
        for viewer in self.controllers():
            viewer.send_event(event)

    def _keep(self, event: dict[str, Any]) -> None:
        """Log a result sent (or owed) to c1 for a resume; what no resume can ask for any more goes."""
        oldest = self.buffer.oldest
        while self.kept and oldest is not None and self.kept[0][0] < oldest - 1:
            self.kept.popleft()
        self.kept.append((self.buffer.newest, event))

    def _end(self, outcome: str, event: dict[str, Any] | None, close_code: int, reason: str) -> None:
        """The session is over: every viewer gets ``event`` and its close; its watch
        and control tokens find nothing from now. Its resume token finds it while
        ``c1`` is owed the end: c1 attached (until its connection says whether the
        end reached it, ``connection_finished``) or detached (the grace running)."""
        self.ended = True
        self._final = (event, close_code, reason)
        self.registry.keep_only(self, "resume")
        self.metrics.sessions_active.dec()
        self.metrics.sessions.labels(outcome).inc()
        self._count_detached(False)  # no longer a live session waiting; a resume may still collect its end
        self._limit_task.cancel()
        if self._input_task is not None:
            self._input_task.cancel()
        if self._grace is None and not any(v.controller_id == PRIMARY for v in self.viewers):
            self._forget()  # c1 left of its own accord (a stop, a close): nothing is owed
        log.info("session %s ended: %s", self.request_id, outcome)
        for viewer in list(self.viewers):
            if viewer.format != self.format and viewer.format in self.renditions:
                continue  # its rendition ends it, after the chunks still being encoded for it
            if event is not None:
                viewer.send_event(event)
            viewer.session_ended(close_code, reason)
        for rendition in self.renditions.values():
            rendition.end(event, close_code, reason)
        if self.on_end is not None:
            asyncio.create_task(self.on_end(), name=f"session-ended-{self.request_id}")

    async def _fail_internally(self) -> None:
        """A server bug in this session's pump: its viewers are told at once, the
        engine session is stopped, and its end is waited for so nothing is left behind."""
        message = "the server failed this session"
        failure = error_event("internal_error", message, request_id=self.request_id, fatal=True)
        for rendition in self.renditions.values():
            rendition.close()
        self.renditions.clear()
        for viewer in list(self.viewers):
            viewer.send_event(failure)
            viewer.session_ended(CLOSE_ERROR, "internal error")
        await self.stop("server_error")
        outcome = "failed"
        while not self.handle.finished:
            try:
                message = await self.handle.next(30.0)
            except TimeoutError:
                log.error("session %s did not end within 30 s of its stop", self.request_id)
                break
            if isinstance(message, SessionDone):
                outcome = message.reason
        self._end(outcome, None, CLOSE_ERROR, "internal error")

    async def close(self) -> None:
        """Wait for the pump (tests and shutdown)."""
        await asyncio.gather(self._pump_task, return_exceptions=True)
