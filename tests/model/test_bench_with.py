"""``rtvideo bench pipeline --with``: speed settings applied to the measured
configuration (the run and both sides of ``--versus``), refused naming the
setting and why where this device cannot run it; ``--versus combined``: the
fast settings together against the default, refused on a CPU with the reasons."""

from __future__ import annotations

import json

import pytest

from rtvideo.bench import pipeline as bench_pipeline
from rtvideo.bench import versus as bench_versus
from rtvideo.engine.messages import StartSession
from tests.support import run_rtvideo

QUICK = ("--json", "--device", "cpu", "--steps", "2")


def _summary(capsys, *flags: str) -> dict:
    assert bench_pipeline.main([*QUICK, *flags]) == 0
    return json.loads(capsys.readouterr().out.splitlines()[-1])


def _refused(capsys, *flags: str) -> str:
    with pytest.raises(SystemExit) as exit:
        bench_pipeline.main([*QUICK, *flags])
    assert exit.value.code != 0
    return str(exit.value.code) + capsys.readouterr().err


def test_with_runs_the_measured_configuration_with_its_settings_and_says_so(capsys):
    summary = _summary(capsys, "--chunks", "2", "--with", "tiny-decoder,commit-from-last-step")
    assert summary["with"] == ["tiny-decoder", "commit-from-last-step"]
    assert summary["decoder"] == "tiny" and summary["tiny_decoder_weights"] == "random"  # the tiny preset has none
    assert summary["commit_from_last_step"] is True and summary["quantize"] is None and not summary["cuda_graphs"]
    assert summary["generated_fps"] > 0 and summary["per_chunk_ms"]["decode_ms"] > 0


def test_with_reaches_both_sides_of_versus(capsys):
    flags = ("--chunks", "2", "--rounds", "1", "--dtype", "bfloat16", "--versus", "vae-float32")
    summary = _summary(capsys, *flags, "--with", "commit-from-last-step")
    assert summary["with"] == ["commit-from-last-step"] and summary["settings"] == ["vae-float32"]
    default, variant = summary["pipelines"]["default"], summary["pipelines"]["vae-float32"]
    assert default["commit_from_last_step"] is variant["commit_from_last_step"] is True
    assert default["vae_dtype"] == "bfloat16" and variant["vae_dtype"] == "float32"
    assert summary["with_tiny_decoder_weights"] is None and summary["rounds"][0]["fps_ratio"] > 0


def test_a_setting_this_device_refuses_is_named_with_why_and_no_traceback(capsys):
    result = run_rtvideo("bench", "pipeline", "--device", "cpu", "--with", "tiny-decoder,fp8")
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert "--with fp8 is refused on cpu: quantize fp8: FP8 matrix products need a GPU" in result.stderr
    why = _refused(capsys, "--with", "cuda-graphs")
    assert "--with cuda-graphs is refused on cpu: cuda_graphs: CUDA graphs need a CUDA device" in why


def test_unknown_settings_and_a_setting_on_both_sides_are_errors(capsys):
    why = _refused(capsys, "--with", "tiny-decoder,fast")
    assert "argument --with: unknown setting 'fast': known are compile, cudnn-benchmark" in why and "combined" in why
    why = _refused(capsys, "--versus", "tiny-decoder", "--with", "tiny-decoder")
    assert "--versus tiny-decoder: tiny-decoder is on both sides already (--with tiny-decoder)" in why
    why = _refused(capsys, "--versus", "combined", "--with", "compile,tiny-decoder")
    assert "--versus combined: tiny-decoder is on both sides already" in why


def test_versus_combined_on_a_cpu_is_refused_naming_each_part_and_why(capsys):
    why = _refused(capsys, "--versus", "combined")
    assert "--versus combined: cuda_graphs: CUDA graphs need a CUDA device; this pipeline runs on cpu" in why
    assert "quantize fp8: FP8 matrix products need a GPU" in why

    def build(**options):
        return bench_pipeline._build("tiny", "cpu", None, None, **options)

    start = StartSession(session_id="versus", prompt="a red fox", num_inference_steps=2)
    summary = bench_versus.versus_all(build, start, 2, 1, variants=("combined",))
    assert summary["variants"] == {} and list(summary["refused"]) == ["combined"]
    assert "CUDA graphs need a CUDA device" in summary["refused"]["combined"]
    assert "FP8 matrix products need a GPU" in summary["refused"]["combined"]


def test_with_captured_steps_each_session_fills_the_window_and_captures_untimed(monkeypatch):
    from rtvideo.bench import settings

    monkeypatch.setitem(settings.SETTINGS, "cuda-graphs", {"cuda_graphs": "eager"})  # a CPU's stand-in: no capture
    made, expected = [], []
    progress = bench_pipeline.Progress.silent()
    monkeypatch.setattr(progress, "advance", lambda amount=1: made.append(amount))
    monkeypatch.setattr(progress, "expect", lambda total, done=None: expected.append(total))
    summary = bench_pipeline.run(
        "tiny", None, None, 2, 2, "cpu", sessions=(2,), with_settings=("cuda-graphs",), progress=progress
    )
    assert summary["with"] == ["cuda-graphs"] and summary["cuda_graphs"] == "eager"
    assert summary["untimed_chunks"] == 7  # after the first: 5 that fill the window, 2 that capture
    assert expected == [sum(made)] == [bench_pipeline.run_chunks(2, (2,), untimed=7)]
    assert summary["step_graphs"]["replays"] > 0 and summary["side_by_side"][0]["one_row_fps"] > 0
    # the two sessions stepped together: the batch's denoise forward and commit, each used once eagerly,
    # captured (untimed, with the window's filling), then replayed
    batched = summary["side_by_side"][0]["batched_step_graphs"]
    assert batched["captures"] == batched["fallbacks"] == 2 and batched["replays"] > 2
