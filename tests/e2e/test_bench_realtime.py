"""``rtvideo bench realtime`` against a test server: its JSON has every figure."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_realtime_reports_every_figure(server):
    command = [
        sys.executable,
        "-m",
        "server.cli",
        "bench",
        "realtime",
        "--url",
        server.http,
        "--sessions",
        "2",
        "--chunks",
        "6",
        "--interact-at",
        "1",
        "--json",
    ]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["bench"] == "realtime" and summary["sessions"] == 2 and summary["failed_sessions"] == []
    for key in (
        "ttff_ms",
        "ttff_minus_first_chunk_compute_ms",
        "chunk_latency_ms",
        "inter_chunk_gap_ms",
        "interaction_to_visible_ms",
        "realtime_factor",
    ):
        assert {"p50", "p95", "p99", "max"} <= set(summary[key]), key
    assert 0.0 <= summary["deadline_attainment"] <= 1.0
    assert summary["serving_overhead_ratio"] > 0 and summary["pipeline_compute_s"] > 0
