"""The server as a subprocess (``python -m rtvideo.cli serve``), with real clients."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import PINNED_LIMITS

ROOT = Path(__file__).resolve().parents[2]


class RunningServer:
    def __init__(
        self, process: subprocess.Popen, url: str, log: list[str], logged: threading.Condition, ended: threading.Event
    ) -> None:
        self.process = process
        self.http = url
        self.ws = url.replace("http://", "ws://") + "/v1/realtime/video"
        self.log = log
        self._logged = logged  # notified by the thread reading the server's output after each line
        self._ended = ended  # set by that thread at the output's end
        self.data_dir: Path | None = None  # the job store's directory, when start_server chose it

    def wait_for_log(self, text: str, within: float = 30.0) -> str:
        """The first line of the server's output containing ``text``, waiting up to
        ``within`` s for it: the output is read by another thread, so a line the
        server wrote just before answering may not be in ``log`` yet. Fails, with
        the log, if it does not come."""
        deadline = time.monotonic() + within
        with self._logged:
            while not (found := next((line for line in self.log if text in line), None)):
                left = deadline - time.monotonic()
                assert left > 0, f"no {text!r} in the server log:\n" + "".join(self.log)
                self._logged.wait(left)
        return found

    def whole_log(self, within: float = 30.0) -> str:
        """Everything the server wrote, once its output has ended (call after the
        process exited: the reading thread may still be behind it)."""
        assert self._ended.wait(within), "the server's output did not end"
        return "".join(self.log)

    def health(self) -> dict:
        return httpx.get(f"{self.http}/health", timeout=10).json()

    def released(self, within: float = 10.0) -> dict:
        """``/health`` once no session is open and the worker holds none: what the
        runner and pipeline hold comes from the worker's heartbeat answers, so a
        release shows within a heartbeat. Fails if it does not within ``within``."""
        deadline = time.monotonic() + within
        while (health := self.health())["sessions"] or health["runner_sessions"] or health["pipeline_sessions"]:
            assert time.monotonic() < deadline, f"the worker still holds sessions: {health}"
        return health


def start_server(
    *flags: str, pipeline: dict | None = None, model: str = "stub", timeout: float = 120.0, unset: tuple[str, ...] = ()
) -> RunningServer:
    """``rtvideo serve`` as a subprocess on a free port; ``unset``: environment
    variables it starts without."""
    command = [
        sys.executable,
        "-m",
        "rtvideo.cli",
        "serve",
        "--port",
        "0",
        "--model",
        model,
        "--log-level",
        "info",
        *flags,
    ]
    if pipeline:
        command += ["--pipeline-options", json.dumps(pipeline)]
    if "--max-pixels" not in flags:  # measured from the machine's speed at start: pinned unless a test says
        command += ["--max-pixels", str(PINNED_LIMITS["max_pixels"])]
    data_dir = None
    if "--data-dir" not in flags:  # each server its own job store, removed when it stops
        data_dir = Path(tempfile.mkdtemp(prefix="rtvideo-data-"))
        command += ["--data-dir", str(data_dir)]
    if "--max-realtime-load" not in flags:
        command += ["--max-realtime-load", "none"]
    # uvicorn logs to stderr and its access log to stdout: keep both, in order.
    env = {name: value for name, value in os.environ.items() if name not in unset}
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    log: list[str] = []
    logged = threading.Condition()
    found = threading.Event()
    url: list[str] = []
    ended = threading.Event()

    def drain() -> None:
        for line in process.stdout:
            with logged:
                log.append(line)
                logged.notify_all()
            match = re.search(r"Uvicorn running on (http://\S+)", line)
            if match and not found.is_set():
                url.append(match.group(1))
                found.set()
        found.set()
        ended.set()

    threading.Thread(target=drain, daemon=True).start()
    if not found.wait(timeout) or not url:
        process.kill()
        if data_dir is not None:
            shutil.rmtree(data_dir, ignore_errors=True)
        raise RuntimeError("the server did not start:\n" + "".join(log))
    running = RunningServer(process, url[0], log, logged, ended)
    running.data_dir = data_dir
    return running


def train_tiny_demo(out: Path) -> Path:
    """A demo model directory written by the real trainer (``rtvideo train-demo --tiny``,
    one step: seconds): ``out/model``, whose ``rtvideo.json`` lists the prompts it knows.
    Its stderr is a pipe here, so no progress bar may reach it (README, "nothing is drawn"),
    the model directory's export included."""
    command = [sys.executable, "-m", "rtvideo.cli", "train-demo", "--tiny", "--steps", "1", "--out", str(out)]
    result = subprocess.run(command, cwd=ROOT, check=True, capture_output=True, text=True, timeout=300)
    assert "%|" not in result.stderr, result.stderr  # tqdm's bar: "Writing model shards: 100%|...|"
    return out / "model"


def stop_server(server: RunningServer) -> int:
    server.process.terminate()
    try:
        code = server.process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.process.kill()
        code = server.process.wait()
    if server.data_dir is not None:
        shutil.rmtree(server.data_dir, ignore_errors=True)
    return code


@pytest.fixture(scope="module")
def server():
    """A shared server: stub pipeline with 5 ms steps, room for 6 sessions."""
    running = start_server("--max-sessions", "6", pipeline={"step_time_s": 0.005})
    yield running
    stop_server(running)


@pytest.fixture
def make_server():
    started: list[RunningServer] = []

    def factory(*flags: str, pipeline: dict | None = None, model: str = "stub") -> RunningServer:
        running = start_server(*flags, pipeline=pipeline, model=model)
        started.append(running)
        return running

    yield factory
    for running in started:
        stop_server(running)
