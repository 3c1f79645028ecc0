"""``rtvideo bench v2v``: K concurrent video-to-video sessions against a running server.

Each session asks ``GET /v1/models`` for the served model's default size and
rate (unless given), sends ``session.start`` with an ``input`` of that size
and rate, and, from ``video.start`` on, sends input frames in real time at the
input's rate, each behind the 12-byte header of docs/PROTOCOL.md "Video
input" (index, capture time): a synthetic moving scene, encoded as JPEG (or
raw RGB) before the run, so encoding costs the timed loop nothing. Once its
``interact_at`` chunk has arrived it sends a new prompt. It reads to
``session.done``. Figures, over all sessions:

- input to output: for each output frame, from sending the input frame it
  was made from (a chunk's ``input_frame_indexes``) to its chunk's
  ``video.chunk_metadata`` arriving (what a client can first show);
- input frames sent, used (made into output) and dropped by the server (the
  last chunk's ``input_frames_dropped``);
- throughput: output frames per wall second, per session and in all, and the
  realtime factor (media seconds received per wall second, per session:
  video to video keeps up when it is about 1);
- time to first chunk and interaction to visible, as ``bench realtime``.

No pacing is asked for (``max_lead_seconds`` null): the input's own rate
holds the session to real time. The last line printed is one JSON object.
"""

from __future__ import annotations

import asyncio
import json
import struct
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from fractions import Fraction

import av
import numpy as np
from websockets.asyncio.client import ClientConnection

from rtvideo.bench.machine import http_of, served_by, server_request
from rtvideo.bench.realtime import (
    SESSION_FAILURES,
    STALL_TIMEOUT_S,
    failure,
    session_events,
    session_socket,
    session_start,
)
from rtvideo.bench.stats import percentiles
from rtvideo.engine.progress import Progress

HEADER = struct.Struct(">IQ")  # frame index, capture time in microseconds (docs/PROTOCOL.md, "Video input")
FORMATS = ("jpeg", "raw")
LOOP_SECONDS = 2.0  # the synthetic scene repeats after this long


@dataclass(frozen=True)
class V2vBenchOptions:
    url: str  # ws(s)://host:port/v1/realtime/video
    sessions: int = 1
    chunks: int = 12
    strength: float = 0.6
    format: str = "jpeg"
    width: int | None = None  # None: the served model's default (GET /v1/models), and so for height and fps
    height: int | None = None
    fps: float | None = None
    interact_at: int = 3  # a new prompt once this many chunks arrived; negative: none
    api_key: str | None = None
    prompt: str = "a watercolour painting of a city street"
    stall_timeout_s: float = STALL_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.sessions < 1 or self.chunks < 1:
            raise ValueError("sessions and chunks must be >= 1")
        if not 0.0 <= self.strength <= 1.0:
            raise ValueError(f"strength must be between 0 and 1, got {self.strength}")
        if self.format not in FORMATS:
            raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {self.format!r}")
        if not self.stall_timeout_s > 0:
            raise ValueError(f"stall_timeout_s must be > 0, got {self.stall_timeout_s}")


@dataclass(frozen=True)
class InputShape:
    width: int
    height: int
    fps: float


@dataclass
class SessionResult:
    started: float = 0.0
    arrivals: list[float] = field(default_factory=list)
    media_seconds: float = 0.0
    frames_out: int = 0
    sent_at: dict[int, float] = field(default_factory=dict)  # input frame index -> when it was sent
    input_to_output_s: list[float] = field(default_factory=list)
    used: int = 0
    dropped: int = 0
    prompt_sent: float | None = None
    prompt_visible: float | None = None
    error: str | None = None


def served_shape(options: V2vBenchOptions) -> InputShape:
    """The input's size and rate: the options', else the served model's defaults."""
    if None not in (options.width, options.height, options.fps):
        return InputShape(options.width, options.height, float(options.fps))
    request = server_request(http_of(options.url), "/v1/models", options.api_key)
    with urllib.request.urlopen(request, timeout=30) as answer:
        defaults = json.load(answer)["data"][0]["defaults"]
    return InputShape(
        options.width or defaults["width"], options.height or defaults["height"], float(options.fps or defaults["fps"])
    )


