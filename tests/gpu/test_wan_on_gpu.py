"""On a CUDA machine: the Wan2.1-1.3B configuration (random weights, bf16) at
832x480 runs through the real pipeline, and its figures are printed.
Skipped without CUDA (see tests/conftest.py)."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.gpu


def test_wan_1_3b_pipeline_on_gpu(capsys):
    from workers.bench_pipeline import run

    summary = run("wan2.1-1.3b", 832, 480, chunks=6, steps=4, device="cuda")
    print(json.dumps(summary))
    assert summary["dtype"] == "bfloat16" and summary["device"].startswith("cuda")
    assert summary["per_chunk_ms"]["total_ms"] > 0 and summary["generated_fps"] > 0


def test_cached_forward_matches_block_causal_forward_in_bf16():
    import torch

    from tests.model.test_causal_wan import open_session
    from workers.pipelines.causal_wan import build

    pipeline = build("tiny", device="cuda")
    state = open_session(pipeline)
    state.extra["conditioning"] = state.extra["prompt"].target
    chunk = torch.randn(state.extra["latent_shape"], device="cuda", dtype=pipeline.dtype)
    with torch.no_grad():
        first = pipeline._forward(state, chunk, 0.0, commit=True)
    assert torch.isfinite(first.float()).all()
