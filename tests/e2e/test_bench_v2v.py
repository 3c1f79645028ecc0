"""``rtvideo bench v2v`` against a test server (the stub model, which makes
each output frame from its input frame): every input frame it sends is
accounted for, and its JSON has every figure; a session the server refuses is
a failed session named in the summary, which still prints."""

from __future__ import annotations

from tests.e2e.test_bench_realtime import two_sessions_against_room_for_one
from tests.support import rtvideo_summary, run_rtvideo

BENCH = ("bench", "v2v")


def test_bench_v2v_reports_latency_drops_and_throughput(server):
    flags = ("--url", server.http, "--sessions", "2", "--chunks", "5", "--interact-at", "1", "--format", "jpeg")
    summary = rtvideo_summary(*BENCH, *flags, "--json", timeout=120)
    assert summary["bench"] == "v2v" and summary["failed_sessions"] == []
    assert summary["served_by"]["kind"] == "cpu", summary["served_by"]
    assert (summary["width"], summary["height"], summary["fps"]) == (32, 32, 16.0)  # the stub's defaults
    # chunk 0 takes first_chunk_frames input frames, every later one frames_per_chunk: each output frame is one
    assert summary["input_frames_used"] == summary["output_frames"] > 0
    assert summary["input_frames_sent"] >= summary["input_frames_used"] + summary["input_frames_dropped"]
    latency = summary["input_to_output_ms"]
    assert {"p50", "p95", "max"} <= set(latency) and 0 < latency["min"] <= latency["p50"] <= latency["p95"]
    assert summary["interaction_to_visible_ms"]["min"] > 0  # the prompt sent at chunk 1 showed later
    assert summary["output_fps"] > 0 and summary["realtime_factor"]["p50"] > 0


def test_bench_v2v_refuses_a_strength_out_of_range():
    result = run_rtvideo(*BENCH, "--strength", "1.5", timeout=60)
    assert result.returncode == 1
    assert "strength must be between 0 and 1, got 1.5" in result.stderr


def test_a_session_the_server_refuses_fails_and_the_summary_still_prints():
    summary = two_sessions_against_room_for_one(BENCH, chunks=3)
    assert summary["output_frames"] > 0  # the session that ran is counted