def scene(shape: InputShape) -> np.ndarray:
    """``LOOP_SECONDS`` of a moving scene, uint8 RGB ``[frames, height, width, 3]``:
    diagonal colour bands drifting right, and a bright square crossing the frame."""
    count = max(1, round(LOOP_SECONDS * shape.fps))
    ys, xs = np.mgrid[0 : shape.height, 0 : shape.width]
    frames = np.empty((count, shape.height, shape.width, 3), np.uint8)
    side = max(2, min(shape.width, shape.height) // 4)
    for i in range(count):
        phase = (xs + ys + i * 3) % 64 / 63.0
        frames[i, ..., 0] = (phase * 255).astype(np.uint8)
        frames[i, ..., 1] = ((1 - phase) * 200).astype(np.uint8)
        frames[i, ..., 2] = 90
        left = (i * (shape.width - side)) // max(1, count - 1)
        frames[i, shape.height // 2 - side // 2 : shape.height // 2 + side // 2, left : left + side] = 240
    return frames


def encoded(frames: np.ndarray, image_format: str, fps: float) -> list[bytes]:
    """Each frame as the socket carries it: a JPEG (PyAV's mjpeg encoder) or raw RGB."""
    if image_format == "raw":
        return [frame.tobytes() for frame in frames]
    codec = av.CodecContext.create("mjpeg", "w")
    codec.width, codec.height = frames.shape[2], frames.shape[1]
    codec.pix_fmt = "yuvj420p"
    codec.time_base = Fraction(1, max(1, round(fps)))
    images = []
    for frame in frames:
        picture = av.VideoFrame.from_ndarray(frame, format="rgb24").reformat(format="yuvj420p")
        images.append(b"".join(bytes(packet) for packet in codec.encode(picture)))
    return images


async def send_frames(ws: ClientConnection, images: list[bytes], fps: float, result: SessionResult) -> None:
    """Frame n at ``start + n / fps``, until cancelled (the session ended)."""
    start = time.perf_counter()
    index = 0
    while True:
        due = start + index / fps
        await asyncio.sleep(max(0.0, due - time.perf_counter()))
        now = time.perf_counter()
        result.sent_at[index] = now
        await ws.send(HEADER.pack(index, time.time_ns() // 1000) + images[index % len(images)])
        index += 1


async def _session(
    options: V2vBenchOptions, shape: InputShape, images: list[bytes], index: int, progress: Progress
) -> SessionResult:
    result = SessionResult()
    sender: asyncio.Task | None = None
    event_id = f"bench-v2v-{index}-{uuid.uuid4().hex[:8]}"
    try:
        async with session_socket(options.url, options.api_key) as ws:
            video = {
                "kind": "video",
                "strength": options.strength,
                "format": options.format,
                "width": shape.width,
                "height": shape.height,
                "fps": shape.fps,
            }
            start = session_start(options.prompt, index, options.chunks, None, input=video)
            result.started = time.perf_counter()
            await ws.send(json.dumps(start))
            try:
                async for kind, event, now in session_events(ws, options.stall_timeout_s):
                    if kind == "video.start":
                        sender = asyncio.create_task(send_frames(ws, images, shape.fps, result))
                    elif kind == "video.chunk_metadata":
                        progress.advance()
                        result.arrivals.append(now)
                        result.frames_out += event["num_frames"]
                        result.media_seconds += event["num_frames"] / shape.fps
                        made_from = event.get("input_frame_indexes") or []
                        result.used += len(made_from)
                        result.input_to_output_s += [now - result.sent_at[i] for i in made_from if i in result.sent_at]
                        result.dropped = event.get("input_frames_dropped", result.dropped)
                        if event_id in event["started_event_ids"] and result.prompt_visible is None:
                            result.prompt_visible = now
                        if len(result.arrivals) - 1 == options.interact_at:
                            result.prompt_sent = time.perf_counter()
                            interaction = {"event_id": event_id, "event": {"prompt": f"a neon night scene #{index}"}}
                            await ws.send(json.dumps({"type": "session.interaction", "interaction": interaction}))
                    elif kind == "error" and event.get("fatal"):
                        result.error = f"{event['code']}: {event['message']}"
            finally:
                if sender is not None:
                    sender.cancel()
                    await asyncio.gather(sender, return_exceptions=True)  # its cancel, not this task's
    except SESSION_FAILURES as error:
        result.error = failure(error)
    return result


async def run(options: V2vBenchOptions, progress: Progress | None = None) -> dict:
    progress = progress or Progress.silent()
    shape = await asyncio.to_thread(served_shape, options)
    images = await asyncio.to_thread(encoded, scene(shape), options.format, shape.fps)
    began = time.perf_counter()
    results = await asyncio.gather(*(_session(options, shape, images, i, progress) for i in range(options.sessions)))
    wall = time.perf_counter() - began
    ok = [r for r in results if not r.error and r.arrivals]
    visible = [(r.prompt_visible - r.prompt_sent) * 1e3 for r in ok if r.prompt_sent and r.prompt_visible]
    return {
        "bench": "v2v",
        "url": options.url,
        "served_by": await asyncio.to_thread(served_by, http_of(options.url), options.api_key),
        "sessions": options.sessions,
        "chunks_per_session": options.chunks,
        "strength": options.strength,
        "format": options.format,
        "width": shape.width,
        "height": shape.height,
        "fps": shape.fps,
        "failed_sessions": [r.error for r in results if r.error],
        "input_to_output_ms": percentiles([s * 1e3 for r in ok for s in r.input_to_output_s]),
        "input_frames_sent": sum(len(r.sent_at) for r in results),
        "input_frames_used": sum(r.used for r in ok),
        "input_frames_dropped": sum(r.dropped for r in ok),
        "output_frames": sum(r.frames_out for r in ok),
        "output_fps": sum(r.frames_out for r in ok) / wall if wall else None,
        "output_fps_per_session": percentiles([r.frames_out / (r.arrivals[-1] - r.started) for r in ok]),
        "realtime_factor": percentiles([r.media_seconds / (r.arrivals[-1] - r.started) for r in ok]),
        "ttff_ms": percentiles([(r.arrivals[0] - r.started) * 1e3 for r in ok]),
        "interaction_to_visible_ms": percentiles(visible),
        "wall_s": wall,
    }


def main(options: V2vBenchOptions, as_json: bool) -> int:
    with Progress("bench v2v", options.sessions * options.chunks, unit="chunk", quiet=as_json) as progress:
        summary = asyncio.run(run(options, progress))
    if not as_json:
        s = summary
        latency = s["input_to_output_ms"]
        print(
            f"{options.sessions} sessions x {options.chunks} chunks at {s['width']}x{s['height']} {s['fps']:g} fps, "
            f"strength {options.strength}: input to output p50 {latency.get('p50', 0):.0f} ms "
            f"p95 {latency.get('p95', 0):.0f} ms, {s['output_fps'] or 0:.1f} output frames/s, "
            f"input frames sent {s['input_frames_sent']}, used {s['input_frames_used']}, "
            f"dropped {s['input_frames_dropped']}"
        )
    print(json.dumps(summary))
    return 1 if summary["failed_sessions"] else 0
