"""Helpers shared by the test tiers: reading stub frames back, collecting a
session's results, gates that hold a stub pipeline mid-chunk, a video file
made of given frames, and running an ``rtvideo`` command as a user does."""

from __future__ import annotations

import asyncio
import io
import json
import multiprocessing
import random
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path

import numpy as np

from rtvideo.engine.client.session_handle import SessionHandle
from rtvideo.engine.messages import ChunkReady, ResultMessage, SessionDone, SessionFailed
from rtvideo.workers.pipelines.conditioning import blend
from rtvideo.workers.pipelines.stub import StubGate, conditioning_row, embed

SPAWN = multiprocessing.get_context("spawn")
ROOT = Path(__file__).resolve().parents[1]
RTVIDEO = (sys.executable, "-m", "rtvideo.cli")
"""The ``rtvideo`` command, as this interpreter runs it from ``ROOT``."""


def make_gate(chunk: int, step: int, prompt: str | None = None) -> StubGate:
    """A gate whose events work across the spawned worker process."""
    return StubGate(chunk=chunk, step=step, reached=SPAWN.Event(), release=SPAWN.Event(), prompt=prompt)


async def wait_reached(gate: StubGate, timeout: float = 30.0) -> None:
    if not await asyncio.to_thread(gate.reached.wait, timeout):
        raise AssertionError(f"the worker never reached the gate at chunk {gate.chunk} step {gate.step}")


def frames(chunk: ChunkReady) -> np.ndarray:
    """The chunk's payload as (frames, height, width, 3) uint8."""
    video = np.frombuffer(chunk.payload, dtype=np.uint8)
    return video.reshape(chunk.num_frames, chunk.height, chunk.width, 3)


def conditioning_of(chunk: ChunkReady) -> np.ndarray:
    """Row 0 of the chunk's first frame: the stub's conditioning readout."""
    return frames(chunk)[0, 0]


def expected_row(prompt: str, width: int) -> np.ndarray:
    return conditioning_row(embed(prompt), width)


def expected_blend_row(old: str, new: str, weight: float, width: int) -> np.ndarray:
    return conditioning_row(blend(embed(old), embed(new), weight), width)


@dataclass
class Collected:
    messages: list[ResultMessage] = field(default_factory=list)

    @property
    def chunks(self) -> list[ChunkReady]:
        return [m for m in self.messages if isinstance(m, ChunkReady)]

    def of(self, kind: type) -> list:
        return [m for m in self.messages if isinstance(m, kind)]

    @property
    def end(self) -> ResultMessage:
        return self.messages[-1]


async def collect(handle: SessionHandle, into: Collected | None = None, timeout: float = 30.0) -> Collected:
    """Read the session's stream to its end (``SessionDone`` / ``SessionFailed``)."""
    collected = into or Collected()
    while True:
        message = await handle.next(timeout)
        collected.messages.append(message)
        if isinstance(message, (SessionDone, SessionFailed)):
            return collected


async def read_until(handle: SessionHandle, kind: type, into: Collected, timeout: float = 30.0):
    """Read until a message of ``kind`` arrives; everything read is kept in ``into``."""
    while True:
        message = await handle.next(timeout)
        into.messages.append(message)
        if isinstance(message, kind):
            return message
        if isinstance(message, (SessionDone, SessionFailed)):
            raise AssertionError(f"session ended before a {kind.__name__}: {message}")


def inline_loop(config, control, runner, send, **options):
    """An ``EngineLoop`` over ``runner`` whose executor runs each micro-step inside
    ``submit`` (the local executor, unthreaded): one micro-step per ``run_once``."""
    from rtvideo.engine.loop import EngineLoop
    from rtvideo.workers.executor import LocalExecutor

    executor = LocalExecutor(runner, control.is_stopping, control.wake, threaded=False)
    return EngineLoop(config, control, executor, send, **options)


def free_ports(count: int) -> int:
    """A port P with P .. P + count - 1 all free (on loopback, just now), below
    the range the system hands out for outgoing connections and port 0, so that
    no other process's connection takes one before the test listens on it
    (a process of another test did, once, in the seconds a group of pipeline
    ranks takes to start)."""
    low = _first_ephemeral_port()
    for _ in range(100):
        if low - count > 10_000:
            port = random.randrange(10_000, low - count)
        else:  # no room below it: one the system gives now
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                port = probe.getsockname()[1]
        if port + count > 65536:
            continue
        taken = [socket.socket() for _ in range(count)]
        try:
            for offset, sock in enumerate(taken):
                sock.bind(("127.0.0.1", port + offset))
        except OSError:
            continue
        finally:
            for sock in taken:
                sock.close()
        return port
    raise RuntimeError(f"no {count} consecutive free ports")


def _first_ephemeral_port() -> int:
    """Where the range of ports the system hands out begins (Linux's; elsewhere IANA's)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as file:
            return int(file.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 49152


def video_file(
    frames: list[np.ndarray],
    fps: int,
    codec: str = "ffv1",
    container: str = "matroska",
    times_ms: list[int] | None = None,
) -> bytes:
    """``frames`` (uint8 RGB, one size) as a video file at ``fps``: lossless
    (ffv1, RGB, in Matroska) unless told; ``times_ms``: each frame's timestamp
    in milliseconds, in place of one every ``1 / fps`` s."""
    import av  # PyAV: only the tests that make a video load it

    out = io.BytesIO()
    with av.open(out, "w", format=container) as muxer:
        stream = muxer.add_stream(codec, rate=fps)
        stream.width, stream.height = frames[0].shape[1], frames[0].shape[0]
        stream.pix_fmt = "bgr0" if codec == "ffv1" else "yuv420p"
        if times_ms is not None:
            stream.time_base = Fraction(1, 1000)
        for index, image in enumerate(frames):
            frame = av.VideoFrame.from_ndarray(image, format="rgb24")
            if times_ms is not None:
                frame.pts, frame.time_base = times_ms[index], Fraction(1, 1000)
            for packet in stream.encode(frame):
                muxer.mux(packet)
        for packet in stream.encode():
            muxer.mux(packet)
    return out.getvalue()


def run_rtvideo(*argv: str, timeout: float = 300.0) -> subprocess.CompletedProcess[str]:
    """``rtvideo ARGV`` run from the repository root as a subprocess, its stdout and
    stderr captured as text; returned whatever its exit status."""
    return subprocess.run([*RTVIDEO, *argv], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def last_json(stdout: str) -> dict:
    """The JSON summary a command prints as its last line of stdout."""
    return json.loads(stdout.strip().splitlines()[-1])


def rtvideo_summary(*argv: str, timeout: float = 300.0) -> dict:
    """The JSON summary of ``rtvideo ARGV`` (a bench, ``eval-demo`` ...), which must
    exit 0: otherwise the test fails, showing the command's stderr."""
    result = run_rtvideo(*argv, timeout=timeout)
    assert result.returncode == 0, result.stderr
    return last_json(result.stdout)
