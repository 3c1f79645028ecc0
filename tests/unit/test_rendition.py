"""``Rendition``: one more format of a session's media, encoded once and fanned
out, on a task of its own, its end after its chunks, and giving up when it
falls behind."""

from __future__ import annotations

import asyncio
import io
import threading

import av
import numpy as np
import pytest

from rtvideo.server import rendition as rendition_module
from rtvideo.server.media import split_jpeg_payload
from rtvideo.server.rendition import MAX_BACKLOG, Rendition


class Viewer:
    def __init__(self) -> None:
        self.got: list = []

    def send_chunk(self, chunk) -> None:
        self.got.append(("chunk", chunk))

    def send_event(self, event) -> None:
        self.got.append(("event", event))

    def session_ended(self, code, reason) -> None:
        self.got.append(("end", code))


def frames(index: int, count: int = 4) -> np.ndarray:
    rng = np.random.default_rng(index)
    return rng.integers(0, 255, (count, 16, 16, 3), dtype=np.uint8)


def metadata(index: int, count: int = 4) -> dict:
    return {
        "generation_chunk_index": index,
        "num_frames": count,
        "first_frame_index": index * count,
        "media_start_seconds": index * count / 16,
    }


async def settle(viewer: Viewer, items: int) -> None:
    while len(viewer.got) < items:
        await asyncio.sleep(0.005)


async def test_each_chunk_is_encoded_once_for_every_viewer_and_the_end_comes_after_them():
    a, b = Viewer(), Viewer()
    slow: list[str] = []
    made = Rendition("fmp4", 16, 16, 16.0, lambda: [a, b], slow.append)
    for i in range(3, 6):  # it starts mid-session
        made.offer(i, metadata(i), frames(i), 0.01)
    made.end({"type": "session.done"}, 1000, "session done")
    await made.finished()  # the end was delivered: nothing more comes
    assert [kind for kind, _ in a.got] == ["chunk", "chunk", "chunk", "event", "end"] and not slow
    chunks = [item for kind, item in a.got if kind == "chunk"]
    assert [c.index for c in chunks] == [3, 4, 5]
    assert [c for kind, c in b.got if kind == "chunk"] == chunks  # the same objects: encoded once
    assert chunks[0].init and all(c.init == chunks[0].init for c in chunks)
    media = chunks[0].payload(with_init=True) + b"".join(c.fragment for c in chunks[1:])
    with av.open(io.BytesIO(media)) as container:
        decoded = list(container.decode(video=0))
    assert len(decoded) == 12 and decoded[0].pts is not None
    assert made.closed


async def test_a_jpeg_rendition_carries_one_image_per_frame():
    viewer = Viewer()
    made = Rendition("jpeg", 16, 16, 16.0, lambda: [viewer], print)
    made.offer(0, metadata(0), frames(0), 0.01)
    await settle(viewer, 1)
    [(_, chunk)] = viewer.got
    assert len(split_jpeg_payload(chunk.fragment)) == 4 and chunk.init == b""
    made.close()


async def test_a_rendition_that_falls_behind_gives_up_and_holds_nobody(monkeypatch):
    release = threading.Event()
    original = rendition_module.Rendition._encode

    def blocked(self, item):
        release.wait(10)
        return original(self, item)

    monkeypatch.setattr(rendition_module.Rendition, "_encode", blocked)
    viewer = Viewer()
    slow: list[str] = []
    made = Rendition("raw", 16, 16, 16.0, lambda: [viewer], slow.append)
    for i in range(MAX_BACKLOG + 2):  # one is being encoded, MAX_BACKLOG wait, one more is too many
        made.offer(i, metadata(i), frames(i), 0.01)
        await asyncio.sleep(0)
    assert made.closed and len(slow) == 1 and "raw" in slow[0] and "behind" in slow[0]
    made.offer(99, metadata(99), frames(99), 0.01)  # ignored once closed
    await made.finished()  # closed: its task is over, so nothing it held can reach a viewer
    release.set()
    assert viewer.got == []  # what waited was dropped


def test_fmp4_needs_an_even_frame():
    async def make():
        Rendition("fmp4", 15, 16, 16.0, list, print)

    with pytest.raises(ValueError, match="even width and height"):
        asyncio.run(make())
