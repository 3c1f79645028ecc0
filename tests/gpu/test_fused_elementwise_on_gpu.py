"""On a CUDA machine: ``fused_elementwise`` (``rtvideo.workers.pipelines.wan_block_forward``)
with inductor's Triton kernels. Each fused group at the Wan2.1-1.3B width
tracks the eager group within bf16's rounding (its time against eager is
printed), and the tiny pipeline fused and captured (``cuda_graphs: true``)
tracks the eager route with nothing compiled inside a capture. Skipped
without CUDA (see tests/conftest.py)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu


def _inputs(rows: int = 1, tokens: int = 4680, width: int = 1536):
    """832x480's tokens a chunk (3 latent frames of 30x52 patches), bf16 activations, fp32 modulation;
    the rotation's queries as 12 heads of 128 with fp32 tables, and the buffer it writes into."""
    import torch

    generator = torch.Generator(device="cuda").manual_seed(3)
    x, y = (3 * torch.randn(rows, tokens, width, device="cuda", generator=generator) for _ in range(2))
    x, y = x.bfloat16(), y.bfloat16()
    scale, shift, gate = torch.randn(rows, 6, width, device="cuda", generator=generator).chunk(6, dim=1)[:3]
    weight, bias = (torch.randn(width, device="cuda", generator=generator) for _ in range(2))
    cos, sin = (torch.randn(1, tokens, 1, 128, device="cuda", generator=generator) for _ in range(2))
    queries = x.view(rows, tokens, width // 128, 128)
    return {
        "modulate": (x, None, None, 1e-6, scale, shift),
        "gated_residual_norm": (x, y, gate, weight, bias, 1e-6),
        "residual_modulate": (x, y, None, None, 1e-6, scale, shift),
        "gated_residual": (x, y, gate),
        "rope": (queries, cos, sin, torch.empty_like(queries)),
    }


def _milliseconds(function, args, repeats: int = 50) -> float:
    import torch

    function(*args)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        function(*args)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def test_fused_groups_track_the_eager_groups_in_bf16_at_the_1_3b_width(capsys):
    import torch

    from rtvideo.workers.pipelines.wan_block_forward import EAGER, fused_ops

    fused, times = fused_ops(), {}
    with torch.no_grad():
        for name, args in _inputs().items():
            got = getattr(fused, name)(*args)
            got = got.clone() if name == "rope" else got  # the rotation writes into its last argument: keep it
            expected = getattr(EAGER, name)(*args)
            got, expected = (got, expected) if isinstance(got, tuple) else ((got,), (expected,))
            for g, e in zip(got, expected, strict=True):
                assert g.dtype == e.dtype == torch.bfloat16
                # an fp32 ulp in the norm may round the other way in bf16: one bf16 ulp (2^-8 relative), rarely
                torch.testing.assert_close(g.float(), e.float(), rtol=2**-7, atol=1e-3)
                assert (g != e).float().mean().item() < 0.01, name
            times[name] = {
                "eager_ms": _milliseconds(getattr(EAGER, name), args),
                "fused_ms": _milliseconds(getattr(fused, name), args),
            }
    print(times)


@pytest.mark.parametrize(("dtype", "tolerance"), [("float32", 1e-4), ("bfloat16", 2e-2)])
def test_fused_and_captured_tracks_the_eager_route_and_captures_compile_nothing(monkeypatch, dtype, tolerance):
    import torch
    from torch._dynamo.utils import counters

    from rtvideo.workers.pipelines.causal_wan import build
    from tests.model.test_causal_wan import open_session, release, run_chunk

    if dtype == "float32":  # fp32 means fp32 on both routes: no TF32 in cuBLAS or cuDNN (the patch embedding)
        monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
        monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    span = {"sink_frames": 3, "window_frames": 3, "warm_up_chunks": 0, "dtype": dtype}
    eager = build("tiny", device="cuda", **span)
    fused = build("tiny", device="cuda", cuda_graphs=True, fused_elementwise=True, **span)
    inside = []
    inner = fused.step_graphs.capture

    class Watched:
        def capture(self, function):
            before = counters["stats"]["unique_graphs"]
            replay = inner.capture(function)  # its side-stream run, then the capture
            inside.append(counters["stats"]["unique_graphs"] - before)
            return replay

    fused.step_graphs.capture = Watched()
    a, b = open_session(eager, "eager", seed=4), open_session(fused, "fused", seed=4)
    for chunk in range(5):
        _, want = run_chunk(eager, a)
        _, got = run_chunk(fused, b)
        assert (got.float() - want.float()).abs().max().item() <= tolerance * want.abs().max().item(), chunk
    release(eager, a)
    release(fused, b)
    assert fused.step_graphs.failure is None, fused.step_graphs.failure  # a capture that failed says why
    figures = fused.graph_figures()
    assert figures["captures"] == 2 and figures["replays"] > 4
    assert inside == [0, 0]
