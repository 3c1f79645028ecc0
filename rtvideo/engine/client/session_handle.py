"""``SessionHandle``: one open session's result stream, as ``EngineClient.start_session`` returns it."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from rtvideo.engine.messages import (
    Interaction,
    ResultMessage,
    SessionDone,
    SessionFailed,
    SessionGeometry,
    SessionStarted,
)

if TYPE_CHECKING:
    from rtvideo.engine.client.engine_client import EngineClient

TERMINAL = (SessionDone, SessionFailed)  # the results that end a session's stream


class SessionHandle:
    """One session's result stream; iterate it until ``SessionDone`` / ``SessionFailed``.
    The calls on it are the client's for this session (``EngineClient.interact`` ...)."""

    def __init__(self, client: EngineClient, started: SessionStarted, queue: asyncio.Queue) -> None:
        self._client = client
        self._queue = queue
        self.session_id = started.session_id
        self.geometry: SessionGeometry = started.geometry
        self.finished = False

    def __aiter__(self) -> SessionHandle:
        return self

    async def __anext__(self) -> ResultMessage:
        if self.finished:
            raise StopAsyncIteration
        message = await self._queue.get()
        if isinstance(message, TERMINAL):
            self.finished = True  # the client closed the session as the message arrived
        return message

    async def next(self, timeout: float | None = None) -> ResultMessage:
        """The next result, or ``TimeoutError`` after ``timeout`` seconds."""
        async with asyncio.timeout(timeout):
            return await self.__anext__()

    async def interact(self, event_id: str, interaction: Interaction) -> None:
        await self._client.interact(self.session_id, event_id, interaction)

    async def send_input(self, chunk_index: int, frames: Any) -> None:
        """Chunk ``chunk_index``'s input frames (a session opened with an ``input``):
        a numpy array, uint8 ``[F, H, W, 3]`` at the session's size, F being
        ``geometry.first_chunk_frames`` for chunk 0 and ``frames_per_chunk`` after;
        chunks in order, each once. ``EngineClient.send_input``."""
        await self._client.send_input(self.session_id, chunk_index, frames)

    async def stop(self, reason: str = "stopped") -> None:
        await self._client.stop(self.session_id, reason)
