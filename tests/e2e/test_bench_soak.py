"""``rtvideo bench soak`` against a test server: a few rounds take every path
and report the server's memory and open files per round; a server that
does not serve a path as promised (here: its prompt policy refuses one) is a
failure named in the summary, which still prints as
the last line, and the exit status is 1."""

from __future__ import annotations

import json

from rtvideo.bench.soak import PATHS, WATCHED
from tests.e2e.conftest import start_server, stop_server
from tests.support import last_json, rtvideo_summary, run_rtvideo

BENCH = ("bench", "soak")


def test_a_few_rounds_take_every_path_and_watch_both_processes(server):
    flags = ("--url", server.http, "--rounds", "3", "--warm-up-rounds", "1", "--seed", "5", "--json")
    summary = rtvideo_summary(*BENCH, *flags, timeout=180)
    assert summary["bench"] == "soak" and summary["rounds"] == 3 and summary["failures"] == []
    assert summary["paths"] == {path: 3 for path in PATHS}
    assert summary["served_by"]["kind"] == "cpu"
    for name in WATCHED:
        figure = summary[name]
        assert figure["exported"] and len(figure["per_round"]) == 3, (name, figure)
        assert figure["after_warm_up"] == figure["per_round"][0] > 0
    assert summary["enough_rounds"] is False  # three rounds check the paths, not a leak


def test_a_path_the_server_does_not_serve_as_promised_fails_the_soak_naming_it(tmp_path):
    """A server whose prompt policy refuses the ``watched`` path's prompt: that path
    fails each round with the server's refusal, every other path passes. The
    server is behind an API key: every path's socket and request, the
    server's figures and its description carry the bench's ``--api-key``,
    which no line it prints repeats."""
    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps({"deny": ["watched path"], "reason": "not this one"}))
    key = "soak-key-4f1c"
    server = start_server("--prompt-policy", str(policy), "--api-key", key, pipeline={"step_time_s": 0.005})
    try:
        flags = ("--url", server.http, "--rounds", "2", "--warm-up-rounds", "0", "--api-key", key, "--json")
        result = run_rtvideo(*BENCH, *flags, timeout=180)
    finally:
        stop_server(server)
    assert result.returncode == 1, result.stderr
    assert key not in result.stdout and key not in result.stderr
    summary = last_json(result.stdout)
    assert summary["served_by"]["kind"] == "cpu"  # the server's description, asked for with the key
    assert all(summary[name]["exported"] for name in WATCHED)  # its /metrics too
    assert summary["rounds"] == 2 and summary["paths"] == {path: 0 if path == "watched" else 2 for path in PATHS}
    assert len(summary["failures"]) == 2
    for round_, failure in enumerate(summary["failures"]):
        assert failure.startswith(f"round {round_}: watched: SoakFailure: prompt_refused: "), failure
    assert summary["leaks"] == []


def test_bench_soak_refuses_options_out_of_range():
    result = run_rtvideo(*BENCH, "--chunks", "1", timeout=60)
    assert result.returncode != 0
    assert "rtvideo bench soak: chunks must be >= 2" in result.stderr
    result = run_rtvideo(*BENCH, "--minutes", "0", timeout=60)
    assert result.returncode == 2 and "argument --minutes: '0': expected a number of minutes > 0" in result.stderr
