"""A job's input video (``POST /v1/videos`` with the file ``input_reference``).

API process; PyAV decodes on threads of its own (``ReferenceDecoder``), never
on the event loop, nor on the threads that encode sessions' chunks.
``ReferenceVideo.open`` decodes the file once to check it and count its frames
at the job's rate, so a file that does not decode, or is too short, is
refused (``RequestError`` naming ``input_reference``) before the job exists;
``frames`` decodes it again as the job runs, one chunk at a time, so a long
video is never held whole in memory.

**Bounds.** A file is untrusted and small files can describe a great deal:
frames are counted no further than one past what the job may take (a frame
rate of one frame a day repeats no frame a billion times), a frame of more
than ``MAX_SOURCE_PIXELS`` is refused before it is decoded, and the check may
decode for ``DECODE_BUDGET_S`` at most; a request that goes away stops its
decode.

**Resampling.** Frames are scaled to the job's ``width x height`` (stretched
when the aspect differs: PyAV's scaler, bicubic) and retimed to its ``fps``:
output frame j, at ``j / fps`` seconds from the video's first frame, is the
latest source frame shown at that time (a source frame is shown from its
timestamp until the next one's, the last for one source frame period;
timestamps within an eighth of the shorter frame period count as equal, as
containers round them, Matroska to the millisecond). So a faster source
drops frames and a slower one repeats them; the video's length in seconds is
kept.

``ReferenceFeeder`` hands the frames to the engine chunk by chunk
(``SessionHandle.send_input``), at most ``MAX_CHUNKS_AHEAD`` chunks ahead of
what the engine has made (as a realtime session's input goes); the last chunk
is filled out by repeating the video's last frame (the job's video is trimmed
to its length).
"""

from __future__ import annotations

import asyncio
import io
import itertools
import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction
from time import monotonic as time_now
from typing import Any, TypeVar

import av
import numpy as np

from rtvideo.engine.client.errors import EngineError
from rtvideo.server.schemas import RequestError
from rtvideo.server.video_input import MAX_CHUNKS_AHEAD, InputSink, chunk_frames

log = logging.getLogger(__name__)

FIELD = "input_reference"
MAX_SOURCE_PIXELS = 4096 * 4096
"""The largest input frame decoded, in pixels (4K UHD and DCI 4K pass, 8K does
not): a frame is scaled down to the job's size, so more is a cost, not detail."""
DECODE_BUDGET_S = 60.0
"""The longest the check of an input video (``ReferenceVideo.open``) may decode."""
T = TypeVar("T")


