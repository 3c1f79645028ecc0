"""``rtvideo bench engine`` runs end to end and its JSON has every figure."""

from __future__ import annotations

from tests.support import rtvideo_summary


def test_bench_engine_prints_a_complete_json_summary_last():
    summary = rtvideo_summary(
        "bench", "engine", "--json", "--step-ms", "2", "--chunks", "4", "--interactions", "3", "--repeats", "1"
    )
    assert summary["bench"] == "engine"
    assert summary["machine"]["kind"] == "cpu" and summary["machine"]["cpu_cores"] >= 1
    for mode in ("grouped", "ungrouped"):
        overhead = summary[mode]["overhead"]
        assert [r["steps_per_chunk"] for r in overhead["runs"]] == [1, 2, 3, 4]
        assert {"fit_per_step_ms", "fit_per_chunk_ms", "per_step_overhead_ratio", "per_chunk_overhead_ratio"} <= set(
            overhead
        )
        assert "fit_per_step_ms" in summary[mode]["overhead_zero_step"]
        interactions = summary[mode]["interactions"]
        assert interactions["n"] == 3
        assert {"p50", "p95", "max"} <= set(interactions["queued_to_applied_ms"])
        assert interactions["lag_exactly_one_chunk"] is True
    # Every denoise step is one micro-step, grouped or not, and one more frees the session.
    for mode in ("grouped", "ungrouped"):
        assert [r["iterations"] for r in summary[mode]["overhead"]["runs"]] == [4 * s + 1 for s in (1, 2, 3, 4)]
    assert set(summary["targets"]) == {
        "overhead_le_2pct_of_step",
        "grouping_removes_ge_90pct",
        "grouping_removes_ge_90pct_zero_step",
        "lag_exactly_one_chunk",
    }
