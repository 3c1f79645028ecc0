"""``rtvideo serve`` itself: what it does before the model loads."""

from __future__ import annotations

import subprocess
import sys
import time
from urllib.parse import urlparse

from tests.e2e.conftest import ROOT


def test_a_busy_port_fails_at_once_before_the_model_loads(make_server):
    """A second server on a port in use says so in one line and exits non-zero,
    without starting its application (no worker, no model)."""
    first = make_server()
    port = urlparse(first.http).port
    began = time.monotonic()
    second = subprocess.run(
        [sys.executable, "-m", "server.cli", "serve", "--port", str(port), "--model", "stub", "--log-level", "info"],
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
