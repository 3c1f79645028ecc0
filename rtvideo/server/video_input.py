"""Video input: a session's camera frames, from its WebSocket to the engine.

API process, asyncio. A realtime session started with an ``input``
(``session.start.input``: ``VideoInput``) takes binary WebSocket frames from
its controllers, each one input frame:

    frame index (uint32, big-endian) | capture time in microseconds (uint64, big-endian) | the image

the image a JPEG or ``width x height x 3`` bytes of raw RGB (``input.format``).

- ``parse_frame`` checks a frame as it arrives (pure): the header's length, an
  index above the last frame taken, a raw image's byte length, a JPEG's size
  as its frame header says (``jpeg_size``, read without decoding). A bad frame is
  refused alone (``FrameError``, naming its index when it has one); the
  session goes on.
- ``FrameGatherer`` (pure) holds the frames taken and not yet handed to the
  engine, oldest first, at most ``MAX_CHUNKS_WAITING`` chunks' worth: a frame
  arriving to a full gatherer drops the oldest one waiting (counted). A
  client that sends faster than the model makes chunks so loses its oldest
  frames, never its newest: the input the model sees stays fresh.
- ``InputFeeder`` is one session's task: once the engine may take chunk k's
  input (no more than ``MAX_CHUNKS_AHEAD`` chunks handed over and not yet
  made) and enough frames wait, it takes that chunk's frames
  (``first_chunk_frames`` for chunk 0, ``frames_per_chunk`` after), decodes
  them in a thread (``decode_image``: PyAV's mjpeg decoder; a JPEG that does
  not decode, or decodes to another size, is refused then, naming its index,
  and the next frame waiting takes its place) and hands them over with
  ``SessionHandle.send_input(k, frames)``, chunks in order. It remembers which
  client frames made each chunk, and when each arrived, so the chunk's
  metadata can name them (``input_frame_indexes``) and ``/metrics`` can time
  each from its arrival to the output frame made from it (output frame i of
  chunk k comes from input frame i of chunk k).
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import av
import numpy as np

from rtvideo.engine.client.errors import EngineError
from rtvideo.engine.messages import SessionGeometry, VideoInput
from rtvideo.server.metrics import Metrics

log = logging.getLogger(__name__)

HEADER = struct.Struct(">IQ")
"""An input frame's header: its index (uint32) and capture time in microseconds (uint64), big-endian."""
HEADER_BYTES = HEADER.size  # 12
MAX_CHUNKS_WAITING = 2
"""Frames taken and not yet handed to the engine: at most this many chunks' worth
(of ``frames_per_chunk``, or of the first chunk's frames where that is more);
past it the oldest waiting frame is dropped."""
MAX_CHUNKS_AHEAD = 2
"""Chunks of input handed to the engine and not yet made: the one being made and
the next, so the engine never waits for frames the server holds."""


class FrameError(ValueError):
    """An input frame refused; the message says what was wrong, naming the frame
    (``frame_index``, or None when the frame was too short to have one)."""

    def __init__(self, message: str, frame_index: int | None = None) -> None:
        super().__init__(message)
        self.frame_index = frame_index


@dataclass(frozen=True)
class InputFrame:
    """One input frame taken from a client, not yet decoded."""

    index: int  # the client's frame index (increasing)
    capture_us: int  # the client's capture time, in microseconds (its own clock)
    image: bytes  # a JPEG, or raw RGB (width x height x 3)
    received_at: float  # time.monotonic() when the server read it from the socket


def parse_frame(data: bytes, spec: VideoInput, last_index: int | None, received_at: float) -> InputFrame:
    """The input frame ``data`` (a binary WebSocket message) holds, checked against
    the session's ``spec`` and the index of the last frame taken (None: none yet);
    ``FrameError`` naming the frame and what was wrong otherwise. JPEG images are
    checked when decoded (``decode_image``)."""
    after = "" if last_index is None else f" (the frame after frame {last_index})"
    if len(data) < HEADER_BYTES:
        raise FrameError(
            f"a binary frame of {len(data)} bytes{after}: shorter than the {HEADER_BYTES}-byte header "
            "(frame index uint32, capture time in microseconds uint64, both big-endian)"
        )
    index, capture_us = HEADER.unpack_from(data)
    if last_index is not None and index <= last_index:
        raise FrameError(
            f"frame {index}: its index is not above the last frame's ({last_index}); frame indexes must increase",
            index,
        )
    image = bytes(data[HEADER_BYTES:])
    if spec.format == "raw":
        expected = spec.width * spec.height * 3
        if len(image) != expected:
            raise FrameError(
                f"frame {index}: {len(image)} bytes of raw RGB after the header; a {spec.width}x{spec.height} "
                f"frame (input.width x input.height) is {expected}",
                index,
            )
    elif not image:
        raise FrameError(f"frame {index}: no image after the header", index)
    elif (size := jpeg_size(image)) is not None and size != (spec.width, spec.height):
        raise FrameError(_wrong_size(index, size, spec), index)
    return InputFrame(index=index, capture_us=capture_us, image=image, received_at=received_at)


