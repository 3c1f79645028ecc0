"""A realtime session's newest chunks, kept for a ``session.resume``.

API process, pure (no I/O). Every chunk a session makes goes in, encoded once;
the oldest go out once the chunks kept hold more than ``max_seconds`` of media
(the newest is always kept). A resuming client names the last chunk it got;
``after`` gives the chunks that follow it, or says why it cannot: the client
claims a chunk that was never made, or the first chunk it lacks is gone.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class BufferedChunk:
    """One encoded chunk of a session, as every connection of it gets it (its
    ``transport_chunk_index`` and ``byte_length`` are the connection's own)."""

    index: int  # generation_chunk_index
    metadata: dict[str, Any]  # the video.chunk_metadata event
    fragment: bytes  # the payload, without an fmp4 init segment
    init: bytes  # the session's fmp4 init segment; b"" for raw and jpeg
    compute_s: float
    fps: float

    @property
    def media_seconds(self) -> float:
        return self.metadata["num_frames"] / self.fps

    @property
    def media_end_seconds(self) -> float:
        return self.metadata["media_start_seconds"] + self.media_seconds

    def payload(self, with_init: bool) -> bytes:
        """The binary frame: the init segment first on a connection's first chunk."""
        return self.init + self.fragment if with_init else self.fragment


class ResumeGapError(ValueError):
    """The chunks after the one a client names cannot be sent (the message says why)."""


class ChunkBuffer:
    def __init__(self, max_seconds: float) -> None:
        if max_seconds <= 0:
            raise ValueError(f"max_seconds must be > 0, got {max_seconds}")
        self.max_seconds = max_seconds
        self._chunks: deque[BufferedChunk] = deque()
        self._seconds = 0.0  # media held
        self.newest = -1  # the newest chunk's index; -1 before the first

    def __len__(self) -> int:
        return len(self._chunks)

    @property
    def oldest(self) -> int | None:
        return self._chunks[0].index if self._chunks else None

    @property
    def nbytes(self) -> int:
        return sum(len(c.fragment) for c in self._chunks)

    def add(self, chunk: BufferedChunk) -> None:
        if chunk.index <= self.newest:
            raise ValueError(f"chunk {chunk.index} after chunk {self.newest}: chunks come in order")
        self._chunks.append(chunk)
        self._seconds += chunk.media_seconds
        self.newest = chunk.index
        while len(self._chunks) > 1 and self._seconds > self.max_seconds:
            self._seconds -= self._chunks.popleft().media_seconds

    def clear(self) -> None:
        """Let every chunk go (the session ended: nobody can resume it any more);
        ``newest`` stays."""
        self._chunks.clear()
        self._seconds = 0.0

    def after(self, last_index: int) -> list[BufferedChunk]:
        """The chunks after ``last_index`` (-1: from the first), oldest first."""
        if last_index > self.newest:
            made = "no chunk was made yet" if self.newest < 0 else f"the newest chunk made is {self.newest}"
            raise ResumeGapError(f"last_chunk_index: {last_index} was never sent; {made}")
        if last_index == self.newest:
            return []
        if self.oldest is None or self.oldest > last_index + 1:
            raise ResumeGapError(
                f"last_chunk_index: chunk {last_index + 1} onwards is no longer kept (the server keeps "
                f"resume_buffer_seconds = {self.max_seconds:g} s of media: chunks {self.oldest}-{self.newest})"
            )
        return [c for c in self._chunks if c.index > last_index]
