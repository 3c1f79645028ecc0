"""A small realtime client for the e2e tests: a websockets connection that
pairs each ``video.chunk_metadata`` with the binary frame that follows it."""

from __future__ import annotations

import asyncio
import json
import struct
from dataclasses import dataclass, field
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed


@dataclass
class Chunk:
    metadata: dict[str, Any]
    payload: bytes


@dataclass
class Received:
    events: list[dict[str, Any]] = field(default_factory=list)
    chunks: list[Chunk] = field(default_factory=list)
    close_code: int | None = None
    close_reason: str = ""

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["type"] == kind]


class Realtime:
    def __init__(self, ws: ClientConnection) -> None:
        self.ws = ws
        self.received = Received()

    async def send(self, event: dict[str, Any] | str | bytes) -> None:
        await self.ws.send(event if isinstance(event, str | bytes) else json.dumps(event))

    async def next(self, timeout: float = 30.0) -> dict[str, Any] | Chunk:
        """The next event, or the next chunk (metadata and its payload together)."""
        message = await asyncio.wait_for(self.ws.recv(), timeout)
        assert isinstance(message, str), "a binary frame arrived without its metadata"
        event = json.loads(message)
        if event["type"] != "video.chunk_metadata":
            self.received.events.append(event)
            return event
        payload = await asyncio.wait_for(self.ws.recv(), timeout)
        assert isinstance(payload, bytes), f"metadata was followed by {payload!r}, not the binary frame"
        assert len(payload) == event["byte_length"]
        chunk = Chunk(event, payload)
        self.received.chunks.append(chunk)
        return chunk

    async def until(self, kind: str, timeout: float = 30.0) -> dict[str, Any]:
        while True:
            item = await self.next(timeout)
            if isinstance(item, dict) and item["type"] == kind:
                return item

    async def rest(self, timeout: float = 60.0) -> Received:
        """Everything until the server closes the socket."""
        try:
            while True:
                await self.next(timeout)
        except ConnectionClosed as closed:
            self.received.close_code = closed.rcvd.code if closed.rcvd else None
            self.received.close_reason = closed.rcvd.reason if closed.rcvd else ""
        return self.received


def interaction(prompt: str | None, event_id: str | None = None, **extra: Any) -> dict[str, Any]:
    """A ``session.interaction`` event (``prompt`` None leaves the event body empty)."""
    payload: dict[str, Any] = {"event": {} if prompt is None else {"prompt": prompt}, **extra}
    if event_id is not None:
        payload["event_id"] = event_id
    return {"type": "session.interaction", "interaction": payload}


def assert_applied_as_promised(queued: dict[str, Any], applied: dict[str, Any]) -> None:
    """The interaction applied at the chunk its ``queued`` answer promised, which is
    the chunk after the one in progress when it was accepted (when one was)."""
    assert applied["generation_chunk_index"] == queued["expected_chunk_index"]
    if queued["in_progress_chunk_index"] is not None:
        assert applied["generation_chunk_index"] == queued["in_progress_chunk_index"] + 1


def open_realtime(url: str, **kwargs: Any):
    return connect(url, max_size=None, **kwargs)


def input_frame(index: int, image: bytes, capture_us: int = 0) -> bytes:
    """One input frame as a client sends it (a session with ``input``): the 12-byte
    header (index uint32, capture time in microseconds uint64, big-endian), then the image."""
    return struct.pack(">IQ", index, capture_us) + image