SOF_MARKERS = frozenset({0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF})
"""The JPEG start-of-frame markers: their segment holds the image's height and width."""


def jpeg_size(image: bytes) -> tuple[int, int] | None:
    """A JPEG's ``(width, height)`` from its start-of-frame segment, read without
    decoding it (so a frame of another size is refused before it costs a decode);
    None when the bytes do not read as a JPEG's segments (the decoder then says why)."""
    if image[:2] != b"\xff\xd8":
        return None
    at = 2
    while at + 4 <= len(image):
        if image[at] != 0xFF:  # stray bytes before a marker: decoders pass over them, and so does this
            at = image.find(b"\xff", at)
            if at < 0 or at + 4 > len(image):
                return None
        marker = image[at + 1]
        if marker == 0xFF:  # fill byte
            at += 1
            continue
        length = int.from_bytes(image[at + 2 : at + 4], "big")
        if marker in SOF_MARKERS:
            if at + 9 > len(image):
                return None
            height = int.from_bytes(image[at + 5 : at + 7], "big")
            width = int.from_bytes(image[at + 7 : at + 9], "big")
            return width, height
        if marker == 0xDA or length < 2:  # the scan began before any frame header: not a JPEG we can read
            return None
        at += 2 + length
    return None


def _wrong_size(index: int, size: tuple[int, int], spec: VideoInput) -> str:
    return (
        f"frame {index}: a {size[0]}x{size[1]} image; the session's input is {spec.width}x{spec.height} "
        "(input.width x input.height)"
    )