class _Decoding:
    """One pass over a file's video stream, within bounds: a frame of more than
    ``MAX_SOURCE_PIXELS`` is refused before FFmpeg allocates it (the stream's
    header is read first; FFmpeg's ``max_pixels`` stops a frame that grows
    mid-stream), and, with a ``deadline`` (``time.monotonic()``), so is a pass
    that decodes past it, as is one whose ``stop`` is set (its request gone).
    Every refusal is a ``RequestError`` naming the field."""

    def __init__(self, data: bytes, deadline: float | None = None, stop: threading.Event | None = None) -> None:
        self.deadline, self.stop = deadline, stop
        try:
            self.container = av.open(io.BytesIO(data), mode="r")
        except (av.FFmpegError, ValueError, OSError) as error:
            raise RequestError(f"{FIELD}: not a video file that decodes ({error})") from None
        if not self.container.streams.video:
            self.container.close()
            raise RequestError(f"{FIELD}: the file holds no video stream")
        self.stream = self.container.streams.video[0]
        context = self.stream.codec_context
        if context.width * context.height > MAX_SOURCE_PIXELS:
            self.container.close()
            raise RequestError(_too_large(context.width, context.height))
        context.options = {"max_pixels": str(MAX_SOURCE_PIXELS)}
        rate = self.stream.average_rate or self.stream.guessed_rate or Fraction(25)
        self.period = 1.0 / float(rate)
        self.decoded = 0  # source frames decoded

    def __enter__(self) -> _Decoding:
        return self

    def __exit__(self, *_: object) -> None:
        self.container.close()

    def shown(self) -> Iterator[tuple[float, av.VideoFrame]]:
        """The source frames shown, each with its time from the first frame's; a
        frame not after the one before it is not shown."""
        first: float | None = None
        last_time = 0.0
        try:
            for frame in self.container.decode(self.stream):
                self._check(frame)
                time = frame.time if frame.time is not None else self.decoded * self.period
                self.decoded += 1
                first = time if first is None else first
                time -= first
                if self.decoded > 1 and time <= last_time:
                    continue
                last_time = time
                yield time, frame
        except av.FFmpegError as error:
            raise RequestError(f"{FIELD}: the video stopped decoding after {self.decoded} frames ({error})") from None

    def _check(self, frame: av.VideoFrame) -> None:
        if frame.width * frame.height > MAX_SOURCE_PIXELS:
            raise RequestError(_too_large(frame.width, frame.height))
        if self.stop is not None and self.stop.is_set():
            raise RequestError(f"{FIELD}: the decode was abandoned (the request ended)")
        if self.deadline is not None and time_now() > self.deadline:
            raise RequestError(
                f"{FIELD}: the video took longer than {DECODE_BUDGET_S:g} s to decode "
                f"({self.decoded} frames decoded); give a shorter or smaller video"
            )

    def retimed(self, shown: Iterable[tuple[float, av.VideoFrame]], fps: float) -> Iterator[av.VideoFrame]:
        """``shown``'s frames at ``fps`` (the module's resampling rule), not yet scaled."""
        slack = min(self.period, 1.0 / fps) / 8  # container timestamps are rounded (Matroska: to the millisecond)
        frame: av.VideoFrame | None = None  # the source frame shown now
        last_time = 0.0
        j = 0
        for time, following in shown:
            while frame is not None and j / fps + slack < time:
                yield frame
                j += 1
            frame, last_time = following, time
        if frame is None:
            raise RequestError(f"{FIELD}: the video has no frame that decodes")
        while j / fps + slack < last_time + self.period:
            yield frame
            j += 1


def _too_large(width: int, height: int) -> str:
    return (
        f"{FIELD}: {width}x{height} frames; frames of at most {MAX_SOURCE_PIXELS} pixels "
        "(4096x4096) are taken: scale the video down"
    )


class ReferenceVideo:
    """A job's input video, checked (``open``), and its frames at the job's size and rate (``frames``)."""

    def __init__(self, data: bytes, width: int, height: int, fps: float, count: int) -> None:
        self.data = data
        self.width, self.height, self.fps = width, height, fps
        self.count = count  # frames at ``fps`` (one: a still image), at most one past ``open``'s ``limit``

    @property
    def still(self) -> bool:
        """One frame, standing for every frame of a job (a still image, or any file of one frame)."""
        return self.count == 1

    @classmethod
    def open(
        cls, data: bytes, width: int, height: int, fps: float, limit: int, stop: threading.Event | None = None
    ) -> ReferenceVideo:
        """Decode ``data`` once (call it in a thread, ``ReferenceDecoder.open``): its
        frame count at ``fps``, counted no further than ``limit + 1`` (a count past
        ``limit`` is all a caller needs to refuse it); a file of one source frame
        counts one, whatever its frame rate says (a still image). ``RequestError``
        naming ``input_reference`` for a file that does not decode, or does not
        within the bounds ``_Decoding`` keeps (``DECODE_BUDGET_S`` included)."""
        if not data:
            raise RequestError(f"{FIELD}: the file is empty")
        with _Decoding(data, deadline=time_now() + DECODE_BUDGET_S, stop=stop) as decoding:
            shown = decoding.shown()
            firsts = list(itertools.islice(shown, 2))
            if len(firsts) == 1:
                count = 1
            else:
                frames = decoding.retimed(itertools.chain(firsts, shown), fps)
                count = sum(1 for _ in itertools.islice(frames, limit + 1))
        return cls(data, width, height, fps, count)

    def frames(self) -> Iterator[np.ndarray]:
        """Its frames, uint8 RGB ``[height, width, 3]``, ``count`` of them, decoded as
        they are asked for (each ``next`` in a thread)."""
        converted: tuple[av.VideoFrame, np.ndarray] | None = None
        with _Decoding(self.data) as decoding:
            for frame in itertools.islice(decoding.retimed(decoding.shown(), self.fps), self.count):
                if converted is None or converted[0] is not frame:  # a repeated frame is converted once
                    image = frame.reformat(width=self.width, height=self.height, format="rgb24").to_ndarray()
                    converted = (frame, image)
                yield converted[1]


