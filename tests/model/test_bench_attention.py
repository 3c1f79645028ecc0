"""The bench settings ``cudnn-attention`` and ``flash-attention`` (pipeline
option ``attention``) on a CPU: ``refusal`` answers with the pipeline's own
probe (cuDNN refused, torch's CPU flash kernel accepted), ``--with`` runs
``flash-attention`` and the summary says ``attention``, ``--with`` and
``--versus all`` refuse ``cudnn-attention`` with the pipeline's words."""

from __future__ import annotations

import json

import pytest
import torch

from rtvideo.bench import pipeline as bench_pipeline
from rtvideo.bench import versus as bench_versus
from rtvideo.bench.settings import SETTINGS, refusal
from rtvideo.engine.messages import StartSession
from rtvideo.workers.pipelines.causal_wan import build

QUICK = ("--json", "--device", "cpu", "--steps", "2", "--chunks", "2")


def test_the_settings_are_the_option_and_refusal_is_the_pipelines_probe():
    assert SETTINGS["cudnn-attention"] == {"attention": "cudnn"}
    assert SETTINGS["flash-attention"] == {"attention": "flash"}
    cpu = torch.device("cpu")
    assert refusal("flash-attention", cpu) is None and refusal("flash-attention", cpu, "bfloat16") is None
    why = refusal("cudnn-attention", cpu, "bfloat16")
    assert why.startswith("attention: cudnn (torch's CUDNN_ATTENTION kernel, 12 heads of 128) is refused by torch")
    assert why.endswith("; this runs on cpu (bfloat16)")
    with pytest.raises(ValueError) as built:
        build("tiny", device="cpu", warm_up_chunks=0, attention="cudnn", dtype="bfloat16")
    assert str(built.value) == why.replace("12 heads of 128", "2 heads of 12")  # the same probe, the model's heads


def test_with_flash_attention_runs_and_the_summary_says_so(capsys):
    assert bench_pipeline.main([*QUICK, "--with", "flash-attention"]) == 0
    summary = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert summary["with"] == ["flash-attention"] and summary["attention"] == "flash"
    assert summary["generated_fps"] > 0


def test_with_cudnn_attention_is_refused_naming_why(capsys):
    with pytest.raises(SystemExit) as exit:
        bench_pipeline.main([*QUICK, "--with", "cudnn-attention"])
    assert str(exit.value.code).startswith(
        "rtvideo bench pipeline: --with cudnn-attention is refused on cpu: attention: cudnn (torch's CUDNN_ATTENTION"
    )


def test_versus_all_names_cudnn_attention_refused_and_reports_flash():
    def _build(**options):
        return bench_pipeline._build("tiny", "cpu", None, None, **options)

    start = StartSession(session_id="versus", prompt="a red fox", num_inference_steps=2)
    summary = bench_versus.versus_all(_build, start, 2, 1, variants=("flash-attention", "cudnn-attention"))
    assert list(summary["refused"]) == ["cudnn-attention"]
    assert summary["refused"]["cudnn-attention"].startswith("attention: cudnn (torch's CUDNN_ATTENTION kernel")
    pipelines = summary["variants"]["flash-attention"]["pipelines"]
    assert pipelines["flash-attention"]["attention"] == "flash" and pipelines["default"]["attention"] == "auto"
