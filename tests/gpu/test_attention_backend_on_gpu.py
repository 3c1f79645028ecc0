"""On a CUDA machine: the pipeline option ``attention``
(``rtvideo.workers.pipelines.attention_backend``). A small causal Wan session (the tiny
preset with Wan2.1-1.3B's head dim, 128, so each kernel meets the real
model's head-dim rule; bf16; window full after two chunks) run with each
kernel the GPU accepts tracks the same session with ``math`` within bf16's
rounding; a kernel the GPU refuses is skipped with torch's reason (the
build's own refusal). ``cudnn`` with captured steps (``cuda_graphs: true``)
tracks ``cudnn`` eager. Each kernel's time for one self-attention of the
1.3B configuration at 832x480 (4680 queries over a full cache's 37440 keys)
is printed beside ``auto``'s: which kernel torch picks is measured, not
assumed. Skipped without CUDA (see tests/conftest.py)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu

HEADS, HEAD_DIM = 2, 128
SIZE = {"width": 128, "height": 128}  # 64 tokens a latent frame
BF16 = 2e-2  # relative to the largest clean-latent value: bf16's rounding (2^-8) through the blocks and chunks


def _pipeline(**options):
    import dataclasses

    import torch
    from diffusers.models.transformers.transformer_wan import WanTransformer3DModel

    from rtvideo.workers.pipelines.causal_wan import CausalWanPipeline
    from rtvideo.workers.pipelines.presets import TINY_TRANSFORMER, build_tiny

    torch.manual_seed(0)
    transformer = WanTransformer3DModel(
        **dict(TINY_TRANSFORMER, num_attention_heads=HEADS, attention_head_dim=HEAD_DIM)
    )
    components = dataclasses.replace(build_tiny(0), transformer=transformer)
    span = {"sink_frames": 3, "window_frames": 3, "warm_up_chunks": 0, "dtype": "bfloat16"}
    return CausalWanPipeline(components, device="cuda", **span, **options)


def _latents(pipeline, chunks: int = 4):
    from tests.model.test_causal_wan import open_session, release, run_chunk

    state = open_session(pipeline, "a", seed=4, num_inference_steps=2, **SIZE)
    latents = [run_chunk(pipeline, state)[1] for _ in range(chunks)]
    release(pipeline, state)
    return latents


def _refused(value: str) -> str | None:
    import torch

    from rtvideo.workers.pipelines.attention_backend import attention_refusal

    return attention_refusal(value, torch.device("cuda"), torch.bfloat16, HEADS, HEAD_DIM, 64)


def _close(got, want) -> None:
    for chunk, (g, w) in enumerate(zip(got, want, strict=True)):
        difference = (g.float() - w.float()).abs().max().item()
        assert difference <= BF16 * w.float().abs().max().item(), (chunk, difference)


@pytest.mark.parametrize("value", ["auto", "flash", "cudnn", "efficient"])
def test_each_accepted_kernel_tracks_math_in_bf16(value):
    if (why := _refused(value)) is not None:
        with pytest.raises(ValueError, match="attention: "):
            _pipeline(attention=value)
        pytest.skip(why)
    _close(_latents(_pipeline(attention=value)), _latents(_pipeline(attention="math")))


def test_cudnn_captured_tracks_cudnn_eager():
    if (why := _refused("cudnn")) is not None:
        pytest.skip(why)
    eager = _latents(_pipeline(attention="cudnn"))
    captured = _pipeline(attention="cudnn", cuda_graphs=True)
    got = _latents(captured)
    assert captured.step_graphs.failure is None, captured.step_graphs.failure  # a capture that failed says why
    figures = captured.graph_figures()
    # from chunk 2 on (the window full): each step's key and the commit's run eagerly once (a fallback), then
    # are captured; a capture's own run counts as a replay (the same figures with cuda_graphs "eager" on a CPU)
    assert (figures["captures"], figures["replays"], figures["fallbacks"]) == (2, 4, 2), figures
    _close(got, eager)


def test_each_kernels_time_for_one_1_3b_self_attention(capsys):
    import torch
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    from rtvideo.workers.pipelines.attention_backend import ATTENTION, attend, attention_refusal

    def run(name):  # auto: torch's choice, as the pipeline calls it
        kernel = ATTENTION[name]
        return dispatch_attention_fn(query, key, value) if kernel is None else attend(kernel, query, key, value)

    generator = torch.Generator(device="cuda").manual_seed(1)
    query = torch.randn(1, 4680, 12, 128, device="cuda", generator=generator).bfloat16()
    key, value = (torch.randn(1, 37440, 12, 128, device="cuda", generator=generator).bfloat16() for _ in range(2))
    times, reference = {}, None
    for name in ("auto", "flash", "cudnn", "efficient"):
        if (why := attention_refusal(name, torch.device("cuda"), torch.bfloat16)) is not None:
            times[name] = why
            continue
        out = run(name)
        reference = out if reference is None else reference
        torch.testing.assert_close(out.float(), reference.float(), rtol=2**-7, atol=2e-2)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            run(name)
        end.record()
        torch.cuda.synchronize()
        times[name] = f"{start.elapsed_time(end) / 10:.2f} ms"
    with capsys.disabled():
        print(f"\none 1.3B self-attention, 4680 queries over 37440 keys, bf16: {times}")
    assert reference is not None
