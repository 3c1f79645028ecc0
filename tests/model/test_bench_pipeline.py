"""``rtvideo bench pipeline`` runs and its JSON has every figure."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _bench(*flags: str) -> dict:
    command = [sys.executable, "-m", "server.cli", "bench", "pipeline", "--json", "--chunks", "3", "--steps", "2"]
    result = subprocess.run([*command, *flags], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_bench_pipeline_prints_the_per_chunk_split_and_fps():
    summary = _bench()
    assert summary["bench"] == "pipeline" and summary["preset"] == "tiny" and summary["steps"] == 2
    assert set(summary["per_chunk_ms"]) == {"denoise_ms", "commit_ms", "decode_ms", "total_ms"}
    assert all(value > 0 for value in summary["per_chunk_ms"].values())
    assert summary["time_to_first_chunk_s"] > 0 and summary["generated_fps"] > 0
    assert summary["playback_fps"] == 16.0
    assert summary["warm_up_s"] > 0 and summary["dtype"] == summary["vae_dtype"] == "float32"
    assert 0 < summary["state_bytes"] < summary["session_memory_budget"]  # a CPU: the host's available memory
    assert summary["side_by_side"] is None
    overlap = summary["decode_overlap"]
    for mode in ("in_line", "overlapped"):
        assert overlap[mode]["time_to_first_chunk_s"] > 0 and overlap[mode]["fps"] > 0
    assert overlap["fps_overlapped_over_in_line"] > 0


def test_bench_pipeline_runs_bf16_cold_writes_a_profile_and_compares_batching(tmp_path):
    profile = tmp_path / "profile.txt"
    flags = ("--dtype", "bfloat16", "--vae-dtype", "float32", "--no-warm-up", "--profile", str(profile))
    summary = _bench(*flags, "--sessions", "2")
    assert summary["dtype"] == "bfloat16" and summary["vae_dtype"] == "float32"
    side = summary["side_by_side"]
    assert side["sessions"] == 2 and side["one_row_fps"] > 0 and side["batched_fps"] > 0
    assert summary["warm_up_s"] == 0.0 and summary["generated_fps"] > 0
    assert "Self CPU" in profile.read_text()
