"""A job's input video (``input_reference``): decoded with PyAV, scaled to the
job's size and retimed to its fps (``ReferenceVideo``), refused naming the
field when it does not decode, and handed to the engine chunk by chunk, the
last filled out with the video's last frame (``ReferenceFeeder``)."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from rtvideo.engine.messages import SessionGeometry
from rtvideo.server import video_reference
from rtvideo.server.schemas import RequestError
from rtvideo.server.video_input import MAX_CHUNKS_AHEAD
from rtvideo.server.video_reference import ReferenceDecoder, ReferenceFeeder, ReferenceVideo
from tests.support import video_file

W, H = 16, 12
LIMIT = 4800  # frames a job may take: counted no further


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
    video = ReferenceVideo.open(video_file(SOURCE, 8), W, H, fps, LIMIT)
    frames = list(video.frames())
    assert video.count == len(frames) == len(expected)
    assert [which(f) for f in frames] == expected


def test_timestamps_rounded_by_the_container_do_not_repeat_or_skip_a_frame():
    video = ReferenceVideo.open(video_file(SOURCE, 16), W, H, 16.0, LIMIT)  # Matroska: 62.5 ms stored as 63
    assert [which(f) for f in video.frames()] == list(range(8))


def test_a_video_is_scaled_to_the_jobs_size():
    video = ReferenceVideo.open(video_file(SOURCE, 8), 8, 6, 8.0, LIMIT)
    frames = list(video.frames())
    assert len(frames) == 8 and all(f.shape == (6, 8, 3) and f.dtype == np.uint8 for f in frames)


def test_an_h264_mp4_decodes():
    video = ReferenceVideo.open(video_file(SOURCE, 8, codec="libx264", container="mp4"), W, H, 16.0, LIMIT)
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
        ReferenceVideo.open(data, W, H, 16.0, LIMIT)
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
    video = ReferenceVideo.open(video_file(SOURCE, 8), W, H, 8.0, LIMIT)
    sink = Sink()
    decoder = ReferenceDecoder()
    feeder = ReferenceFeeder(video, sink, num_chunks=4, decoder=decoder)  # 3 + 2 + 2 + 2 = 9 frames of an 8-frame video
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
    decoder.close()


def test_frames_are_counted_no_further_than_one_past_the_limit():
    """Two frames a day apart: at 16 fps the first is shown for 1.4 million frames,
    which counting one by one would take minutes of a core for a 2 KB file."""
    data = video_file(SOURCE[:2], 8, times_ms=[0, 86_400_000])
    assert ReferenceVideo.open(data, W, H, 16.0, 100).count == 101
    whole = ReferenceVideo.open(video_file(SOURCE, 8), W, H, 8.0, 8)
    assert whole.count == 8 and len(list(whole.frames())) == 8  # a video within the limit is counted whole


@pytest.mark.parametrize("rate", [1, 8, 30])
def test_a_file_of_one_frame_is_a_still_whatever_its_frame_rate(rate):
    video = ReferenceVideo.open(video_file(SOURCE[:1], rate), W, H, 16.0, LIMIT)
    assert video.still and video.count == 1
    assert [which(f) for f in video.frames()] == [0]


def test_a_frame_past_the_pixel_bound_is_refused_before_it_is_decoded(monkeypatch):
    monkeypatch.setattr(video_reference, "MAX_SOURCE_PIXELS", W * H - 1)
    with pytest.raises(RequestError) as refused:
        ReferenceVideo.open(video_file(SOURCE, 8), W, H, 8.0, LIMIT)
    assert str(refused.value).startswith(f"input_reference: {W}x{H} frames; frames of at most {W * H - 1} pixels")


def test_the_check_stops_past_its_time_budget_or_once_its_request_is_gone(monkeypatch):
    stop = threading.Event()
    stop.set()
    with pytest.raises(RequestError, match="input_reference: the decode was abandoned"):
        ReferenceVideo.open(video_file(SOURCE, 8), W, H, 8.0, LIMIT, stop)
    monkeypatch.setattr(video_reference, "DECODE_BUDGET_S", -1.0)
    with pytest.raises(RequestError, match="input_reference: the video took longer than -1 s to decode"):
        ReferenceVideo.open(video_file(SOURCE, 8), W, H, 8.0, LIMIT)


async def test_input_videos_decode_on_threads_of_their_own_and_checks_never_hold_up_a_running_jobs_input():
    """Not on the default executor, which encodes every session's chunks; and the
    checks of new inputs (up to a minute each) on threads apart from a running
    job's chunks: here both check threads are held, and a chunk still decodes."""
    decoder = ReferenceDecoder()
    held = threading.Event()
    try:
        names = await asyncio.gather(*(decoder.run(lambda: threading.current_thread().name) for _ in range(4)))
        assert all(name.startswith("input-feed") for name in names), names
        video = await decoder.open(video_file(SOURCE, 8), W, H, 8.0, LIMIT)
        assert video.count == 8
        checks = [
            asyncio.get_running_loop().run_in_executor(decoder._checks, held.wait, 60)
            for _ in range(ReferenceDecoder.CHECK_THREADS)
        ]
        frames = video.frames()
        assert which(await asyncio.wait_for(decoder.run(next, frames), 10)) == 0
    finally:
        held.set()
        decoder.close()
    await asyncio.gather(*checks)
