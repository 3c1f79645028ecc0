"""``WS /v1/realtime/video``: one connection, attached to one realtime session.

API process, asyncio. The session itself (engine handle, encoder, resume
buffer, fan-out) is a ``rtvideo.server.live_session.LiveSession``, which outlives its
connections; this module is the connection side. A connection becomes one of:

- the session's first **controller**, by ``session.start`` (it starts one);
- its first controller again, by ``session.resume`` (after a drop);
- a further controller, by ``?control=TOKEN`` (a ``shared_control`` session);
- a **spectator**, by ``?watch=TOKEN``: read-only; ``&format=`` (``fmp4``,
  ``jpeg``, ``raw``) chooses its media format (default: the session's).

Per connection two tasks cooperate with the session's pump:

- the **reader** validates client events (``rtvideo.server.schemas``) and hands
  interactions, playback positions and stops to the session, each by its type
  through its role's table (``rtvideo.server.dispatch``); bad input gets an
  ``error`` and, after the start, the session goes on;
- the **writer** is the only task that sends on the socket, so a
  ``video.chunk_metadata`` and its binary frame are never split.

The session queues events and chunks for the connection without waiting
(``send_event``, ``send_chunk``). The outbox between it and the writer is
bounded: it counts the bytes queued and not yet written to the socket (events
as their JSON text, chunks as metadata plus payload). A client whose backlog
passes ``max_outbox_bytes`` (an item reaching an empty outbox is always taken,
however large), or whose socket takes nothing for ``send_timeout_s`` while a
write waits, is a slow client: it is closed with 1008 and the reason
``slow_client: ...`` at once, without waiting for it to read
(``rtvideo.server.ws_protocol``), and what was queued for it is dropped. A
spectator is slow sooner: once more than ``max_undelivered_seconds`` of media
wait for it (nothing holds the session for a spectator). A slow
spectator is only dropped; a slow last controller ends its session
(``session.done`` reason ``slow_client``). Pacing (``max_undelivered_seconds``)
holds a lagging controller's session long before that; these limits are for a
client that stopped reading for good.

Leaving: ``session.stop`` and the stall limit end the session (the connection
waits for its ``session.done``); a socket of the last controller that goes as
a drop (``RESUMABLE_CLOSES``) detaches it (``LiveSession.leave``), to be
resumed within ``resume_grace_s``; any other close ends it
(``client_disconnected``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any

from pydantic import TypeAdapter, ValidationError
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from rtvideo.engine.client.engine_client import EngineClient
from rtvideo.engine.client.errors import (
    EngineDeadError,
    EngineRestartingError,
    SessionRejectedError,
    UnknownSessionError,
)
from rtvideo.engine.messages import Interaction
from rtvideo.server.auth import is_authorized, key_subprotocol
from rtvideo.server.dispatch import TypeDispatcher
from rtvideo.server.drain import Drainer
from rtvideo.server.events import SessionPong
from rtvideo.server.limits import (
    MAX_TEXT_MESSAGE_CHARS,
    MESSAGE_FLOOR_CHARS,
    TEXT_BURST_CHARS,
    TEXT_CHARS_PER_S,
    JsonLimitError,
    parse_json,
)
from rtvideo.server.live_session import PRIMARY, JoinRefused, LiveSession, ResumeRefused
from rtvideo.server.media import FORMATS
from rtvideo.server.metrics import Metrics, SessionClock
from rtvideo.server.output import SessionOutput, error_event
from rtvideo.server.prompt_policy import PromptPolicy, PromptRefused
from rtvideo.server.rate_limit import TokenBucket
from rtvideo.server.resume_buffer import BufferedChunk
from rtvideo.server.schemas import (
    CLIENT_EVENT_TYPES,
    ClientEvent,
    RequestError,
    SessionInteractionEvent,
    SessionPingEvent,
    SessionPlaybackEvent,
    SessionResumeEvent,
    SessionStartEvent,
    SessionStopEvent,
    check_input_message,
    describe_validation_error,
    resolve,
)
from rtvideo.server.session_registry import SessionRegistry
from rtvideo.server.settings import ServerSettings
from rtvideo.server.ws_protocol import CLOSE_ANSWERED, SEND_MEDIA
from rtvideo.server.ws_protocol import EXTENSION as CLOSE_NOW

log = logging.getLogger(__name__)
CLIENT_EVENTS: TypeAdapter = TypeAdapter(ClientEvent)

CLOSE_NORMAL, CLOSE_POLICY, CLOSE_TOO_BIG, CLOSE_ERROR, CLOSE_FULL = 1000, 1008, 1009, 1011, 1013
SLOW_CLIENT_GRACE_S = 10.0  # a slow client closed now has this long to read up to the close frame
STOP_WAIT_S = 30.0  # how long a stopping connection waits for its session's end
CLOSE_ANSWER_S = 10.0  # how long a controller's answer to the end's close frame is waited for
START_EXAMPLE = '{"type": "session.start", "prompt": "a red circle moving right"}'
"""A first message a client can send as it is; quoted by the errors of a first message that is no event."""
NO_EVENT = ("binary_not_supported", "invalid_message", "unknown_type")  # first-message errors that quote it
# How a socket that may come back goes: going away (a reload), a close without a
# code, no close at all (a network drop). Any other close (1000 done, 1009 too big,
# 1008 ...) ends the session when its last controller goes that way.
RESUMABLE_CLOSES = (1001, 1005, 1006)


def unknown_type_error(kind: Any) -> dict[str, Any]:
    """The ``error`` a client gets for an event of a type the server does not take."""
    return error_event("unknown_type", f"unknown message type {kind!r}; known: {', '.join(CLIENT_EVENT_TYPES)}")


class _Closed(Exception):
    """The client is gone (``code``: the close code it sent, 1005/1006 for none)."""

    def __init__(self, code: int | None = None) -> None:
        super().__init__(code)
        self.code = code


class _TooMuchText(Exception):
    """The client sent more than its budget allows: ``TEXT_CHARS_PER_S``, each
    message counting ``MESSAGE_FLOOR_CHARS`` at least (the burst spent)."""


@dataclass(frozen=True)
class Event:
    """A JSON text frame, serialised when queued (its size counts in the backlog)."""

    text: str

    @property
    def size(self) -> int:
        return len(self.text)


@dataclass(frozen=True)
class Media:
    """A ``video.chunk_metadata`` text frame and its binary frame, sent back to back.
    The payload is the session's (or rendition's) own bytes, shared by every viewer."""

    chunk: BufferedChunk
    with_init: bool  # the fmp4 init segment goes first (the connection's first chunk)
    metadata: bytes  # the connection's own video.chunk_metadata, UTF-8

    @property
    def parts(self) -> tuple[bytes, ...]:
        return (self.chunk.init, self.chunk.fragment) if self.with_init else (self.chunk.fragment,)

    @property
    def size(self) -> int:
        return len(self.metadata) + sum(len(part) for part in self.parts)


@dataclass(frozen=True)
class Close:
    code: int
    reason: str
    size = 0


class End:
    """The writer stops without closing (the connection is over)."""

    size = 0


END = End()
Outgoing = Event | Media | Close | End


class _Slow(Exception):
    """The client stopped taking what is written to it (see ``_too_slow``)."""


class RealtimeConnection:
    def __init__(
        self,
        websocket: WebSocket,
        engine: EngineClient,
        settings: ServerSettings,
        model: str,
        metrics: Metrics,
        drainer: Drainer,
        sessions: SessionRegistry | None = None,
        capacity: asyncio.Condition | None = None,
        prompt_policy: PromptPolicy | None = None,
    ) -> None:
        self.drainer = drainer
        self.prompt_policy = prompt_policy
        self.ws = websocket
        self.engine = engine
        self.settings = settings
        self.model = model
        self.metrics = metrics
        self.sessions: SessionRegistry = sessions if sessions is not None else SessionRegistry()
        self.capacity = capacity
        self.clock = SessionClock(metrics)
        self.outbox: asyncio.Queue[Outgoing] = asyncio.Queue()
        self.backlog = 0  # bytes queued in the outbox and not yet written to the socket
        self.backlog_s = 0.0  # media seconds of the chunks among them (a spectator's bound)
        self.slow: str | None = None  # why the client was closed as slow, once it was
        self._slow = asyncio.Event()
        self._ended = asyncio.Event()  # the session ended; its last events and the close are queued
        self._text = TokenBucket(TEXT_CHARS_PER_S, TEXT_BURST_CHARS, time.monotonic())  # a token a character
        self._writer: asyncio.Task | None = None
        self.session: LiveSession | None = None  # while attached
        self._written_to: LiveSession | None = None  # the session whose chunks the writer reports written
        self._close_written = False  # the writer wrote the close frame (after everything queued before it)
        # Viewer
        self.role = "controller"
        self.controller_id: str | None = None
        self.format: str | None = None  # the media format it gets; set when it attaches
        self.transport_index = 0  # chunks sent on this connection
        self._needs_init = True  # an fmp4 connection's first chunk carries the init segment
        self._delivering = False  # counted in the drainer's ``delivering`` (attached, close not yet written)
        # The first client event, by type: it starts or resumes a session; any other is refused.
        self._openers: TypeDispatcher[Awaitable[None]] = TypeDispatcher(
            "first client event",
            {SessionStartEvent: self._start, SessionResumeEvent: self._resume},
            on_unknown=self._start_required,
        )
        # The client events of an attached connection, by its role and the event's type.
        attached = {
            SessionPingEvent: self._pong,
            SessionStartEvent: self._already_started,
            SessionResumeEvent: self._already_started,
        }
        self._events_by_role: dict[str, TypeDispatcher[Awaitable[str | None]]] = {
            "controller": TypeDispatcher(
                "controller event",
                {
                    **attached,
                    SessionPlaybackEvent: self._playback,
                    SessionInteractionEvent: self._interaction,
                    SessionStopEvent: self._stop,
                },
                on_unknown=self._unknown_event,
            ),
            "spectator": TypeDispatcher(
                "spectator event",
                {
                    **attached,
                    SessionPlaybackEvent: self._spectator_playback,
                    SessionInteractionEvent: self._read_only_interaction,
                    SessionStopEvent: self._read_only,
                },
                on_unknown=self._unknown_event,
            ),
        }

    # ------------------------------------------------------------------
    # Viewer: what the session calls (each queues and returns at once)
    # ------------------------------------------------------------------

    def send_event(self, event: dict[str, Any]) -> None:
        self._send(event)

    def send_chunk(self, chunk: BufferedChunk) -> None:
        with_init, self._needs_init = self._needs_init and bool(chunk.init), False
        length = len(chunk.fragment) + (len(chunk.init) if with_init else 0)
        metadata = {**chunk.metadata, "transport_chunk_index": self.transport_index, "byte_length": length}
        self.transport_index += 1
        self._put(Media(chunk, with_init, json.dumps(metadata).encode()))

    def session_ended(self, close_code: int, reason: str) -> None:
        if not self._ended.is_set():
            self._put(Close(close_code, reason))
            self._ended.set()

    def drop_slow(self, why: str) -> None:
        self._too_slow(why)

    # ------------------------------------------------------------------

    async def serve(self) -> None:
        if not is_authorized(self.ws, self.settings.api_key):
            self.metrics.rejections.labels("unauthorized").inc()
            await self.ws.accept(subprotocol=key_subprotocol(self.ws))
            await self.ws.close(CLOSE_POLICY, "unauthorized: a valid API key is required")
            return
        await self.ws.accept(subprotocol=key_subprotocol(self.ws))
        writer = self._writer = asyncio.create_task(self._write_all(), name="ws-writer")
        try:
            await self._connect()
        except _Closed:
            pass
        except Exception:
            log.exception("realtime connection failed")
            self._send(error_event("internal_error", "the server failed this connection", fatal=True))
            self._put(Close(CLOSE_ERROR, "internal error"))
        finally:
            self.outbox.put_nowait(END)
            # The writer delivers what is queued (each write bounded by send_timeout_s) and stops.
            await asyncio.gather(writer, return_exceptions=True)
            self._writer = None  # a cancelled writer's traceback keeps the chunk it was writing
            if self._delivering:
                self.drainer.delivering -= 1
                self._delivering = False
            if self._written_to is not None:  # the client's answer may take a moment: the drainer is told first
                await self._capacity_freed()
                self._written_to.connection_finished(self, await self._end_reached_client())
            if self.slow is not None and CLOSE_NOW not in self.ws.scope.get("extensions", {}):
                with contextlib.suppress(Exception):  # another server: try an ordinary close, briefly
                    async with asyncio.timeout(1.0):
                        await self.ws.close(CLOSE_POLICY, f"slow_client: {self.slow}"[:123])

    async def _end_reached_client(self) -> bool:
        """Whether the session's end (its last event, then the close) reached the
        client: written to the socket, and, where the server tells
        (``rtvideo.close_answered``), answered by the client's close frame
        (waited for, ``CLOSE_ANSWER_S`` at most, only for the controller a
        resume would be owed the end)."""
        if not (self._ended.is_set() and self._close_written):
            return False
        answered = self.ws.scope.get("extensions", {}).get(CLOSE_ANSWERED, {}).get("answered")
        if answered is None or self.controller_id != PRIMARY:
            return True
        try:
            async with asyncio.timeout(CLOSE_ANSWER_S):
                return await asyncio.shield(answered)
        except TimeoutError:
            return False

    async def _connect(self) -> None:
        """Attach this connection to a session: by a token in the query, or by its first message."""
        query = self.ws.query_params
        watch, control, fmt = query.get("watch"), query.get("control"), query.get("format")
        if watch is not None and control is not None:
            message = "give at most one of the query parameters watch and control"
            return await self._fatal("invalid_request", message, CLOSE_POLICY)
        if fmt is not None and watch is None:
            message = "format: only a spectator (?watch=) chooses its format; a controller gets the session's"
            return await self._fatal("invalid_request", message, CLOSE_POLICY)
        if fmt is not None and fmt not in FORMATS:
            message = f"format: unknown {fmt[:40]!r}; known: {', '.join(FORMATS)}"
            return await self._fatal("invalid_request", message, CLOSE_POLICY)
        if watch is not None:
            session = self.sessions.find("watch", watch)
            if session is None:
                message = "watch: no live session has this watch token (wrong, or the session ended)"
                return await self._fatal("unknown_watch_token", message, CLOSE_POLICY)
            self.role, self.format = "spectator", fmt
            try:
                return await self._attached(session, session.join)
            except JoinRefused as refused:
                return await self._fatal(refused.code, refused.message, refused.close_code)
        if control is not None:
            session = self.sessions.find("control", control)
            if session is None:
                message = (
                    "control: no live session has this control token (wrong, or the session ended; "
                    "only a session started with shared_control: true gives one)"
                )
                return await self._fatal("unknown_control_token", message, CLOSE_POLICY)
            return await self._attached(session, session.join)
        first = await self._receive_first()
        if first is not None:
            await self._openers(first)

    async def _start(self, start: SessionStartEvent) -> None:
        if self.drainer.draining:
            return await self._fatal("shutting_down", "the server is shutting down", CLOSE_FULL)
        if (unavailable := self.engine.unavailable()) is not None:
            return await self._engine_unavailable(unavailable)
        request_id = f"rtv-{uuid.uuid4().hex}"
        defaults = self.engine.ready.defaults
        try:
            video_input = None if start.input is None else start.input.engine()
            engine_start, config = resolve(
                start, request_id, defaults, self.settings, self.model, video_input=video_input
            )
            check_input_message(video_input, self.settings)
        except RequestError as error:
            return await self._fatal("invalid_request", str(error), CLOSE_POLICY)
        if self.prompt_policy is not None:
            try:
                await self.prompt_policy.check({"prompt": start.prompt, "negative_prompt": start.negative_prompt})
            except PromptRefused as refused:
                self.metrics.prompts_refused.labels("start").inc()
                return await self._fatal("prompt_refused", str(refused), CLOSE_POLICY)
        try:
            handle = await self.engine.start_session(engine_start)
        except SessionRejectedError as error:
            code = CLOSE_FULL if error.code == "server_full" else CLOSE_POLICY
            return await self._fatal(error.code, error.message, code)
        except EngineDeadError as error:
            return await self._engine_unavailable(error)
        output = SessionOutput(request_id, config, self.metrics, self.clock)
        session = LiveSession(
            handle,
            output,
            self.engine,
            self.settings,
            self.metrics,
            self.sessions,
            shared_control=start.shared_control,
            on_end=self._capacity_freed,
            video_input=engine_start.input,
            prompt_policy=self.prompt_policy,
        )
        await self._attached(session, session.attach_first)

    async def _resume(self, event: SessionResumeEvent) -> None:
        session = self.sessions.find("resume", event.resume_token)
        if session is None or session.request_id != event.request_id:
            message = "no live session has this request_id and resume_token (wrong, or the session ended)"
            return await self._fatal("unknown_resume_token", message, CLOSE_POLICY)
        try:
            await self._attached(session, lambda viewer: session.resume(viewer, event.last_chunk_index))
        except ResumeRefused as refused:
            await self._fatal(refused.code, refused.message, refused.close_code)

    async def _capacity_freed(self) -> None:
        if self.capacity is not None:
            async with self.capacity:
                self.capacity.notify_all()

    async def _engine_unavailable(self, error: EngineDeadError) -> None:
        """No worker takes the session: 1013 (try again later) while a fresh one is
        starting, 1011 once the engine is dead for good."""
        close = CLOSE_FULL if isinstance(error, EngineRestartingError) else CLOSE_ERROR
        await self._fatal("engine_unavailable", str(error), close)

    # ------------------------------------------------------------------
    # attached
    # ------------------------------------------------------------------

    async def _attached(self, session: LiveSession, attach) -> None:
        """Attach (``attach(self)`` queues video.start and what this connection is
        owed), then serve the client until it or the session is done, and leave."""
        attach(self)
        if not self._delivering:
            self.drainer.delivering += 1
            self._delivering = True
        self.session = self._written_to = session
        reader = asyncio.create_task(self._reader(), name="ws-reader")
        slow = asyncio.create_task(self._slow.wait(), name="ws-slow")
        ended = asyncio.create_task(self._ended.wait(), name="ws-ended")
        try:
            done, _ = await asyncio.wait({reader, slow, ended}, return_when=asyncio.FIRST_COMPLETED)
            if ended in done:
                return await session.leave(self, "ended")
            why = "slow_client" if self.slow else self._reader_end(reader)
            if why == "stopped" or (why == "stall_timeout" and session.only_controller(self)):
                await session.stop(why)  # its session.done reaches this connection too
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(STOP_WAIT_S):
                        await asyncio.shield(ended)
                return await session.leave(self, why)
            if why == "stall_timeout":  # other controllers steer on: only this connection ends
                await session.leave(self, why)
                return self._put(Close(CLOSE_NORMAL, "stall timeout"))
            if why == "too_many_messages":  # closed by the server: as the client leaving, not a drop
                await session.leave(self, "client_disconnected")
                return self._put(Close(CLOSE_POLICY, "too many messages"))
            await session.leave(self, why)
        finally:
            await session.leave(self, "server_error")  # a no-op once it left: here only on a server bug
            self.session = None
            for task in (reader, slow, ended):
                task.cancel()
            # Collect what they ended with (the reader ends with _Closed when the client
            # leaves), so no task's exception is left unretrieved.
            await asyncio.gather(reader, slow, ended, return_exceptions=True)

    def _reader_end(self, reader: asyncio.Task) -> str:
        """Why the reader ended: its own answer; the socket gone as a drop
        (``dropped``: the session may be resumed, ``RESUMABLE_CLOSES``); or closed
        any other way (``client_disconnected``)."""
        if reader.cancelled():
            return "client_disconnected"
        error = reader.exception()
        if isinstance(error, _Closed):
            return "dropped" if error.code in RESUMABLE_CLOSES else "client_disconnected"
        if error is not None:
            return "client_disconnected"
        return reader.result() or "stopped"

    # ------------------------------------------------------------------
    # reading
    # ------------------------------------------------------------------

    async def _receive(self, timeout: float | None) -> dict | list | str | int | float | None | bytes:
        """The next client message: parsed JSON, or raw bytes for a binary frame.
        ``TimeoutError`` after ``timeout``; ``_Closed`` when the client left;
        ``JsonLimitError`` for JSON past the limits (``rtvideo.server.limits``), naming why;
        ``ValueError`` for text that is not JSON; ``_TooMuchText`` past the
        connection's text budget (never for the first message: the budget
        starts full, and holds more than the longest message)."""
        async with asyncio.timeout(timeout):
            message = await self.ws.receive()
        if message["type"] == "websocket.disconnect":
            raise _Closed(message.get("code"))
        text = message.get("text") or ""
        cost = max(MESSAGE_FLOOR_CHARS, min(len(text), MAX_TEXT_MESSAGE_CHARS))  # a binary message: the floor
        if self._text.take(time.monotonic(), cost) is not None:
            raise _TooMuchText()
        if message.get("bytes") is not None:
            return message["bytes"]
        return parse_json(text)  # too long, too deep, or an integer too long: refused by name

    def _parse(self, data: Any) -> Any:
        """A validated client event, or an ``error`` event dict explaining why not."""
        if isinstance(data, bytes):
            return error_event("binary_not_supported", "clients send JSON text frames only")
        if not isinstance(data, dict):
            return error_event("invalid_message", f"a message must be a JSON object, got {type(data).__name__}")
        kind = data.get("type")
        if kind not in CLIENT_EVENT_TYPES:
            return unknown_type_error(kind)
        try:
            return CLIENT_EVENTS.validate_python(data, strict=True)  # "64" is no integer, nor 1 a boolean
        except ValidationError as error:
            code = "invalid_interaction" if kind == "session.interaction" else "invalid_event"
            event_id = (data.get("interaction") or {}).get("event_id") if kind == "session.interaction" else None
            event_id = event_id if isinstance(event_id, str) else None
            return error_event(code, f"{kind}: {describe_validation_error(error)}", event_id=event_id)

    async def _receive_first(self) -> Any:
        """The first client event, validated; None once it was refused (not JSON,
        no event, no message within ``start_timeout_s``). ``_openers`` then
        starts or resumes by its type, or refuses it (``start_required``)."""
        timeout = self.settings.start_timeout_s
        try:
            data = await self._receive(timeout)
        except TimeoutError:
            await self._fatal("start_timeout", f"no session.start within {timeout:g} s", CLOSE_POLICY)
            return None
        except JsonLimitError as error:
            await self._fatal("invalid_message", str(error), CLOSE_POLICY)
            return None
        except ValueError as error:
            message = f"the first message is not JSON ({error}); begin with a JSON text message like {START_EXAMPLE}"
            await self._fatal("invalid_json", message, CLOSE_POLICY)
            return None
        event = self._parse(data)
        if not isinstance(event, dict):
            return event
        example = f"; begin with a JSON text message like {START_EXAMPLE}" if event["code"] in NO_EVENT else ""
        await self._fatal(event["code"], event["message"] + example, CLOSE_POLICY)
        return None

    async def _start_required(self, event: Any) -> None:
        """A first event that neither starts nor resumes a session: refused."""
        message = f"the first message must be session.start or session.resume, not {event.type}"
        await self._fatal("start_required", message, CLOSE_POLICY)

    async def _reader(self) -> str | None:
        """Client events until a stop (returns the reason) or the client leaves,
        each handled by its type as this connection's role says
        (``_events_by_role``). Spectators have no stall limit: they need not send anything."""
        rid = self.session.request_id
        events = self._events_by_role[self.role]
        stall = None if self.role == "spectator" else self.settings.stall_timeout_s
        while True:
            try:
                data = await self._receive(stall)
            except TimeoutError:
                self._send(error_event("stall_timeout", f"no message for {stall:g} s", request_id=rid, fatal=True))
                return "stall_timeout"
            except JsonLimitError as error:
                self._send(error_event("invalid_message", str(error), request_id=rid))
                continue
            except _TooMuchText:
                message = (
                    f"more than {TEXT_CHARS_PER_S} characters of text a second ({TEXT_BURST_CHARS} at once) "
                    f"from this connection, each message counting at least {MESSAGE_FLOOR_CHARS}"
                )
                self._send(error_event("too_many_messages", message, request_id=rid, fatal=True))
                return "too_many_messages"
            except ValueError as error:
                self._send(error_event("invalid_json", f"not JSON: {error}", request_id=rid))
                continue
            if isinstance(data, bytes):
                self._input_frame(data, time.monotonic())
                continue
            event = self._parse(data)
            if isinstance(event, dict):  # not a valid client event: the error saying why
                self._send({**event, "request_id": rid})
                continue
            try:
                why = await events(event)
            except UnknownSessionError as error:
                self._send(error_event("unknown_session", str(error), request_id=rid))
                continue
            if why is not None:
                return why

    def _input_frame(self, data: bytes, received_at: float) -> None:
        """A binary frame after the start: an input frame for a session started with
        an ``input``, taken from a controller (refused frames get ``invalid_input_frame``);
        ``read_only`` from a spectator; ``binary_not_supported`` for a session without input."""
        rid = self.session.request_id
        if self.session.input is None:
            message = "binary frames are input video frames, and this session was started without an input"
            return self._send(error_event("binary_not_supported", message, request_id=rid))
        if self.role == "spectator":
            message = "binary frame: this connection watches the session (?watch=) and cannot send its input"
            return self._send(error_event("read_only", message, request_id=rid))
        if (refused := self.session.input_frame(data, received_at)) is not None:
            self._send(refused)

    # Client event handlers (``_events_by_role``): each returns why the reader
    # ends (a stop), or None to read on.

    async def _pong(self, event: SessionPingEvent) -> None:
        self._send(SessionPong(request_id=self.session.request_id).wire())

    async def _already_started(self, event: SessionStartEvent | SessionResumeEvent) -> None:
        rid = self.session.request_id
        self._send(error_event("session_already_started", "this connection already has a session", request_id=rid))

    async def _playback(self, event: SessionPlaybackEvent) -> None:
        await self.session.playback(event.position_seconds)

    async def _interaction(self, event: SessionInteractionEvent) -> None:
        payload = event.interaction
        event_id = payload.event_id or f"evt-{uuid.uuid4().hex}"
        interaction = Interaction(prompt=payload.event.prompt, transition_chunks=payload.transition_chunks)
        await self.session.interact(self, event_id, interaction)

    async def _stop(self, event: SessionStopEvent) -> str:
        return "stopped"

    async def _spectator_playback(self, event: SessionPlaybackEvent) -> None:
        """A spectator's playhead paces nothing: ignored."""

    async def _read_only(self, event: Any, event_id: str | None = None) -> None:
        """A spectator's event that would steer the session: refused, ``read_only``."""
        message = f"{event.type}: this connection watches the session (?watch=) and cannot steer it"
        self._send(error_event("read_only", message, request_id=self.session.request_id, event_id=event_id))

    async def _read_only_interaction(self, event: SessionInteractionEvent) -> None:
        await self._read_only(event, event.interaction.event_id)

    async def _unknown_event(self, event: Any) -> None:
        """A validated event with no handler for this role: the protocol's ``unknown_type`` reply."""
        self._send({**unknown_type_error(event.type), "request_id": self.session.request_id})

    # ------------------------------------------------------------------
    # writing
    # ------------------------------------------------------------------

    def _send(self, event: dict[str, Any]) -> None:
        self._put(Event(json.dumps(event)))

    def _put(self, item: Outgoing) -> None:
        """Queue ``item`` for the writer, counting its bytes (and a chunk's media
        seconds); a slow client gets nothing more. A spectator is slow sooner than a
        controller: once more media waits for it than a controller may lag
        (``max_undelivered_seconds``), as nothing holds the session for it."""
        if self.slow is not None:
            return
        waiting = self.backlog
        self.backlog += item.size
        if isinstance(item, Media):
            self.backlog_s += item.chunk.media_seconds
        self.outbox.put_nowait(item)
        if waiting == 0:  # one item alone is always taken
            return
        limit = self.settings.max_outbox_bytes
        if self.backlog > limit:
            self._too_slow(f"{self.backlog} bytes wait for it, past max_outbox_bytes ({limit})")
        elif self.role == "spectator" and self.backlog_s > (lag := self.settings.max_undelivered_seconds):
            behind = f"{self.backlog_s:.1f} s of media wait for this spectator"
            self._too_slow(f"{behind}, past max_undelivered_seconds ({lag:g})")

    def _too_slow(self, why: str) -> None:
        """Close a client that stopped reading, now: 1008 ``slow_client: ...``
        queued behind what it has not read (``rtvideo.server.ws_protocol``), what waits
        for it dropped, the writer stopped; it then leaves its session."""
        if self.slow is not None:
            return
        self.slow = why
        rid = self.session.request_id if self.session else "no session"
        log.warning("closing a slow client (%s, %s): %s", rid, self.role, why)
        while not self.outbox.empty():
            self.outbox.get_nowait()
        self.backlog, self.backlog_s = 0, 0.0
        reason = f"slow_client: {why}"[:123]  # a close reason holds 123 bytes
        close_now = self.ws.scope.get("extensions", {}).get(CLOSE_NOW)
        if close_now is not None:
            close_now["close_now"](CLOSE_POLICY, reason, SLOW_CLIENT_GRACE_S)
        if self._writer is not None and self._writer is not asyncio.current_task():
            self._writer.cancel()  # it waits on a socket that takes nothing
        self._slow.set()

    async def _fatal(self, code: str, message: str, close_code: int) -> None:
        """Refuse the connection before it joined a session (counted as a rejected start)."""
        self.metrics.rejections.labels(code).inc()
        self._send(error_event(code, message, fatal=True))
        self._put(Close(close_code, message[:120]))

    async def _write(self, send: Any) -> None:
        """One write to the socket, which may wait for the client to read; past
        ``send_timeout_s`` the client is too slow (``_Slow``)."""
        timeout = self.settings.send_timeout_s
        try:
            async with asyncio.timeout(timeout):
                await send
        except TimeoutError:
            self._too_slow(f"its socket took nothing for {timeout:g} s (send_timeout_s)")
            raise _Slow() from None

    async def _write_all(self) -> None:
        """The socket's only sender: events, metadata + binary pairs, and the close.
        A chunk goes out through ``rtvideo.send_media`` (``rtvideo.server.ws_protocol``)
        when the server offers it: its shared payload written as it is."""
        send_media = self.ws.scope.get("extensions", {}).get(SEND_MEDIA, {}).get("send_media")
        while True:
            item = await self.outbox.get()
            if item is END:
                return
            try:
                match item:
                    case Event(text):
                        await self._write(self.ws.send_text(text))
                    case Media(chunk, with_init, metadata):
                        if send_media is not None:
                            await self._write(send_media(metadata, item.parts))
                        else:
                            await self._write(self.ws.send_text(metadata.decode()))
                            await self._write(self.ws.send_bytes(chunk.payload(with_init)))
                        self.backlog_s -= chunk.media_seconds
                        if self._written_to is not None:
                            await self._written_to.written(self, chunk)
                    case Close(code, reason):
                        if self.ws.client_state is WebSocketState.CONNECTED:
                            await self._write(self.ws.close(code, reason))
                            self._close_written = True
                        return
            except _Slow:
                return
            except (WebSocketDisconnect, RuntimeError, OSError):
                return  # the client left; the reader tells the session
            self.backlog -= item.size
