"""``rtvideo bench realtime`` against a test server: its JSON has every figure,
key to pixel and underruns under the page's buffer policy included; a session
the server refuses, or one it goes silent on, is a failed session named in the
summary, which still prints as the last line."""

from __future__ import annotations

from tests.e2e.conftest import start_server, stop_server
from tests.support import last_json, rtvideo_summary, run_rtvideo

BENCH = ("bench", "realtime")


def test_bench_realtime_reports_every_figure(server):
    flags = ("--url", server.http, "--sessions", "2", "--chunks", "6", "--interact-at", "1", "--interact-every", "2")
    summary = rtvideo_summary(*BENCH, *flags, "--json", timeout=120)
    assert summary["bench"] == "realtime" and summary["sessions"] == 2 and summary["failed_sessions"] == []
    served = summary["served_by"]  # the server's worker, as its /health says (the stub: this host's CPU)
    assert served["kind"] == "cpu" and served["name"] == served["cpu"] and served["cpu_cores"] >= 1, served
    assert summary["max_lead_seconds"] == "adaptive"
    for key in (
        "ttff_ms",
        "ttff_minus_first_chunk_compute_ms",
        "chunk_latency_ms",
        "inter_chunk_gap_ms",
        "interaction_to_visible_ms",
        "key_to_pixel_ms",
        "realtime_factor",
    ):
        assert {"p50", "p95", "p99", "max"} <= set(summary[key]), key
    # A prompt shows no sooner than it is sent and, on a server far faster than real time,
    # within the lead (half a second, grown only by an underrun) and a chunk (0.25 s here), and some.
    assert 0 < summary["key_to_pixel_ms"]["min"] and summary["key_to_pixel_ms"]["max"] < 4000
    played = 2 * 6 * 4 / 16  # the stub's chunks are 4 frames at 16 fps: all of them were played
    assert summary["underruns"] >= 0 and summary["viewing_s"] >= played - 1e-9
    assert summary["underruns_per_minute"] == summary["underruns"] / (summary["viewing_s"] / 60)
    assert 0.0 <= summary["deadline_attainment"] <= 1.0
    assert summary["serving_overhead_ratio"] > 0 and summary["pipeline_compute_s"] > 0


def test_bench_realtime_refuses_a_pacing_it_does_not_know():
    result = run_rtvideo(*BENCH, "--max-lead", "0", timeout=60)
    assert result.returncode == 2
    assert "argument --max-lead: '0': expected adaptive, off or a number of seconds > 0" in result.stderr


def two_sessions_against_room_for_one(bench: tuple[str, ...], chunks: int) -> dict:
    """``rtvideo BENCH`` with two sessions against a server with room for one: the
    second is refused (a fatal ``server_full`` error, then the close). The
    bench exits 1 with its summary, which names that one failure; returned."""
    server = start_server("--max-sessions", "1", pipeline={"step_time_s": 0.005})
    try:
        flags = ("--url", server.http, "--sessions", "2", "--chunks", str(chunks), "--json")
        result = run_rtvideo(*bench, *flags, timeout=120)
    finally:
        stop_server(server)
    assert result.returncode == 1, result.stderr
    summary = last_json(result.stdout)
    [refused] = summary["failed_sessions"]
    assert refused.startswith("server_full: "), refused
    return summary


def test_a_session_the_server_refuses_fails_and_the_others_still_count():
    summary = two_sessions_against_room_for_one(BENCH, chunks=4)
    assert summary["ttff_ms"]["max"] > 0 and summary["viewing_s"] > 0  # the session that ran is counted


def test_a_session_the_server_goes_silent_on_fails_on_the_stall_timeout():
    """A model far slower than the stall timeout (chunks of 4 steps of 2 s): after
    ``video.start`` nothing comes for 0.5 s, and the session fails saying so."""
    server = start_server(pipeline={"step_time_s": 2.0})
    try:
        flags = ("--url", server.http, "--sessions", "1", "--chunks", "2", "--stall-timeout", "0.5", "--json")
        result = run_rtvideo(*BENCH, *flags, timeout=120)
    finally:
        stop_server(server)
    assert result.returncode == 1, result.stderr
    summary = last_json(result.stdout)
    assert summary["failed_sessions"] == ["no message from the server for 0.5 s (--stall-timeout)"], summary


def test_bench_realtime_refuses_a_stall_timeout_that_is_not_a_time():
    result = run_rtvideo(*BENCH, "--stall-timeout", "0", timeout=60)
    assert result.returncode == 2
    assert "argument --stall-timeout: '0': expected a number of seconds > 0" in result.stderr
