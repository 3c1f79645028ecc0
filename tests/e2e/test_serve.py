"""``rtvideo serve`` itself: what it does before the model loads."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from urllib.parse import urlparse

import httpx

from tests.e2e.conftest import ROOT


def test_a_busy_port_fails_at_once_before_the_model_loads(make_server):
    """A second server on a port in use says so in one line and exits non-zero,
    without starting its application (no worker, no model)."""
    first = make_server()
    port = urlparse(first.http).port
    began = time.monotonic()
    second = subprocess.run(
        [sys.executable, "-m", "rtvideo.cli", "serve", "--port", str(port), "--model", "stub", "--log-level", "info"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    took = time.monotonic() - began
    output = second.stdout + second.stderr
    assert second.returncode != 0, output
    assert output.strip().splitlines() == [
        f"rtvideo serve: cannot listen on 127.0.0.1:{port}: address already in use "
        "(another server is listening there; --port or RTVIDEO_PORT chooses another)"
    ], output
    assert "startup" not in output and "Started server process" not in output  # the application never began
    assert took < 30, took  # an interpreter start, not a model load (the stub's worker alone takes seconds)
    assert first.health()["status"] == "ok"  # the first server is untouched


def serve(*argv: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """``rtvideo serve ARGV`` run to its end, on a free port and a data_dir of its own."""
    data_dir = tempfile.mkdtemp(prefix="rtvideo-data-")
    command = [sys.executable, "-m", "rtvideo.cli", "serve", "--port", "0", "--data-dir", data_dir, *argv]
    try:
        environ = {**os.environ, **(env or {})}
        return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=environ)
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)


def test_a_bad_model_path_is_one_line_and_a_misspelled_variable_is_named(tmp_path):
    """Before anything loads: a --model that is no model directory says which path
    and what was expected in one line; an RTVIDEO_ variable that names no setting
    draws a warning naming the closest one."""
    began = time.monotonic()
    ran = serve("--model", "/no/such/model", env={"RTVIDEO_MAX_SESION": "3"})
    assert ran.returncode != 0 and ran.stdout == ""
    assert ran.stderr.splitlines() == [
        "rtvideo serve: warning: RTVIDEO_MAX_SESION is not a setting, ignored; did you mean RTVIDEO_MAX_SESSIONS?",
        "rtvideo serve: --model /no/such/model: no such directory; expected demo, tiny, stub or a model directory "
        "with transformer/, vae/, text_encoder/, tokenizer/",
    ], ran.stderr
    assert time.monotonic() - began < 30  # an interpreter start: no worker, no model
    (tmp_path / "transformer").mkdir()
    partial = serve("--model", str(tmp_path))
    assert partial.returncode != 0 and partial.stderr.splitlines() == [
        f"rtvideo serve: --model {tmp_path}: the directory lacks vae/, text_encoder/, tokenizer/; expected demo, "
        "tiny, stub or a model directory with transformer/, vae/, text_encoder/, tokenizer/"
    ], partial.stderr


def test_a_worker_that_cannot_start_ends_in_one_line_its_traceback_at_debug():
    """A start the worker refuses (here a pipeline option the stub does not take)
    ends in one ERROR line saying why, and the process exits non-zero; the
    worker's traceback is logged at --log-level debug only."""
    argv = ("--model", "stub", "--pipeline-options", '{"no_such_option": 1}')
    ran = serve(*argv, "--log-level", "info")
    why = (
        "api ERROR rtvideo serve: worker could not start: "
        "ValueError: pipeline 'stub' takes no option 'no_such_option' (set by --pipeline-options)"
    )
    errors = [line for line in ran.stderr.splitlines() if " ERROR " in line]
    assert ran.returncode != 0 and len(errors) == 1 and errors[0].endswith(why), ran.stderr
    assert ran.stderr.splitlines()[-1] == errors[0] and "Traceback" not in ran.stderr + ran.stdout
    debug = serve(*argv, "--log-level", "debug")
    assert debug.returncode != 0 and debug.stderr.splitlines()[-1].endswith(why), debug.stderr
    assert "worker[0] DEBUG could not build or warm up pipeline 'stub'\nTraceback" in debug.stderr, debug.stderr


def test_a_model_whose_options_make_no_valid_session_is_refused_at_start_naming_the_option():
    """Options a model cannot serve with (here a default session of no frames a
    chunk, which the stub would take) end the start in one line naming them, never
    in a traceback or in sessions that fail one by one. (The other refusals of the
    worker's start: tests/unit/test_pipeline_capabilities.py.)"""
    ran = serve("--model", "stub", "--pipeline-options", '{"frames_per_chunk": 0, "first_chunk_frames": 4}')
    errors = [line for line in ran.stderr.splitlines() if " ERROR " in line]
    assert ran.returncode != 0 and len(errors) == 1, ran.stderr
    why = "ValueError: the default session of pipeline 'stub': frames_per_chunk must be >= 1, got 0"
    assert f"rtvideo serve: worker could not start: {why}" in errors[0] and "Traceback" not in ran.stderr


def test_port_0_is_printed_whatever_the_log_level():
    """``--port 0`` picks a free port: under a log level that hides uvicorn's
    "running on" line the server still says where it listens, and answers there."""
    data_dir = tempfile.mkdtemp(prefix="rtvideo-data-")
    command = [sys.executable, "-m", "rtvideo.cli", "serve", "--port", "0", "--data-dir", data_dir]
    process = subprocess.Popen(
        [*command, "--model", "stub", "--log-level", "warning"], cwd=ROOT, stderr=subprocess.PIPE, text=True
    )
    try:
        line = process.stderr.readline()
        assert line.startswith("rtvideo serve: listening on http://127.0.0.1:"), line
        url = line.split()[-1]
        assert httpx.get(f"{url}/health", timeout=10).json()["status"] == "ok"
    finally:
        process.send_signal(signal.SIGTERM)
        process.communicate(timeout=60)
        shutil.rmtree(data_dir, ignore_errors=True)
    assert process.returncode == 0


def test_a_data_dir_in_use_ends_the_start_in_one_line(make_server):
    first = make_server()
    ran = serve("--model", "stub", "--data-dir", str(first.data_dir))  # the last --data-dir counts
    errors = [line for line in ran.stderr.splitlines() if " ERROR " in line]
    assert ran.returncode != 0 and errors == ran.stderr.splitlines()[-1:], ran.stderr
    assert f"api ERROR rtvideo serve: data_dir {first.data_dir} is in use by another rtvideo server" in errors[0]
    assert first.health()["status"] == "ok"


def test_a_second_ctrl_c_while_draining_stops_quietly(make_server):
    """Ctrl+C drains; a second one skips the wait and stops at once, with no
    error logged (no CancelledError traceback) and the exit code 0."""
    server = make_server(pipeline={"step_time_s": 0.05})
    job = httpx.post(f"{server.http}/v1/videos", json={"prompt": "p", "num_chunks": 500, "format": "raw"}).json()
    while httpx.get(f"{server.http}/v1/videos/{job['id']}").json()["status"] != "in_progress":
        pass
    server.process.send_signal(signal.SIGINT)
    while httpx.get(f"{server.http}/health").json()["status"] != "draining":
        pass  # the drain waits for the job (500 chunks: far longer than this test)
    server.process.send_signal(signal.SIGINT)
    assert server.process.wait(timeout=30) == 0
    log = server.whole_log()
    assert " ERROR " not in log and "Traceback" not in log, log
    assert "a second signal: stopping now, without waiting" in log, log
    assert "Application shutdown complete" in log, log  # the lifespan ran: the worker was shut down