class ReferenceDecoder:
    """The threads that decode jobs' input videos, apart from the default executor
    the server encodes its chunks on, so a costly input never holds up another
    session's output: ``CHECK_THREADS`` for the checks of new inputs (``open``,
    up to ``DECODE_BUDGET_S`` each), and ``FEED_THREADS`` of their own for
    running jobs' chunks (``run``), so that checks, however slow, never hold up
    a running job's input either. ``close`` at shutdown abandons what runs."""

    CHECK_THREADS = 2
    FEED_THREADS = 2

    def __init__(self) -> None:
        self._checks = ThreadPoolExecutor(self.CHECK_THREADS, thread_name_prefix="input-check")
        self._feeds = ThreadPoolExecutor(self.FEED_THREADS, thread_name_prefix="input-feed")
        self._stops: set[threading.Event] = set()

    async def open(self, data: bytes, width: int, height: int, fps: float, limit: int) -> ReferenceVideo:
        """``ReferenceVideo.open`` on the checks' threads; a caller cancelled (its
        request gone) stops the decode at its next frame."""
        stop = threading.Event()
        self._stops.add(stop)
        try:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._checks, ReferenceVideo.open, data, width, height, fps, limit, stop)
        finally:
            stop.set()
            self._stops.discard(stop)

    async def run(self, function: Callable[..., T], *args: Any) -> T:
        """``function(*args)`` on the feeding threads: a running job's next chunk."""
        return await asyncio.get_running_loop().run_in_executor(self._feeds, function, *args)

    def close(self) -> None:
        for stop in self._stops:
            stop.set()
        for executor in (self._checks, self._feeds):
            executor.shutdown(wait=False, cancel_futures=True)


class ReferenceFeeder:
    """Hands a job's input video to its engine session, chunk by chunk, in order,
    at most ``MAX_CHUNKS_AHEAD`` chunks ahead of what the engine made (``made``)."""

    def __init__(self, video: ReferenceVideo, sink: InputSink, num_chunks: int, decoder: ReferenceDecoder) -> None:
        self.video = video
        self.decoder = decoder
        self.sink = sink
        self.num_chunks = num_chunks
        self.chunks_made = 0
        self._wake = asyncio.Event()

    def made(self, chunk_index: int) -> None:
        """The engine made chunk ``chunk_index``."""
        if chunk_index + 1 > self.chunks_made:
            self.chunks_made = chunk_index + 1
            self._wake.set()

    async def run(self) -> None:
        frames = self.video.frames()
        last: np.ndarray | None = None

        def take(count: int) -> np.ndarray:
            nonlocal last
            out = []
            for _ in range(count):
                last = next(frames, last)  # past the video's end: its last frame again
                out.append(last)
            return np.stack(out)

        for chunk in range(self.num_chunks):
            while chunk >= self.chunks_made + MAX_CHUNKS_AHEAD:
                self._wake.clear()
                await self._wake.wait()
            images = await self.decoder.run(take, chunk_frames(chunk, self.sink.geometry))
            try:
                await self.sink.send_input(chunk, images)
            except EngineError as error:
                log.info("job input of chunk %d not taken (%s); the job is ending", chunk, error)
                return
