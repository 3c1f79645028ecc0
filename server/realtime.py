"""``WS /v1/realtime/video``: one connection, one realtime session.

API process, asyncio. Per connection three tasks cooperate:

- the **reader** validates client events (``server.schemas``) and forwards
  interactions, playback positions and stops to the engine; bad input gets an
  ``error`` and, after the start, the session goes on;
- the **pump** turns the session's engine results into protocol events,
  encoding chunks off the event loop (``server.output``);
- the **writer** is the only task that sends on the socket, so a
  ``video.chunk_metadata`` and its binary frame are never split.

The outbox between them and the writer is bounded: it counts the bytes
queued and not yet written to the socket (events as their JSON text, chunks
as metadata plus payload). A client whose backlog passes ``max_outbox_bytes``
(an item reaching an empty outbox is always taken, however large), or whose
socket takes nothing for ``send_timeout_s`` while a write waits, is a slow
client: it is closed with 1008 and the reason ``slow_client: ...`` at once,
without waiting for it to read (``server.ws_protocol``), what was queued for it
is dropped, and its session ends (``session.done`` reason ``slow_client``).
Pacing (``max_undelivered_seconds``) holds a lagging session's generation long
before that; these limits are for a client that stopped reading for good.

Ending: ``session.stop``, a length reached, the stall or duration limit, a
slow client, or the client leaving all go through one path,
``EngineClient.stop``, and the connection waits for the engine's
``SessionDone`` so nothing is left behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from dataclasses import dataclass
from typing import Any

from pydantic import TypeAdapter, ValidationError
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from engine.client import (
    EngineClient,
    EngineDeadError,
    EngineRestartingError,
    SessionHandle,
    SessionRejectedError,
    UnknownSessionError,
)
from engine.messages import ChunkReady, Interaction, SessionDone, SessionFailed, SessionStarted
from server.auth import is_authorized, key_subprotocol
from server.drain import Drainer
from server.events import SessionPong, VideoStart
from server.limits import TooDeepError, too_deep
from server.metrics import Metrics, SessionClock
from server.output import MediaChunk, SessionOutput, error_event
from server.schemas import (
    CLIENT_EVENT_TYPES,
    ClientEvent,
    RequestError,
    SessionInteractionEvent,
    SessionPingEvent,
    SessionPlaybackEvent,
    SessionStartEvent,
    SessionStopEvent,
    describe_validation_error,
    resolve,
)
from server.settings import ServerSettings
from server.ws_protocol import EXTENSION as CLOSE_NOW

log = logging.getLogger(__name__)
CLIENT_EVENTS: TypeAdapter = TypeAdapter(ClientEvent)

CLOSE_NORMAL, CLOSE_POLICY, CLOSE_TOO_BIG, CLOSE_ERROR, CLOSE_FULL = 1000, 1008, 1009, 1011, 1013
SLOW_CLIENT_GRACE_S = 10.0  # a slow client closed now has this long to read up to the close frame


class _Closed(Exception):
    """The client is gone."""


@dataclass(frozen=True)
class Event:
    """A JSON text frame, serialised when queued (its size counts in the backlog)."""

    text: str

    @property
    def size(self) -> int:
        return len(self.text)


@dataclass(frozen=True)
class Media:
    """A ``video.chunk_metadata`` text frame and its binary frame, sent back to back."""

    chunk: MediaChunk
    metadata: str

    @property
    def size(self) -> int:
        return len(self.metadata) + len(self.chunk.payload)


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
    ) -> None:
        self.drainer = drainer
        self.ws = websocket
        self.engine = engine
        self.settings = settings
        self.model = model
        self.metrics = metrics
        self.clock = SessionClock(metrics)
        self.outbox: asyncio.Queue[Outgoing] = asyncio.Queue()
        self.backlog = 0  # bytes queued in the outbox and not yet written to the socket
        self.slow: str | None = None  # why the client was closed as slow, once it was
        self._slow = asyncio.Event()
        self._writer: asyncio.Task | None = None
        self.handle: SessionHandle | None = None
        self.output: SessionOutput | None = None

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
            await self._session()
        except _Closed:
            pass
        except Exception:
            log.exception("realtime connection failed")
            self._send(error_event("internal_error", "the server failed this session", fatal=True))
            self._put(Close(CLOSE_ERROR, "internal error"))
        finally:
            if self.handle is not None and not self.handle.finished:
                await self._finish_session("slow_client" if self.slow else "server_error")
            self.outbox.put_nowait(END)
            # The writer delivers what is queued (each write bounded by send_timeout_s) and stops.
            await asyncio.gather(writer, return_exceptions=True)
            if self.slow is not None and CLOSE_NOW not in self.ws.scope.get("extensions", {}):
                with contextlib.suppress(Exception):  # another server: try an ordinary close, briefly
                    await asyncio.wait_for(self.ws.close(CLOSE_POLICY, f"slow_client: {self.slow}"[:123]), 1.0)

    async def _session(self) -> None:
        start = await self._receive_start()
        if start is None:
            return
        if self.drainer.draining:
            return await self._fatal("shutting_down", "the server is shutting down", CLOSE_FULL)
        if (unavailable := self.engine.unavailable()) is not None:
            return await self._engine_unavailable(unavailable)
        request_id = f"rtv-{uuid.uuid4().hex}"
        defaults = self.engine.ready.defaults
        try:
            engine_start, config = resolve(start, request_id, defaults, self.settings, self.model)
        except RequestError as error:
            return await self._fatal("invalid_request", str(error), CLOSE_POLICY)
        try:
            self.handle = await self.engine.start_session(engine_start)
        except SessionRejectedError as error:
            code = CLOSE_FULL if error.code == "server_full" else CLOSE_POLICY
            return await self._fatal(error.code, error.message, code)
        except EngineDeadError as error:
            return await self._engine_unavailable(error)
        self.output = SessionOutput(request_id, config, self.metrics, self.clock)
        self.metrics.sessions_active.inc()
        self._send(VideoStart(request_id=request_id, format=config.format, config=config.wire()).wire())
        pump = asyncio.create_task(self._pump(), name="ws-pump")
        reader = asyncio.create_task(self._reader(), name="ws-reader")
        limit = asyncio.create_task(self._duration_limit(), name="ws-duration")
        slow = asyncio.create_task(self._slow.wait(), name="ws-slow")
        try:
            done, _ = await asyncio.wait({pump, reader, slow}, return_when=asyncio.FIRST_COMPLETED)
            if pump not in done:  # the client stopped, stalled, left or is too slow: end the session, drain it
                reason = "slow_client" if self.slow else self._reader_end(reader)
                with contextlib.suppress(EngineDeadError, UnknownSessionError):
                    await self.engine.stop(self.handle.session_id, reason)
                await asyncio.wait_for(asyncio.shield(pump), 30.0)
            elif pump.exception() is not None:
                raise pump.exception()
        finally:
            for task in (pump, reader, limit, slow):
                task.cancel()
            # Collect what they ended with (the reader ends with _Closed when the client
            # leaves), so no task's exception is left unretrieved.
            await asyncio.gather(pump, reader, limit, slow, return_exceptions=True)

    async def _engine_unavailable(self, error: EngineDeadError) -> None:
        """No worker takes the session: 1013 (try again later) while a fresh one is
        starting, 1011 once the engine is dead for good."""
        close = CLOSE_FULL if isinstance(error, EngineRestartingError) else CLOSE_ERROR
        await self._fatal("engine_unavailable", str(error), close)

    @staticmethod
    def _reader_end(reader: asyncio.Task) -> str:
        """Why the reader ended: its own answer, or the client leaving."""
        if reader.cancelled() or reader.exception() is not None:
            return "client_disconnected"
        return reader.result() or "stopped"

    async def _finish_session(self, reason: str) -> None:
        """Fallback when the pump is gone: stop the engine session and wait for its end."""
        handle = self.handle
        with contextlib.suppress(EngineDeadError, UnknownSessionError):
            await self.engine.stop(handle.session_id, reason)
        while not handle.finished:
            try:
                message = await handle.next(30.0)
            except TimeoutError:
                log.error("session %s did not end within 30 s of its stop", handle.session_id)
                return
            if isinstance(message, SessionDone | SessionFailed):
                self._ended(message.reason if isinstance(message, SessionDone) else "failed")
                self._send(self.output.event(message))

    # ------------------------------------------------------------------
    # reading
    # ------------------------------------------------------------------

    async def _receive(self, timeout: float) -> dict | list | str | int | float | None | bytes:
        """The next client message: parsed JSON, or raw bytes for a binary frame.
        ``TimeoutError`` after ``timeout``; ``_Closed`` when the client left;
        ``ValueError`` for text that is not JSON."""
        message = await asyncio.wait_for(self.ws.receive(), timeout)
        if message["type"] == "websocket.disconnect":
            raise _Closed()
        if message.get("bytes") is not None:
            return message["bytes"]
        text = message.get("text") or ""
        if (why := too_deep(text)) is not None:
            raise TooDeepError(why)  # refused before parsing
        return json.loads(text)

    def _parse(self, data: Any) -> Any:
        """A validated client event, or an ``error`` event dict explaining why not."""
        if isinstance(data, bytes):
            return error_event("binary_not_supported", "clients send JSON text frames only")
        if not isinstance(data, dict):
            return error_event("invalid_message", f"a message must be a JSON object, got {type(data).__name__}")
        kind = data.get("type")
        if kind not in CLIENT_EVENT_TYPES:
            known = ", ".join(CLIENT_EVENT_TYPES)
            return error_event("unknown_type", f"unknown message type {kind!r}; known: {known}")
        try:
            return CLIENT_EVENTS.validate_python(data)
        except ValidationError as error:
            code = "invalid_interaction" if kind == "session.interaction" else "invalid_event"
            event_id = (data.get("interaction") or {}).get("event_id") if kind == "session.interaction" else None
            event_id = event_id if isinstance(event_id, str) else None
            return error_event(code, f"{kind}: {describe_validation_error(error)}", event_id=event_id)

    async def _receive_start(self) -> SessionStartEvent | None:
        timeout = self.settings.start_timeout_s
        try:
            data = await self._receive(timeout)
        except TimeoutError:
            await self._fatal("start_timeout", f"no session.start within {timeout:g} s", CLOSE_POLICY)
            return None
        except TooDeepError as error:
            await self._fatal("invalid_message", str(error), CLOSE_POLICY)
            return None
        except ValueError as error:
            await self._fatal("invalid_json", f"the first message is not JSON: {error}", CLOSE_POLICY)
            return None
        event = self._parse(data)
        if isinstance(event, SessionStartEvent):
            return event
        if isinstance(event, dict):
            await self._fatal(event["code"], event["message"], CLOSE_POLICY)
        else:
            await self._fatal(
                "start_required", f"the first message must be session.start, not {event.type}", CLOSE_POLICY
            )
        return None

    async def _reader(self) -> str | None:
        """Client events until a stop (returns the reason) or the client leaves."""
        rid = self.output.request_id
        while True:
            try:
                data = await self._receive(self.settings.stall_timeout_s)
            except TimeoutError:
                limit = self.settings.stall_timeout_s
                self._send(error_event("stall_timeout", f"no message for {limit:g} s", request_id=rid, fatal=True))
                return "stall_timeout"
            except TooDeepError as error:
                self._send(error_event("invalid_message", str(error), request_id=rid))
                continue
            except ValueError as error:
                self._send(error_event("invalid_json", f"not JSON: {error}", request_id=rid))
                continue
            event = self._parse(data)
            if isinstance(event, dict):
                self._send({**event, "request_id": rid})
            elif isinstance(event, SessionStopEvent):
                return "stopped"
            else:
                await self._on_event(event)

    async def _on_event(self, event: Any) -> None:
        rid, sid = self.output.request_id, self.handle.session_id
        if isinstance(event, SessionPingEvent):
            self._send(SessionPong(request_id=rid).wire())
        elif isinstance(event, SessionStartEvent):
            self._send(error_event("session_already_started", "this connection already has a session", request_id=rid))
        elif isinstance(event, SessionPlaybackEvent):
            self.clock.playhead = event.position_seconds
            await self.engine.playback(sid, event.position_seconds)
        elif isinstance(event, SessionInteractionEvent):
            payload = event.interaction
            event_id = payload.event_id or f"evt-{uuid.uuid4().hex}"
            interaction = Interaction(prompt=payload.event.prompt, transition_chunks=payload.transition_chunks)
            await self.engine.interact(sid, event_id, interaction)

    async def _duration_limit(self) -> None:
        await asyncio.sleep(self.settings.max_session_seconds)
        with contextlib.suppress(EngineDeadError, UnknownSessionError):
            await self.engine.stop(self.handle.session_id, "max_duration")

    # ------------------------------------------------------------------
    # results and writing
    # ------------------------------------------------------------------

    async def _pump(self) -> None:
        """Engine results to client events, until the session ends."""
        async for message in self.handle:
            if isinstance(message, ChunkReady):
                chunk = await self.output.chunk(message)
                if chunk is not None:
                    self._put(Media(chunk, json.dumps(chunk.metadata)))
                continue
            if isinstance(message, SessionStarted):
                continue
            event = self.output.event(message)
            if event is not None:
                self._send(event)
            if isinstance(message, SessionFailed):
                self._ended("failed")
                self._put(Close(CLOSE_ERROR, "generation failed"))
            elif isinstance(message, SessionDone):
                self._ended(message.reason)
                self._put(Close(CLOSE_NORMAL, "session done"))

    def _ended(self, outcome: str) -> None:
        self.metrics.sessions_active.dec()
        self.metrics.sessions.labels(outcome).inc()

    def _send(self, event: dict[str, Any]) -> None:
        self._put(Event(json.dumps(event)))

    def _put(self, item: Outgoing) -> None:
        """Queue ``item`` for the writer, counting its bytes; a slow client gets nothing more."""
        if self.slow is not None:
            return
        waiting = self.backlog
        self.backlog += item.size
        self.outbox.put_nowait(item)
        limit = self.settings.max_outbox_bytes
        if self.backlog > limit and waiting > 0:  # one item alone is always taken
            self._too_slow(f"{self.backlog} bytes wait for it, past max_outbox_bytes ({limit})")

    def _too_slow(self, why: str) -> None:
        """Close a client that stopped reading, now: 1008 ``slow_client: ...``
        queued behind what it has not read (``server.ws_protocol``), what waits
        for it dropped, the writer stopped; the session then ends."""
        if self.slow is not None:
            return
        self.slow = why
        log.warning("closing a slow client (%s): %s", self.output.request_id if self.output else "no session", why)
        while not self.outbox.empty():
            self.outbox.get_nowait()
        self.backlog = 0
        reason = f"slow_client: {why}"[:123]  # a close reason holds 123 bytes
        close_now = self.ws.scope.get("extensions", {}).get(CLOSE_NOW)
        if close_now is not None:
            close_now["close_now"](CLOSE_POLICY, reason, SLOW_CLIENT_GRACE_S)
        if self._writer is not None and self._writer is not asyncio.current_task():
            self._writer.cancel()  # it waits on a socket that takes nothing
        self._slow.set()

    async def _fatal(self, code: str, message: str, close_code: int) -> None:
        """Refuse the connection before its session began (counted as a rejected start)."""
        self.metrics.rejections.labels(code).inc()
        self._send(error_event(code, message, fatal=True))
        self._put(Close(close_code, message[:120]))

    async def _delivered(self, chunk: MediaChunk) -> None:
        """The chunk is written to the socket: count it delivered, and tell the
        engine, whose pacing holds a session whose client stops taking media."""
        self.output.delivered(chunk)
        with contextlib.suppress(EngineDeadError, UnknownSessionError):
            await self.engine.delivered(self.handle.session_id, chunk.media_end_seconds)

    async def _write(self, send: Any) -> None:
        """One write to the socket, which may wait for the client to read; past
        ``send_timeout_s`` the client is too slow (``_Slow``)."""
        timeout = self.settings.send_timeout_s
        try:
            await asyncio.wait_for(send, timeout)
        except TimeoutError:
            self._too_slow(f"its socket took nothing for {timeout:g} s (send_timeout_s)")
            raise _Slow() from None

    async def _write_all(self) -> None:
        """The socket's only sender: events, metadata + binary pairs, and the close."""
        while True:
            item = await self.outbox.get()
            if item is END:
                return
            try:
                match item:
                    case Event(text):
                        await self._write(self.ws.send_text(text))
                    case Media(chunk, metadata):
                        await self._write(self.ws.send_text(metadata))
                        await self._write(self.ws.send_bytes(chunk.payload))
                        await self._delivered(chunk)
                    case Close(code, reason):
                        if self.ws.client_state is WebSocketState.CONNECTED:
                            await self._write(self.ws.close(code, reason))
                        return
            except _Slow:
                return
            except (WebSocketDisconnect, RuntimeError, OSError):
                return  # the client left; the reader ends the session
            self.backlog -= item.size
