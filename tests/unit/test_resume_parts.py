"""The pure parts of sessions that outlive a connection: the resume buffer, the
registry of live sessions by token, and the tokens themselves."""

from __future__ import annotations

import pytest

from rtvideo.server.resume_buffer import BufferedChunk, ChunkBuffer, ResumeGapError
from rtvideo.server.session_registry import SessionRegistry, new_token


def chunk(index: int, frames: int = 4, fps: float = 16.0, init: bytes = b"") -> BufferedChunk:
    metadata = {"generation_chunk_index": index, "num_frames": frames, "media_start_seconds": index * frames / fps}
    return BufferedChunk(index, metadata, f"fragment-{index}".encode(), init, 0.01, fps)


def test_the_buffer_keeps_the_newest_media_and_always_the_newest_chunk():
    buffer = ChunkBuffer(max_seconds=1.0)  # four 0.25 s chunks
    assert buffer.after(-1) == [] and buffer.newest == -1
    for i in range(10):
        buffer.add(chunk(i))
    assert [c.index for c in buffer.after(5)] == [6, 7, 8, 9]
    assert buffer.oldest == 6 and len(buffer) == 4 and buffer.nbytes == sum(len(f"fragment-{i}") for i in range(6, 10))
    assert buffer.after(9) == []
    huge = ChunkBuffer(max_seconds=0.1)
    huge.add(chunk(0))  # longer than the whole budget alone: still kept
    assert [c.index for c in huge.after(-1)] == [0]


def test_a_cleared_buffer_holds_nothing_and_still_knows_the_newest_chunk_made():
    buffer = ChunkBuffer(max_seconds=1.0)
    for i in range(3):
        buffer.add(chunk(i))
    buffer.clear()
    assert len(buffer) == 0 and buffer.nbytes == 0 and buffer.oldest is None and buffer.newest == 2
    with pytest.raises(ResumeGapError, match="chunk 1 onwards is no longer kept"):
        buffer.after(0)
    buffer.add(chunk(3))  # the media count started again from nothing
    assert [c.index for c in buffer.after(2)] == [3]


def test_a_resume_older_than_the_buffer_or_ahead_of_it_is_a_gap_naming_the_field():
    buffer = ChunkBuffer(max_seconds=0.5)
    with pytest.raises(ResumeGapError, match="last_chunk_index: 0 was never sent; no chunk was made yet"):
        buffer.after(0)
    for i in range(6):
        buffer.add(chunk(i))
    with pytest.raises(ResumeGapError, match=r"last_chunk_index: chunk 3 onwards is no longer kept .* chunks 4-5"):
        buffer.after(2)
    assert [c.index for c in buffer.after(3)] == [4, 5]
    with pytest.raises(ResumeGapError, match="6 was never sent; the newest chunk made is 5"):
        buffer.after(6)
    with pytest.raises(ValueError, match="come in order"):
        buffer.add(chunk(5))
    with pytest.raises(ValueError):
        ChunkBuffer(0)


def test_a_chunk_carries_the_init_segment_only_when_asked():
    c = chunk(3, init=b"INIT")
    assert c.payload(with_init=True) == b"INITfragment-3" and c.payload(with_init=False) == b"fragment-3"
    assert c.media_end_seconds == pytest.approx(1.0)


def test_tokens_are_unguessable_and_distinct():
    tokens = {new_token() for _ in range(1000)}
    assert len(tokens) == 1000 and all(len(t) >= 32 for t in tokens)


def test_the_registry_finds_a_session_by_each_of_its_tokens_of_the_right_kind_only():
    registry: SessionRegistry[str] = SessionRegistry()
    registry.add("a", {"resume": "r1", "watch": "w1", "control": None})
    registry.add("b", {"resume": "r2", "watch": "w2", "control": "c2"})
    assert registry.find("resume", "r1") == "a" and registry.find("watch", "w2") == "b"
    assert registry.find("control", "c2") == "b" and registry.find("control", "r1") is None
    assert registry.find("watch", "r1") is None  # a resume token is no watch token
    assert len(registry) == 2 and sorted(registry) == ["a", "b"]
    with pytest.raises(ValueError, match="resume token is already in use"):
        registry.add("c", {"resume": "r1"})
    assert registry.find("resume", "r1") == "a"  # the refused one changed nothing
    registry.remove("a")
    assert registry.find("resume", "r1") is None and registry.find("watch", "w1") is None
    registry.remove("a")  # twice: nothing happens
    assert len(registry) == 1
