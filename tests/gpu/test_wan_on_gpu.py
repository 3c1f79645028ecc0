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
    assert 0 < summary["state_bytes"] < summary["session_memory_budget"]


def test_cached_forward_matches_block_causal_forward_in_bf16():
    import torch

    from tests.model.test_causal_wan import open_session
    from workers.pipelines.causal_wan import build

    pipeline = build("tiny", device="cuda")
    state = open_session(pipeline)
    state.extra["conditioning"] = state.extra["prompt"].target
    chunk = torch.randn(state.extra["latent_shape"], device="cuda", dtype=pipeline.dtype)
    with torch.no_grad():
        first = pipeline._forward([state], chunk, [0.0], commit=True)
    assert torch.isfinite(first.float()).all()


def test_tiny_fp32_on_gpu_tracks_the_cpu():
    """Noise is drawn on the CPU, so a GPU run of the same session is the same
    video up to kernel rounding (cuDNN may use TF32 in the VAE's convolutions)."""

    from tests.model.test_causal_wan import open_session, run_chunk
    from workers.pipelines.causal_wan import build

    gpu, cpu = build("tiny", device="cuda", dtype="float32"), build("tiny", device="cpu")
    a, b = open_session(gpu, "gpu", seed=8), open_session(cpu, "cpu", seed=8)
    for _ in range(3):
        _, clean_gpu = run_chunk(gpu, a)
        _, clean_cpu = run_chunk(cpu, b)
        error = (clean_gpu.cpu() - clean_cpu).abs().max().item()
        assert error <= 1e-3 * clean_cpu.abs().max().item(), error


async def test_a_worker_process_serves_the_tiny_preset_on_gpu():
    from engine.client import EngineClient
    from engine.config import EngineConfig, PipelineSpec
    from engine.messages import SessionDone, StartSession
    from tests.support import collect

    client = EngineClient(EngineConfig(pipeline=PipelineSpec("tiny", {"device": "cuda"}), startup_timeout_s=300))
    await client.start()
    try:
        handle = await client.start_session(StartSession(session_id="g", prompt="p", num_chunks=3))
        result = await collect(handle, timeout=120)
        assert isinstance(result.end, SessionDone) and [c.num_frames for c in result.chunks] == [9, 12, 12]
    finally:
        await client.shutdown()


def test_the_memory_budget_on_gpu_is_what_is_free_less_the_warm_up_peak():
    import torch

    from workers.pipelines.causal_wan import build
    from workers.warmup import warm_up

    pipeline = build("tiny", device="cuda")
    warm_up(pipeline)
    budget = pipeline.session_memory_budget()
    free, total = torch.cuda.mem_get_info()
    assert 0 < budget < total
    assert budget <= free + torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
