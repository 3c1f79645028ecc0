"""A job's input video (``input_reference``): decoded with PyAV, scaled to the
job's size and retimed to its fps (``ReferenceVideo``), refused naming the
field when it does not decode, and handed to the engine chunk by chunk, the
last filled out with the video's last frame (``ReferenceFeeder``)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from rtvideo.engine.messages import SessionGeometry
from rtvideo.server.schemas import RequestError
from rtvideo.server.video_input import MAX_CHUNKS_AHEAD
from rtvideo.server.video_reference import ReferenceFeeder, ReferenceVideo
from tests.support import video_file

W, H = 16, 12


def picture(index: int) -> np.ndarray:
    return np.random.default_rng(index).integers(0, 256, (H, W, 3), dtype=np.uint8)


SOURCE = [picture(i) for i in range(8)]  # 8 frames at 8 fps: one second


def which(image: np.ndarray) -> int:
    """The source frame ``image`` is, exactly."""
    return next(i for i, source in enumerate(SOURCE) if np.array_equal(image, source))


@pytest.mark.parametrize(
    ("fps", "expected"),
    [
        (8.0, [0, 1, 2, 3, 4, 5, 6, 7]),  # the same rate: each frame once
        (16.0, [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7]),  # twice the rate: each frame twice
        (4.0, [0, 2, 4, 6]),  # half the rate: every other frame
        (5.0, [0, 1, 3, 4, 6]),  # frame j at j / 5 s shows the latest source frame at that time
    ],
)
def test_a_video_is_retimed_to_the_jobs_fps_keeping_its_length(fps, expected):
    video = ReferenceVideo.open(video_file(SOURCE, 8), W, H, fps)
    frames = list(video.frames())
    assert video.count == len(frames) == len(expected)
    assert [which(f) for f in frames] == expected


def test_timestamps_rounded_by_the_container_do_not_repeat_or_skip_a_frame():
    video = ReferenceVideo.open(video_file(SOURCE, 16), W, H, 16.0)  # Matroska: 62.5 ms stored as 63
    assert [which(f) for f in video.frames()] == list(range(8))


def test_a_video_is_scaled_to_the_jobs_size():
    video = ReferenceVideo.open(video_file(SOURCE, 8), 8, 6, 8.0)
    frames = list(video.frames())
    assert len(frames) == 8 and all(f.shape == (6, 8, 3) and f.dtype == np.uint8 for f in frames)


def test_an_h264_mp4_decodes():
    video = ReferenceVideo.open(video_file(SOURCE, 8, codec="libx264", container="mp4"), W, H, 16.0)
    assert video.count == 16


@pytest.mark.parametrize(
    ("data", "says"),
    [
        (b"", "input_reference: the file is empty"),
        (b"not a video at all" * 50, "input_reference: not a video file that decodes"),
        (b"\x89PNG", "input_reference: not a video file that decodes"),
    ],
)
def test_a_file_that_does_not_decode_is_refused_naming_the_field(data, says):
    with pytest.raises(RequestError) as refused:
        ReferenceVideo.open(data, W, H, 16.0)
    assert str(refused.value).startswith(says), str(refused.value)


class Sink:
    geometry = SessionGeometry(
        width=W, height=H, fps=8.0, num_inference_steps=1, first_chunk_frames=3, frames_per_chunk=2,
        num_chunks=None, transition_chunks=0,
    )  # fmt: skip

    def __init__(self) -> None:
        self.chunks: list[tuple[int, np.ndarray]] = []
        self.arrived = asyncio.Condition()

    async def send_input(self, chunk_index: int, frames: np.ndarray) -> None:
        async with self.arrived:
            self.chunks.append((chunk_index, frames))
            self.arrived.notify_all()

    async def wait_for(self, count: int) -> None:
        async with self.arrived:
            await asyncio.wait_for(self.arrived.wait_for(lambda: len(self.chunks) >= count), 10)


async def test_the_feeder_hands_chunks_over_in_order_ahead_of_the_engine_and_fills_the_last():
    video = ReferenceVideo.open(video_file(SOURCE, 8), W, H, 8.0)
    sink = Sink()
    feeder = ReferenceFeeder(video, sink, num_chunks=4)  # 3 + 2 + 2 + 2 = 9 frames of an 8-frame video
    task = asyncio.create_task(feeder.run())
    await sink.wait_for(MAX_CHUNKS_AHEAD)
    assert [k for k, _ in sink.chunks] == list(range(MAX_CHUNKS_AHEAD))
    for k in range(4 - MAX_CHUNKS_AHEAD):
        assert len(sink.chunks) == MAX_CHUNKS_AHEAD + k  # no further ahead than the engine made
        feeder.made(k)
        await sink.wait_for(MAX_CHUNKS_AHEAD + k + 1)
    await asyncio.wait_for(task, 10)
    assert [k for k, _ in sink.chunks] == [0, 1, 2, 3]
    assert [len(f) for _, f in sink.chunks] == [3, 2, 2, 2]
    sent = np.concatenate([f for _, f in sink.chunks])
    assert [which(f) for f in sent] == [0, 1, 2, 3, 4, 5, 6, 7, 7]  # the last frame fills the last chunk
