"""A session's media in one more format, for the spectators that asked for it.

API process, asyncio. A realtime session encodes its chunks once, in its own
format (``SessionOutput``). A spectator may watch in another one
(``?watch=TOKEN&format=fmp4``: a browser watching a ``raw`` session): the
session then keeps one ``Rendition`` per such format, which encodes every
chunk once more, whatever the number of its viewers, and fans it out to
them. Its encoder starts at the first chunk offered after it was made, so
its first chunk carries the fMP4 init segment and its timestamps say where
the chunk sits in the session.

Encoding runs on a task of its own, in a worker thread, so a rendition never
holds the session's pump, its controllers or its other viewers. A rendition
that falls ``MAX_BACKLOG`` chunks behind (the machine cannot encode this
format as fast as the session makes it) gives up: its viewers are closed as
slow clients. The session's end reaches its viewers after the chunks before
it (``end``).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from rtvideo.server.media import make_encoder
from rtvideo.server.resume_buffer import BufferedChunk

log = logging.getLogger(__name__)
MAX_BACKLOG = 8  # chunks waiting to be encoded; past it the rendition's viewers are dropped


@dataclass(frozen=True)
class _Frames:
    index: int  # generation_chunk_index
    metadata: dict[str, Any]
    frames: np.ndarray  # (n, height, width, 3) uint8, trimmed as the session's own chunk
    compute_s: float


@dataclass(frozen=True)
class _End:
    event: dict[str, Any] | None
    close_code: int
    reason: str


class Rendition:
    def __init__(
        self,
        fmt: str,
        width: int,
        height: int,
        fps: float,
        viewers: Callable[[], list],
        on_too_slow: Callable[[str], None],
    ) -> None:
        """``viewers()``: the viewers of this format now; ``on_too_slow(why)``
        when it gives up. ``ValueError`` when ``fmt`` cannot encode this
        session's frames (fMP4 needs an even width and height)."""
        self.format = fmt
        self.fps = fps
        self._encoder = make_encoder(fmt, width, height, fps)
        self._viewers = viewers
        self._on_too_slow = on_too_slow
        self._pending: deque[_Frames | _End] = deque()
        self._wake = asyncio.Event()
        self._first = True
        self.closed = False
        self._task = asyncio.create_task(self._run(), name=f"rendition-{fmt}")

    def offer(self, index: int, metadata: dict[str, Any], frames: np.ndarray, compute_s: float) -> None:
        """A chunk the session made (never waits)."""
        if self.closed:
            return
        if sum(isinstance(item, _Frames) for item in self._pending) >= MAX_BACKLOG:
            self.close()
            self._on_too_slow(
                f"the server cannot encode {self.format} as fast as the session makes chunks "
                f"({MAX_BACKLOG} chunks behind)"
            )
            return
        self._pending.append(_Frames(index, metadata, frames, compute_s))
        self._wake.set()

    def end(self, event: dict[str, Any] | None, close_code: int, reason: str) -> None:
        """The session is over: ``event`` and the close reach the viewers after the chunks before it."""
        if self.closed:
            return
        self._pending.append(_End(event, close_code, reason))
        self._wake.set()

    def close(self) -> None:
        """Stop encoding (no viewer left, or it gave up); what waits is dropped."""
        self.closed = True
        self._pending.clear()
        self._task.cancel()

    async def finished(self) -> None:
        """Return once the rendition's task has ended: its end was delivered, or it
        was closed (nothing reaches a viewer after this)."""
        await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            while not self._pending:
                self._wake.clear()
                await self._wake.wait()
            item = self._pending.popleft()
            if isinstance(item, _End):
                for viewer in self._viewers():
                    if item.event is not None:
                        viewer.send_event(item.event)
                    viewer.session_ended(item.close_code, item.reason)
                self.closed = True
                return
            try:
                chunk = await asyncio.to_thread(self._encode, item)
            except Exception:
                log.exception("encoding a chunk as %s failed", self.format)
                self.close()
                self._on_too_slow(f"the server failed to encode {self.format}")
                return
            for viewer in self._viewers():
                viewer.send_chunk(chunk)

    def _encode(self, item: _Frames) -> BufferedChunk:
        payload = self._encoder.encode(item.frames, item.metadata["first_frame_index"])
        init = getattr(self._encoder, "init", b"")
        fragment = payload[len(init) :] if self._first else payload
        self._first = False
        return BufferedChunk(
            index=item.index,
            metadata=item.metadata,
            fragment=fragment,
            init=init,
            compute_s=item.compute_s,
            fps=self.fps,
        )