class JpegDecoder:
    """A session's JPEG decoder (PyAV's mjpeg): used by one thread at a time. It
    decodes no picture much larger than ``width x height`` (FFmpeg's own bound,
    ``max_pixels``, checked before the picture is allocated): a frame of another
    size is refused anyway (``decode_image``), and one that claims a huge size
    must not cost its decode."""

    def __init__(self, width: int, height: int) -> None:
        # FFmpeg checks the size it allocates, the width padded (to 64 here): the bound is padded alike.
        self.max_pixels = -(-width // 64) * 64 * -(-height // 64) * 64
        self._codec = self._fresh()

    def _fresh(self) -> av.CodecContext:
        codec = av.CodecContext.create("mjpeg", "r")
        codec.options = {"max_pixels": str(self.max_pixels)}
        return codec

    def decode(self, image: bytes) -> av.VideoFrame:
        """The one picture ``image`` holds; ``ValueError`` saying why when there is none."""
        try:
            pictures = self._codec.decode(av.Packet(image))
        except av.FFmpegError as error:
            self._codec = self._fresh()  # a fresh one after a failure
            raise ValueError(str(error)) from None
        if not pictures:
            raise ValueError("no picture in it")
        return pictures[-1]


def decode_image(frame: InputFrame, spec: VideoInput, decoder: JpegDecoder | None) -> np.ndarray:
    """``frame``'s image as uint8 RGB ``[height, width, 3]`` (not on the event loop:
    a JPEG is decoded here); ``FrameError`` naming the frame when a JPEG does not
    decode or is not ``input.width x input.height``."""
    if spec.format == "raw":
        return np.frombuffer(frame.image, dtype=np.uint8).reshape(spec.height, spec.width, 3)
    try:
        picture = (decoder or JpegDecoder(spec.width, spec.height)).decode(frame.image)
    except ValueError as error:
        if (size := jpeg_size(frame.image)) is not None and size != (spec.width, spec.height):
            raise FrameError(_wrong_size(frame.index, size, spec), frame.index) from None  # the decoder's bound
        raise FrameError(f"frame {frame.index}: not a JPEG image that decodes ({error})", frame.index) from None
    if (picture.width, picture.height) != (spec.width, spec.height):
        raise FrameError(_wrong_size(frame.index, (picture.width, picture.height), spec), frame.index)
    return picture.to_ndarray(format="rgb24")


def chunk_frames(chunk_index: int, geometry: SessionGeometry) -> int:
    """Input frames chunk ``chunk_index`` takes: ``first_chunk_frames`` for chunk 0, ``frames_per_chunk`` after."""
    return geometry.first_chunk_frames if chunk_index == 0 else geometry.frames_per_chunk


class FrameGatherer:
    """Frames taken and not yet handed to the engine, oldest first, at most
    ``capacity``: one more drops the oldest (``add`` returns it, ``dropped``
    counts them). ``last_index`` is the newest frame index taken, for
    ``parse_frame``'s increasing-index check."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.waiting: deque[InputFrame] = deque()
        self.dropped = 0  # frames dropped for want of room, over the session
        self.taken = 0  # frames taken (added), over the session
        self.last_index: int | None = None

    def __len__(self) -> int:
        return len(self.waiting)

    def add(self, frame: InputFrame) -> list[InputFrame]:
        """Take ``frame`` (its index above ``last_index``: ``parse_frame`` checked it);
        the frames dropped to make room for it, oldest first."""
        self.waiting.append(frame)
        self.taken += 1
        self.last_index = frame.index
        dropped = []
        while len(self.waiting) > self.capacity:
            dropped.append(self.waiting.popleft())
        self.dropped += len(dropped)
        return dropped

    def take(self, count: int) -> list[InputFrame]:
        """The oldest ``count`` frames waiting (fewer if fewer wait), removed."""
        return [self.waiting.popleft() for _ in range(min(count, len(self.waiting)))]


class InputSink(Protocol):
    """Where a session's input goes: ``rtvideo.engine.client.session_handle.SessionHandle``."""

    geometry: SessionGeometry

    async def send_input(self, chunk_index: int, frames: np.ndarray) -> None: ...


@dataclass(frozen=True)
class ChunkInput:
    """The client frames that made one chunk, in order, and when each arrived."""

    indexes: tuple[int, ...]
    received_at: tuple[float, ...]


class InputFeeder:
    """One session's input: frames in (``receive``), chunks out to ``sink`` in
    order (the task ``run``), each handed over once the engine has made enough of
    the chunks before it (``made``). ``on_error`` gets each frame refused while
    decoding (those refused on arrival ``receive`` raises). ``num_chunks``: the
    session's chunks (None: until stopped); no input is taken past its last."""

    def __init__(
        self,
        spec: VideoInput,
        sink: InputSink,
        metrics: Metrics,
        on_error: Callable[[FrameError], None],
        num_chunks: int | None = None,
    ) -> None:
        self.spec = spec
        self.sink = sink
        self.geometry = sink.geometry
        self.metrics = metrics
        self.on_error = on_error
        self.num_chunks = num_chunks
        most = max(self.geometry.first_chunk_frames, self.geometry.frames_per_chunk)
        self.gatherer = FrameGatherer(MAX_CHUNKS_WAITING * most)
        self.next_chunk = 0  # the chunk whose input is gathered next
        self.chunks_made = 0  # chunks the engine has made (the newest index made + 1)
        self.sent: dict[int, ChunkInput] = {}  # chunk index -> its input, until its output is written
        self.invalid = 0  # frames refused, over the session
        self._decoder = JpegDecoder(spec.width, spec.height) if spec.format == "jpeg" else None
        self._wake = asyncio.Event()  # set by what may let the task go on (a frame, a chunk made)
        self._idle = asyncio.Event()  # set while the task waits with nothing it can do (``settled``)

    def release(self) -> None:
        """The session is over: the frames waiting and the decoder's pictures go now,
        not when the last reference to this feeder does."""
        self.gatherer.waiting.clear()
        if self._decoder is not None:
            self._decoder = JpegDecoder(self.spec.width, self.spec.height)

    @property
    def dropped(self) -> int:
        return self.gatherer.dropped

    @property
    def done(self) -> bool:
        """The last chunk's input was handed over: no more is taken."""
        return self.num_chunks is not None and self.next_chunk >= self.num_chunks

    def receive(self, data: bytes, received_at: float | None = None) -> None:
        """One binary frame from a controller: taken (dropping the oldest waiting
        when there is no room), or ``FrameError`` saying why not. Frames past the
        session's last chunk are ignored."""
        received_at = time.monotonic() if received_at is None else received_at
        self.metrics.input_received.inc()
        try:
            frame = parse_frame(data, self.spec, self.gatherer.last_index, received_at)
        except FrameError:
            self.invalid += 1
            self.metrics.input_invalid.inc()
            raise
        if self.done:
            return
        dropped = self.gatherer.add(frame)
        if dropped:
            self.metrics.input_dropped.inc(len(dropped))
        self._poke()

    def made(self, chunk_index: int) -> None:
        """The engine made chunk ``chunk_index``: its successors' input may go."""
        if chunk_index + 1 > self.chunks_made:
            self.chunks_made = chunk_index + 1
            self._poke()

    def _poke(self) -> None:
        self._idle.clear()
        self._wake.set()

    async def settled(self) -> None:
        """Return once the task waits with nothing it can do: for frames, or for the
        engine to make a chunk (all it could hand over is handed over)."""
        await self._idle.wait()

    def written(self, chunk_index: int, frames: int, now: float | None = None) -> ChunkInput | None:
        """The first ``frames`` output frames of chunk ``chunk_index`` were written to
        a controller's socket: each input frame's latency, from its arrival, is
        observed once (the first write of a chunk; earlier chunks never written
        are forgotten). The chunk's input, or None when it is not known."""
        now = time.monotonic() if now is None else now
        for older in [k for k in self.sent if k < chunk_index]:
            del self.sent[older]
        taken = self.sent.pop(chunk_index, None)
        if taken is not None:
            for received_at in taken.received_at[:frames]:
                self.metrics.input_latency.observe(max(0.0, now - received_at))
        return taken

    def _ready(self, have: int) -> bool:
        """Chunk ``next_chunk`` may be gathered: the engine is near enough and its frames wait."""
        need = chunk_frames(self.next_chunk, self.geometry) - have
        return self.next_chunk < self.chunks_made + MAX_CHUNKS_AHEAD and len(self.gatherer) >= need

    def _decode(self, frames: Sequence[InputFrame]) -> tuple[list[tuple[InputFrame, np.ndarray]], list[FrameError]]:
        """Decode ``frames`` (in a thread): the good ones with their pixels, and the errors."""
        good, errors = [], []
        for frame in frames:
            try:
                good.append((frame, decode_image(frame, self.spec, self._decoder)))
            except FrameError as error:
                # Without its traceback: that holds the decode's frames (a picture as large as the
                # image claimed) and this one's, whose list holds the error: a cycle only a full
                # collection would free.
                errors.append(error.with_traceback(None))
        return good, errors

    async def run(self) -> None:
        """Gather, decode and hand over each chunk's input, in order, until the
        last chunk's (or until cancelled, when the session ends). An engine that no
        longer takes the session's input ends it quietly: the session's own
        result stream says why."""
        assembled: list[tuple[InputFrame, np.ndarray]] = []
        while not self.done:
            while not self._ready(len(assembled)):
                self._wake.clear()
                self._idle.set()
                await self._wake.wait()
            need = chunk_frames(self.next_chunk, self.geometry)
            good, errors = await asyncio.to_thread(self._decode, self.gatherer.take(need - len(assembled)))
            for error in errors:
                self.invalid += 1
                self.metrics.input_invalid.inc()
                self.on_error(error)
            assembled += good
            if len(assembled) < need:
                continue  # a frame did not decode: the next one waiting takes its place
            chunk = self.next_chunk
            self.sent[chunk] = ChunkInput(
                indexes=tuple(f.index for f, _ in assembled), received_at=tuple(f.received_at for f, _ in assembled)
            )
            frames = np.stack([pixels for _, pixels in assembled])
            assembled = []
            self.next_chunk += 1
            try:
                await self.sink.send_input(chunk, frames)
            except EngineError as error:
                log.info("input of chunk %d not taken (%s); the session is ending", chunk, error)
                return
        self._idle.set()
