"""``rtvideo bench pipeline`` runs and its JSON has every figure."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_pipeline_prints_the_per_chunk_split_and_fps():
    command = [sys.executable, "-m", "server.cli", "bench", "pipeline", "--json", "--chunks", "3", "--steps", "2"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["bench"] == "pipeline" and summary["preset"] == "tiny" and summary["steps"] == 2
    assert set(summary["per_chunk_ms"]) == {"denoise_ms", "commit_ms", "decode_ms", "total_ms"}
    assert all(value > 0 for value in summary["per_chunk_ms"].values())
    assert summary["time_to_first_chunk_s"] > 0 and summary["generated_fps"] > 0
    assert summary["playback_fps"] == 16.0
