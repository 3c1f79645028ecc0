"""``rtvideo bench pipeline`` runs and its JSON has every figure."""

from __future__ import annotations

import json

import pytest
import torch

from tests.support import rtvideo_summary

QUICK = ("--json", "--chunks", "3", "--steps", "2")


def _bench(*flags: str) -> dict:
    """Through the ``rtvideo`` command, as a user runs it."""
    return rtvideo_summary("bench", "pipeline", *QUICK, *flags)


def _bench_here(capsys, *flags: str) -> dict:
    """The same bench in this process (a subprocess costs seconds of imports)."""
    import torch

    from rtvideo.bench import pipeline as bench_pipeline

    timing = torch.backends.cudnn.benchmark
    try:
        assert bench_pipeline.main([*QUICK, *flags]) == 0
    finally:
        torch.backends.cudnn.benchmark = timing
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_bench_pipeline_prints_the_per_chunk_split_and_fps():
    summary = _bench()
    assert summary["bench"] == "pipeline" and summary["preset"] == "tiny" and summary["steps"] == 2
    machine = summary["machine"]  # the figures' label: what they were measured on
    assert machine["kind"] == "cpu" and machine["torch"] == torch.__version__ and machine["name"] == machine["cpu"]
    assert set(summary["per_chunk_ms"]) == {"denoise_ms", "commit_ms", "decode_ms", "total_ms"}
    assert all(value > 0 for value in summary["per_chunk_ms"].values())
    assert summary["time_to_first_chunk_s"] > 0 and summary["generated_fps"] > 0
    assert summary["playback_fps"] == 16.0
    assert summary["warm_up_s"] > 0 and summary["dtype"] == summary["vae_dtype"] == "float32"
    assert 0 < summary["state_bytes"] < summary["session_memory_budget"]  # a CPU: the host's available memory
    assert summary["side_by_side"] is None and summary["untimed_chunks"] == 0
    assert summary["with"] == [] and summary["decoder"] == "full" and summary["tiny_decoder_weights"] is None
    overlap = summary["decode_overlap"]
    for mode in ("in_line", "overlapped"):
        assert overlap[mode]["time_to_first_chunk_s"] > 0 and overlap[mode]["fps"] > 0
    assert overlap["fps_overlapped_over_in_line"] > 0


def test_bench_pipeline_runs_bf16_cold_writes_a_profile_and_compares_batching(tmp_path):
    profile = tmp_path / "profile.txt"
    flags = ("--dtype", "bfloat16", "--vae-dtype", "float32", "--no-warm-up", "--profile", str(profile))
    summary = _bench(*flags, "--sessions", "2,3")
    assert summary["dtype"] == "bfloat16" and summary["vae_dtype"] == "float32"
    assert [side["sessions"] for side in summary["side_by_side"]] == [2, 3]
    for side in summary["side_by_side"]:
        assert side["one_row_fps"] > 0 and side["batched_fps"] > 0
    assert summary["warm_up_s"] == 0.0 and summary["generated_fps"] > 0
    assert "Self CPU" in profile.read_text()


def test_bench_pipeline_versus_alternates_the_two_in_rounds_and_reports_each_ratio(capsys):
    summary = _bench_here(capsys, "--versus", "vae-float32", "--dtype", "bfloat16", "--rounds", "2")
    assert summary["bench"] == "pipeline-versus" and summary["variant"] == "vae-float32"
    default, variant = summary["pipelines"]["default"], summary["pipelines"]["vae-float32"]
    assert default["vae_dtype"] == "bfloat16" and variant["vae_dtype"] == "float32"
    assert default["dtype"] == variant["dtype"] == "bfloat16" and not default["compiled"] and not variant["compiled"]
    assert [one["first"] for one in summary["rounds"]] == ["default", "vae-float32"]
    for one in summary["rounds"]:
        for side in ("default", "variant"):
            assert one[side]["fps"] > 0 and one[side]["time_to_first_chunk_s"] > 0
        assert one["fps_ratio"] == one["variant"]["fps"] / one["default"]["fps"]
    assert summary["fps_ratios"] == [one["fps_ratio"] for one in summary["rounds"]]
    assert summary["median_fps_ratio"] == sum(summary["fps_ratios"]) / 2


def test_bench_pipeline_versus_refuses_a_comparison_that_would_measure_nothing():
    """In this process (a subprocess each cost 5 s of imports; that a refusal
    ends without a traceback is tested through the command in test_bench_with)."""
    import torch

    from rtvideo.bench import pipeline as bench_pipeline

    timing = torch.backends.cudnn.benchmark
    try:
        for flags, why in (
            (["vae-float32"], "fp32 already"),  # the CPU's default dtype is fp32, and the VAE follows it
            (["compile", "--compile"], "compiled already"),
            (["cudnn-benchmark", "--cudnn-benchmark"], "timing on already"),
        ):
            with pytest.raises(SystemExit) as refused:
                bench_pipeline.main(["--chunks", "3", "--versus", *flags])
            assert why in str(refused.value.code), refused.value.code
    finally:
        torch.backends.cudnn.benchmark = timing


def test_bench_pipeline_versus_the_tiny_decoder_reports_its_speed_and_how_far_its_frames_are(capsys):
    summary = _bench_here(capsys, "--versus", "tiny-decoder", "--rounds", "2")
    assert summary["variant"] == "tiny-decoder" and summary["tiny_decoder_weights"] == "random"
    assert summary["pipelines"]["default"]["decoder"] == "full"
    assert summary["pipelines"]["tiny-decoder"]["decoder"] == "tiny"
    for one in summary["rounds"]:
        quality = one["quality"]
        assert not quality["identical"] and quality["psnr_db"] > 0 and 0 < quality["mean_abs_levels"] <= 255
        assert one["default"]["peak_memory_bytes"] is None  # a CPU: no device memory to read
    vae = _bench_here(capsys, "--versus", "vae-float32", "--dtype", "bfloat16", "--rounds", "1")["rounds"][0]["quality"]
    assert vae["mean_abs_levels"] < 5  # the same decoder in another precision: a level or so


def test_bench_pipeline_versus_commit_from_last_step_measures_the_forward_it_saves_and_what_it_costs(capsys):
    summary = _bench_here(capsys, "--versus", "commit-from-last-step", "--rounds", "1", "--chunks", "4")
    assert summary["pipelines"]["commit-from-last-step"]["commit_from_last_step"] is True
    assert summary["pipelines"]["default"]["commit_from_last_step"] is False
    [one] = summary["rounds"]
    assert one["fps_ratio"] > 0 and not one["quality"]["identical"]  # the chunks after the first differ
