"""A job's input video (``POST /v1/videos`` with the file ``input_reference``).

API process; PyAV decodes, always in a thread (``asyncio.to_thread``), never on
the event loop. ``ReferenceVideo.open`` decodes the file once to check it and
count its frames at the job's rate, so a file that does not decode, or is too
short, is refused (``RequestError`` naming ``input_reference``) before the job
exists; ``frames`` decodes it again as the job runs, one chunk at a time, so a
long video is never held whole in memory.

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
import logging
from collections.abc import Iterator
from fractions import Fraction

import av
import numpy as np

from rtvideo.engine.client.errors import EngineError
from rtvideo.server.schemas import RequestError
from rtvideo.server.video_input import MAX_CHUNKS_AHEAD, InputSink, chunk_frames

log = logging.getLogger(__name__)

FIELD = "input_reference"


def _retimed(data: bytes, fps: float) -> Iterator[av.VideoFrame]:
    """The video in ``data`` as frames at ``fps`` (the module's resampling rule),
    not yet scaled; ``RequestError`` naming the field when it does not decode."""
    try:
        container = av.open(io.BytesIO(data), mode="r")
    except (av.FFmpegError, ValueError, OSError) as error:
        raise RequestError(f"{FIELD}: not a video file that decodes ({error})") from None
    with container:
        if not container.streams.video:
            raise RequestError(f"{FIELD}: the file holds no video stream")
        stream = container.streams.video[0]
        rate = stream.average_rate or stream.guessed_rate or Fraction(25)
        period = 1.0 / float(rate)
        slack = min(period, 1.0 / fps) / 8  # container timestamps are rounded (Matroska: to the millisecond)
        shown: av.VideoFrame | None = None  # the source frame shown now
        first: float | None = None
        last_time = 0.0
        j = 0
        try:
            for index, frame in enumerate(container.decode(stream)):
                time = frame.time if frame.time is not None else index * period
                first = time if first is None else first
                time -= first
                if shown is not None and time <= last_time:
                    continue  # a frame not after the one before it: not shown
                while shown is not None and j / fps + slack < time:
                    yield shown
                    j += 1
                shown, last_time = frame, time
        except av.FFmpegError as error:
            raise RequestError(f"{FIELD}: the video stopped decoding after {j} frames ({error})") from None
        if shown is None:
            raise RequestError(f"{FIELD}: the video has no frame that decodes")
        while j / fps + slack < last_time + period:
            yield shown
            j += 1


class ReferenceVideo:
    """A job's input video, checked (``open``), and its frames at the job's size and rate (``frames``)."""

    def __init__(self, data: bytes, width: int, height: int, fps: float, count: int) -> None:
        self.data = data
        self.width, self.height, self.fps = width, height, fps
        self.count = count  # frames at ``fps``

    @classmethod
    def open(cls, data: bytes, width: int, height: int, fps: float) -> ReferenceVideo:
        """Decode ``data`` once (call it in a thread): its frame count at ``fps``;
        ``RequestError`` naming ``input_reference`` for a file that does not decode."""
        if not data:
            raise RequestError(f"{FIELD}: the file is empty")
        count = sum(1 for _ in _retimed(data, fps))
        return cls(data, width, height, fps, count)

    def frames(self) -> Iterator[np.ndarray]:
        """Its frames, uint8 RGB ``[height, width, 3]``, ``count`` of them, decoded as
        they are asked for (each ``next`` in a thread)."""
        converted: tuple[av.VideoFrame, np.ndarray] | None = None
        for frame in _retimed(self.data, self.fps):
            if converted is None or converted[0] is not frame:  # a repeated frame is converted once
                image = frame.reformat(width=self.width, height=self.height, format="rgb24").to_ndarray()
                converted = (frame, image)
            yield converted[1]


class ReferenceFeeder:
    """Hands a job's input video to its engine session, chunk by chunk, in order,
    at most ``MAX_CHUNKS_AHEAD`` chunks ahead of what the engine made (``made``)."""

    def __init__(self, video: ReferenceVideo, sink: InputSink, num_chunks: int) -> None:
        self.video = video
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
            images = await asyncio.to_thread(take, chunk_frames(chunk, self.sink.geometry))
            try:
                await self.sink.send_input(chunk, images)
            except EngineError as error:
                log.info("job input of chunk %d not taken (%s); the job is ending", chunk, error)
                return
