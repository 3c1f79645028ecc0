"""The README's "Try it" block, run as it is (only the port changed) against a
real ``rtvideo serve`` with the default demo model: it must work when pasted,
print each JSON answer on a line of its own, say what went wrong on a wrong
port, the numbers its prose gives (93 frames, where the blue square lands) must
be the server's, and the video must show what its prompts say."""

from __future__ import annotations

import io
import json
import re
import shutil
import socket
import subprocess
from pathlib import Path

import av
import httpx
import numpy as np
import pytest

from rtvideo.training.demo.classify import dominant_colour
from tests.e2e.conftest import ROOT

pytestmark = pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
README = (ROOT / "README.md").read_text()


def try_it_block() -> str:
    section = README[README.index("## Try it") : README.index("\n## ", README.index("## Try it") + 1)]
    blocks = re.findall(r"```sh\n(.*?)```", section, re.S)
    assert len(blocks) == 1, "the Try it section holds one shell block"
    return blocks[0]


def run_block(block: str, port: int, cwd: Path) -> subprocess.CompletedProcess:
    assert "localhost:8000" in block
    script = block.replace("localhost:8000", f"localhost:{port}")
    # -e: every command must succeed (pasted, a failure would scroll past).
    return subprocess.run(["bash", "-e", "-c", script], cwd=cwd, capture_output=True, text=True, timeout=240)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_try_it_block_runs_as_pasted_and_its_numbers_are_true(demo_server, tmp_path):
    port = int(demo_server.http.rsplit(":", 1)[1])
    done = run_block(try_it_block(), port, tmp_path)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert done.stdout.endswith("\n")
    lines = done.stdout.splitlines()
    assert len(lines) == 2, done.stdout  # each answer on a line of its own
    created, finished = (json.loads(line) for line in lines)
    assert created["status"] == "queued" and created["interactions"][0]["status"] == "pending"
    assert finished["id"] == created["id"] and finished["status"] == "completed"
    landed = finished["interactions"][0]
    assert landed["status"] == "applied" and landed["generation_chunk_index"] == 4

    defaults = httpx.get(f"{demo_server.http}/v1/models").json()["data"][0]["defaults"]
    first, per, fps = defaults["first_chunk_frames"], defaults["frames_per_chunk"], defaults["fps"]
    frames = finished["num_frames"]
    assert finished["num_chunks"] == 8 and frames == first + 7 * per
    prose = " ".join(README[README.index("## Try it") :].split())
    assert f"first chunk is {first} frames and every later one {per}" in prose
    assert f"8 chunks are {first} + 7 × {per} = {frames} frames ({frames / fps:.1f} s at {fps:g} fps)" in prose
    assert f"frame {landed['first_frame_index']}, {landed['media_start_seconds']:.2f} s into" in prose

    with av.open(io.BytesIO((tmp_path / "shapes.mp4").read_bytes())) as container:
        decoded = [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]
    assert len(decoded) == frames and decoded[0].shape == (64, 64, 3)
    starts = [0, *range(first, frames, per)]  # each chunk's first frame
    colours = [dominant_colour(np.stack(decoded[a:b])) for a, b in zip(starts, [*starts[1:], frames], strict=True)]
    assert colours == ["red"] * 4 + ["blue"] * 4, colours  # what the prompts say, from the chunk the job names


def test_on_a_wrong_port_the_block_says_so(tmp_path):
    failed = run_block(try_it_block(), free_port(), tmp_path)
    assert failed.returncode != 0
    assert "Failed to connect" in failed.stderr, failed.stderr  # -s alone would print nothing at all
    assert not (tmp_path / "shapes.mp4").exists()
