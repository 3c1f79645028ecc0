"""On a CUDA machine: the Wan2.1-1.3B configuration (random weights, bf16) at
832x480 runs through the real pipeline, and its figures are printed.
Skipped without CUDA (see tests/conftest.py)."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.gpu


def test_wan_1_3b_pipeline_on_gpu(capsys):
    from rtvideo.bench.pipeline import run

    summary = run("wan2.1-1.3b", 832, 480, chunks=6, steps=4, device="cuda")
    print(json.dumps(summary))
    assert summary["dtype"] == "bfloat16" and summary["device"].startswith("cuda")
    assert summary["per_chunk_ms"]["total_ms"] > 0 and summary["generated_fps"] > 0
    assert 0 < summary["state_bytes"] < summary["session_memory_budget"]


def _without_tf32(monkeypatch) -> None:
    """fp32 means fp32: no TF32 in cuBLAS matmuls or cuDNN convolutions (the patch embedding)."""
    import torch

    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)


def _max_error(got, expected) -> float:
    return (got.float() - expected.float()).abs().max().item()


def check_cached_against_block_causal_fp32(device: str) -> None:
    from rtvideo.workers.pipelines.causal_wan import build
    from tests.model.test_causal_wan import cached_and_block_causal

    pipeline = build("tiny", device=device, dtype="float32")
    cached, full = cached_and_block_causal(pipeline)
    for got, expected in zip(cached, full, strict=True):
        assert got.device.type == device and got.dtype == expected.dtype
        assert _max_error(got, expected) <= 1e-4 * expected.abs().max().item()


def check_cached_against_block_causal_bf16(device: str) -> None:
    import torch

    from rtvideo.workers.pipelines.causal_wan import build
    from tests.model.test_causal_wan import cached_and_block_causal

    cached, full = cached_and_block_causal(build("tiny", device=device, dtype="bfloat16"))
    _, reference = cached_and_block_causal(build("tiny", device=device, dtype="float32"))
    for got, expected, exact in zip(cached, full, reference, strict=True):
        assert got.device.type == device and got.dtype == expected.dtype == torch.bfloat16
        rounding = _max_error(expected, exact)
        assert 0 < rounding <= 2e-2 * exact.abs().max().item()  # it is bf16, and no worse than bf16
        assert _max_error(got, expected) <= 2 * rounding


def test_cached_forward_matches_block_causal_forward_in_fp32(monkeypatch):
    """Chunk 0 committed, chunk 1 through the KV cache, against one forward over
    both chunks with a block-causal mask (as on the CPU in tests/model). In fp32
    the two differ only by the order CUDA kernels sum in: within 1e-4 of the
    output's scale (on the tiny preset a chunk roped at the wrong position is
    off by 2e-2 of it, one missing its cache by 5e-2)."""
    _without_tf32(monkeypatch)
    check_cached_against_block_causal_fp32("cuda")


def test_cached_forward_matches_block_causal_forward_in_bf16(monkeypatch):
    """The same in bf16 (the KV cache held in bf16), where kernels summing in
    another order round to other bf16 values, so the bound is measured: bf16's
    own error on this forward, X, is how far the bf16 block-causal forward is
    from the fp32 one (same weights). Two bf16 computations of the same function
    are each within about X of it, so within 2X of each other. On the tiny
    preset X is about 5e-3 of the output's scale, under the 2e-2 and 5e-2 of a
    wrong position or a missing cache."""
    _without_tf32(monkeypatch)
    check_cached_against_block_causal_bf16("cuda")


def test_tiny_fp32_on_gpu_tracks_the_cpu():
    """Noise is drawn on the CPU, so a GPU run of the same session is the same
    video up to kernel rounding (cuDNN may use TF32 in the VAE's convolutions)."""

    from rtvideo.workers.pipelines.causal_wan import build
    from tests.model.test_causal_wan import open_session, run_chunk

    gpu, cpu = build("tiny", device="cuda", dtype="float32"), build("tiny", device="cpu")
    a, b = open_session(gpu, "gpu", seed=8), open_session(cpu, "cpu", seed=8)
    for _ in range(3):
        _, clean_gpu = run_chunk(gpu, a)
        _, clean_cpu = run_chunk(cpu, b)
        error = (clean_gpu.cpu() - clean_cpu).abs().max().item()
        assert error <= 1e-3 * clean_cpu.abs().max().item(), error


async def test_a_worker_process_serves_the_tiny_preset_on_gpu():
    from rtvideo.engine.client.engine_client import EngineClient
    from rtvideo.engine.config import EngineConfig, PipelineSpec
    from rtvideo.engine.messages import SessionDone, StartSession
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

    from rtvideo.workers.pipelines.causal_wan import build
    from rtvideo.workers.warmup import warm_up

    pipeline = build("tiny", device="cuda")
    warm_up(pipeline)
    budget = pipeline.session_memory_budget()
    free, total = torch.cuda.mem_get_info()
    assert 0 < budget < total
    assert budget <= free + torch.cuda.memory_reserved() - torch.cuda.memory_allocated()


def test_fp8_linears_track_bf16_on_a_gpu_that_has_them():
    """Wan2.1-1.3B's block layout (one block): ``quantize_fp8`` swaps its ten
    linears, and each computes what its bf16 original does within FP8's
    precision (per-row scales: a few percent of the output's scale)."""
    import copy

    import torch
    from diffusers import WanTransformer3DModel

    from rtvideo.workers.pipelines.presets import WAN_1_3B_TRANSFORMER
    from rtvideo.workers.pipelines.quantize import fp8_linears, fp8_refusal, quantize_fp8

    device = torch.device("cuda")
    if fp8_refusal(device) is not None:
        pytest.skip(fp8_refusal(device))
    torch.manual_seed(0)
    wan = WanTransformer3DModel(**{**WAN_1_3B_TRANSFORMER, "num_layers": 1}).to(device, torch.bfloat16)
    original = copy.deepcopy(wan)
    assert quantize_fp8(wan, device, torch.bfloat16) == 10
    x = torch.randn(2, 64, 1536, device=device, dtype=torch.bfloat16)
    for name in fp8_linears(original):
        if original.get_submodule(name).in_features != x.shape[-1]:
            continue
        want = original.get_submodule(name)(x).float()
        got = wan.get_submodule(name)(x).float()
        assert (got - want).abs().mean() <= 0.05 * want.abs().mean(), name


@pytest.mark.parametrize(("dtype", "tolerance"), [("float32", 1e-4), ("bfloat16", 2e-2)])
def test_cuda_graph_replays_track_the_eager_forwards(monkeypatch, dtype, tolerance):
    """``cuda_graphs: true`` against the eager route, the same weights and
    noise: a session streamed past its window filling (its denoise forward and
    its commit captured, replayed), through a reset, then a new session after
    a release, which takes the first one's cache and graphs over. The replays run the
    kernels the eager forwards run, so every chunk's clean latent is within
    the dtype's rounding of the eager one (relative to its scale)."""
    from rtvideo.workers.pipelines.causal_wan import build
    from tests.model.test_causal_wan import open_session, release, run_chunk

    _without_tf32(monkeypatch)
    span = {"sink_frames": 3, "window_frames": 3, "warm_up_chunks": 0, "dtype": dtype}
    eager, graphs = build("tiny", device="cuda", **span), build("tiny", device="cuda", cuda_graphs=True, **span)
    for name in ("first", "second"):
        a = open_session(eager, name, seed=4, prompt_change="reset")
        b = open_session(graphs, name, seed=4, prompt_change="reset")
        for chunk in range(6):
            prompt = "a blue heron" if chunk == 3 and name == "first" else None
            _, want = run_chunk(eager, a, prompt)
            _, got = run_chunk(graphs, b, prompt)
            assert _max_error(got, want) <= tolerance * want.abs().max().item(), (name, chunk)
        release(eager, a)
        release(graphs, b)
    assert graphs.step_graphs.failure is None, graphs.step_graphs.failure  # a capture that failed says why
    figures = graphs.graph_figures()
    assert figures["captures"] == 2 and figures["replays"] > 10 and figures["held"] == 2  # the first session's
    assert figures["caches_taken_over"] == 1 and figures["kept_caches"] == 1


@pytest.mark.parametrize(("dtype", "tolerance"), [("float32", 1e-4), ("bfloat16", 2e-2)])
def test_batched_rows_replay_their_graphs_and_track_the_eager_forwards(monkeypatch, dtype, tolerance):
    """Two sessions in lockstep, both rows in every forward and in one commit
    pass: with ``cuda_graphs: true`` the batch's denoise forward and commit
    are captured once each (after their first, eager, use) and replayed; each
    chunk's clean latent tracks the eager pipeline's within the dtype's
    rounding, and the rows given the other way round replay the same graphs."""
    from rtvideo.engine.messages import StartSession
    from rtvideo.workers.pipelines.causal_wan import build
    from tests.model.test_causal_wan import driver_for

    _without_tf32(monkeypatch)
    span = {"sink_frames": 3, "window_frames": 3, "warm_up_chunks": 0, "dtype": dtype}
    eager, graphs = build("tiny", device="cuda", **span), build("tiny", device="cuda", cuda_graphs=True, **span)
    ids = ["row-a", "row-b"]
    latents = {}
    for name, pipeline in (("eager", eager), ("graphs", graphs)):
        driver = driver_for(pipeline)
        states = driver.open(*(StartSession(session_id=sid, prompt="a red fox", seed=n) for n, sid in enumerate(ids)))
        latents[name] = []
        for chunk in range(6):
            driver.run(ids if chunk < 5 else ids[::-1], 1)
            latents[name].append([state.cached_chunks[-1].clone() for state in states])
        driver.release(*ids)
    for chunk, (want, got) in enumerate(zip(latents["eager"], latents["graphs"], strict=True)):
        for a, b in zip(want, got, strict=True):
            assert _max_error(b, a) <= tolerance * a.abs().max().item(), chunk
    assert graphs.step_graphs.failure is None, graphs.step_graphs.failure  # a capture that failed says why
    figures = graphs.graph_figures()
    assert figures["captures"] == 2 and figures["fallbacks"] == 2 and figures["replays"] > 10
