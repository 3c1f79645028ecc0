"""Chunk encoders: uint8 RGB frames in, the bytes of one media chunk out.

API process. One encoder per session, fed the session's chunks in order from
a worker thread (``asyncio.to_thread``), never on the event loop.

- ``raw``: the frames as they are, ``num_frames x height x width x 3``.
- ``jpeg``: each frame a JPEG (PyAV's mjpeg encoder), prefixed by its length
  as a 4-byte big-endian unsigned integer.
- ``fmp4``: H.264 (libx264, yuv420p, ultrafast / zerolatency, one key frame per
  chunk) in fragmented MP4, one fragment per chunk, the init segment prepended
  to the first. A fresh encoder and muxer per chunk keeps a chunk from waiting
  for the next one's first frame; every muxer starts its clock at zero, so the
  fragment's decode time (``tfdt``) and sequence number (``mfhd``) are
  rewritten to where the chunk sits in the session. Init + fragments, in
  order, is a valid fragmented MP4 file.
"""

from __future__ import annotations

import io
import struct
from collections.abc import Iterator
from fractions import Fraction
from typing import Protocol

import av
import numpy as np

FORMATS = ("fmp4", "jpeg", "raw")
CONTENT_TYPES = {"fmp4": "video/mp4", "jpeg": "application/octet-stream", "raw": "application/octet-stream"}
"""What ``/v1/videos/{id}/content`` answers with, per format."""


class ChunkEncoder(Protocol):
    def encode(self, frames: np.ndarray, first_frame_index: int) -> bytes:
        """Bytes of one chunk; ``frames`` is (n, height, width, 3) uint8."""
        ...


def make_encoder(fmt: str, width: int, height: int, fps: float) -> ChunkEncoder:
    if fmt == "raw":
        return RawEncoder()
    if fmt == "jpeg":
        return JpegEncoder(width, height)
    if fmt == "fmp4":
        return Fmp4Encoder(width, height, fps)
    raise ValueError(f"unknown format {fmt!r}; known: {', '.join(FORMATS)}")


class RawEncoder:
    def encode(self, frames: np.ndarray, first_frame_index: int) -> bytes:
        return np.ascontiguousarray(frames, dtype=np.uint8).tobytes()


class JpegEncoder:
    def __init__(self, width: int, height: int, quality: int = 3) -> None:
        self._codec = av.CodecContext.create("mjpeg", "w")
        self._codec.width, self._codec.height = width, height
        self._codec.pix_fmt = "yuvj420p"
        self._codec.time_base = Fraction(1, 25)
        self._codec.options = {"qmin": str(quality), "qmax": str(quality)}

    def encode(self, frames: np.ndarray, first_frame_index: int) -> bytes:
        out = bytearray()
        for i, frame in enumerate(frames):
            picture = av.VideoFrame.from_ndarray(frame, format="rgb24").reformat(format="yuvj420p")
            picture.pts = first_frame_index + i
            for packet in self._codec.encode(picture):
                data = bytes(packet)
                out += struct.pack(">I", len(data)) + data
        return bytes(out)


def split_jpeg_payload(payload: bytes) -> list[bytes]:
    """The images of a ``jpeg`` chunk payload (the inverse of ``JpegEncoder``)."""
    images, pos = [], 0
    while pos < len(payload):
        (size,) = struct.unpack_from(">I", payload, pos)
        images.append(payload[pos + 4 : pos + 4 + size])
        pos += 4 + size
    return images


class Fmp4Encoder:
    MOVFLAGS = "frag_keyframe+empty_moov+default_base_moof+skip_trailer"

    def __init__(self, width: int, height: int, fps: float) -> None:
        if width % 2 or height % 2:
            raise ValueError(f"fmp4 needs an even width and height, got {width}x{height}")
        self.width, self.height = width, height
        self.rate = Fraction(fps).limit_denominator(1001)
        self._sequence = 0
        self._timescale: int | None = None
        self.init = b""  # the init segment (ftyp + moov), once the first chunk was encoded

    def encode(self, frames: np.ndarray, first_frame_index: int) -> bytes:
        count = len(frames)
        buffer = io.BytesIO()
        with av.open(buffer, "w", format="mp4", options={"movflags": self.MOVFLAGS}) as container:
            stream = container.add_stream("libx264", rate=self.rate)
            stream.width, stream.height, stream.pix_fmt = self.width, self.height, "yuv420p"
            stream.options = {
                "preset": "ultrafast",
                "tune": "zerolatency",
                "x264-params": f"keyint={count}:min-keyint={count}:scenecut=0",
            }
            for i, frame in enumerate(frames):
                picture = av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")
                picture.pts = i
                for packet in stream.encode(picture):
                    container.mux(packet)
            for packet in stream.encode(None):
                container.mux(packet)
        data = buffer.getvalue()
        init, fragment = _split_init(data)
        if self._timescale is None:
            self._timescale = _media_timescale(init)
            self.init = init
        self._sequence += 1
        decode_time = round(first_frame_index * self._timescale / self.rate)
        fragment = _rewrite_fragment(fragment, self._sequence, decode_time)
        return (init + fragment) if self._sequence == 1 else fragment


# -- ISO BMFF boxes ---------------------------------------------------------------


def iter_boxes(data: bytes | bytearray, start: int = 0, end: int | None = None) -> Iterator[tuple[bytes, int, int]]:
    """(type, offset, size) of each box between ``start`` and ``end``."""
    end = len(data) if end is None else end
    pos = start
    while pos + 8 <= end:
        size, kind = struct.unpack_from(">I4s", data, pos)
        if size == 1:
            (size,) = struct.unpack_from(">Q", data, pos + 8)
        if size < 8 or pos + size > end:
            raise ValueError(f"malformed MP4 box {kind!r} at offset {pos}")
        yield kind, pos, size
        pos += size


def _split_init(data: bytes) -> tuple[bytes, bytes]:
    for kind, offset, _ in iter_boxes(data):
        if kind == b"moof":
            return data[:offset], data[offset:]
    raise ValueError("the muxer wrote no fragment")


def _find(data: bytes | bytearray, path: list[bytes], start: int = 0, end: int | None = None) -> tuple[int, int]:
    """Offset and size of the first box along ``path`` (container boxes only)."""
    for kind, offset, size in iter_boxes(data, start, end):
        if kind == path[0]:
            return (offset, size) if len(path) == 1 else _find(data, path[1:], offset + 8, offset + size)
    raise ValueError(f"no {b'/'.join(path).decode()} box")


def _media_timescale(init: bytes) -> int:
    offset, _ = _find(init, [b"moov", b"trak", b"mdia", b"mdhd"])
    version = init[offset + 8]
    field = offset + 12 + (16 if version == 1 else 8)  # after creation and modification times
    (timescale,) = struct.unpack_from(">I", init, field)
    return timescale


def _rewrite_fragment(fragment: bytes, sequence: int, decode_time: int) -> bytes:
    data = bytearray(fragment)
    mfhd, _ = _find(data, [b"moof", b"mfhd"])
    struct.pack_into(">I", data, mfhd + 12, sequence)
    tfdt, _ = _find(data, [b"moof", b"traf", b"tfdt"])
    if data[tfdt + 8] == 1:
        struct.pack_into(">Q", data, tfdt + 12, decode_time)
    else:
        struct.pack_into(">I", data, tfdt + 12, decode_time)
    return bytes(data)
