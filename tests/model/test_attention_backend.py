"""The causal Wan pipeline option ``attention`` (``rtvideo.workers.pipelines.attention_backend``)
on a CPU, the tiny preset at 32x32 (4 tokens a latent frame), window full after
two chunks so the later chunks attend over sink, window and chunk.

- ``auto`` is today's pipeline bit for bit: frames and clean latents equal to
  a pipeline built without the option, nothing set on the processors.
- ``math`` tracks ``auto`` within 1e-5 of the latent's largest value in fp32:
  torch's CPU ``auto`` picks its flash kernel here, whose online softmax sums in
  another order than the math kernel's full softmax; measured 1e-7 to 2e-7
  relative over these chunks (one to two fp32 ulps, 2^-23 = 1.2e-7), the
  bound leaves room for that to grow through more chunks or another CPU's
  vector width, while any real error (a wrong key span, a missing scale) is
  of order one.
- What torch on this CPU does: its flash kernel runs (fp32), and tracks
  ``auto`` within the same bound; the cuDNN and memory-efficient kernels are
  CUDA kernels, refused at build naming the option, the value, torch's reason,
  the device and the dtype. An unknown value is refused naming the known ones.
- A chosen kernel is on every block's ``attn1`` (ours), not its ``attn2``
  (diffusers') processor, and diffusers' process-wide default is untouched.
- ``math`` under the captured-step path (``cuda_graphs: "eager"``) is the eager
  ``math`` pipeline bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from diffusers.models.attention_dispatch import _AttentionBackendRegistry
from diffusers.models.transformers.transformer_wan import WanAttnProcessor

from rtvideo.workers.pipelines.attention_backend import ATTENTION, attention_refusal
from rtvideo.workers.pipelines.causal_wan import build
from rtvideo.workers.pipelines.wan_attention import CausalSelfAttnProcessor
from tests.model.test_causal_wan import open_session, release, run_chunk

SPAN = {"sink_frames": 3, "window_frames": 3, "warm_up_chunks": 0}
CHUNKS = 4
TOLERANCE = 1e-5  # relative to the largest clean-latent value (module docstring)


def _chunks(pipeline) -> list[tuple[bytes, torch.Tensor]]:
    state = open_session(pipeline, "a", seed=4, num_inference_steps=2, width=32, height=32)
    out = []
    for _ in range(CHUNKS):
        frames, latent = run_chunk(pipeline, state)
        out.append((frames.payload, latent))
    release(pipeline, state)
    return out


@pytest.fixture(scope="module")
def before() -> list[tuple[bytes, torch.Tensor]]:
    """The pipeline as it was before the option: built without it."""
    return _chunks(build("tiny", device="cpu", **SPAN))


def test_auto_is_the_pipeline_without_the_option_bit_for_bit(before):
    pipeline = build("tiny", device="cpu", attention="auto", **SPAN)
    assert pipeline.attention == "auto"
    for block in pipeline.transformer.blocks:
        assert block.attn1.processor.kernel is None and block.attn2.processor._attention_backend is None
    for (frames, latent), (want_frames, want_latent) in zip(_chunks(pipeline), before, strict=True):
        assert frames == want_frames and torch.equal(latent, want_latent)


@pytest.mark.parametrize("value", ["math", "flash"])
def test_math_and_cpu_flash_track_auto(before, value):
    pipeline = build("tiny", device="cpu", attention=value, **SPAN)
    for (_, got), (_, want) in zip(_chunks(pipeline), before, strict=True):
        assert got.dtype == want.dtype == torch.float32
        difference = (got - want).abs().max().item()
        assert difference <= TOLERANCE * want.abs().max().item(), difference


def test_math_differs_from_auto_somewhere_so_the_bit_for_bit_test_can_fail(before):
    pipeline = build("tiny", device="cpu", attention="math", **SPAN)
    assert any(not torch.equal(got, want) for (_, got), (_, want) in zip(_chunks(pipeline), before, strict=True))


def test_the_chosen_kernel_is_every_blocks_self_attentions_and_no_process_wide_switch():
    backend = _AttentionBackendRegistry.get_active_backend()[0]
    pipeline = build("tiny", device="cpu", attention="math", **SPAN)
    assert pipeline.attention == "math"
    for block in pipeline.transformer.blocks:
        assert isinstance(block.attn1.processor, CausalSelfAttnProcessor)
        assert isinstance(block.attn2.processor, WanAttnProcessor)
        assert block.attn1.processor.kernel is ATTENTION["math"]
        assert block.attn2.processor._attention_backend is None  # the small cross-attention: torch's choice
    assert _AttentionBackendRegistry.get_active_backend()[0] == backend  # diffusers' default untouched
    assert CausalSelfAttnProcessor.kernel is None and WanAttnProcessor._attention_backend is None


def test_a_kernel_in_use_switches_nothing_for_other_threads():
    """The kernels are called as operators, not under ``sdpa_kernel`` (whose flags
    are the whole process's): while one thread attends with ``math`` another's
    SDPA may still use every kernel."""
    seen = []
    original = torch.ops.aten._scaled_dot_product_attention_math

    class Watching:
        def __call__(self, *args, **kwargs):
            seen.append((torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled()))
            return original(*args, **kwargs)

    query = torch.randn(1, 8, 2, 12)
    key = value = torch.randn(1, 24, 2, 12)
    from rtvideo.workers.pipelines import attention_backend

    kernel = attention_backend.ATTENTION["math"]
    torch.ops.aten._scaled_dot_product_attention_math = Watching()
    try:
        out = attention_backend.attend(kernel, query, key, value)
    finally:
        torch.ops.aten._scaled_dot_product_attention_math = original
    assert seen == [(True, True)] and out.shape == query.shape


@pytest.mark.parametrize(("value", "kernel"), [("cudnn", "CUDNN_ATTENTION"), ("efficient", "EFFICIENT_ATTENTION")])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_only_kernels_are_refused_at_build_naming_option_value_reason_device(value, kernel, dtype):
    refusal = (
        rf"attention: {value} \(torch's {kernel} kernel, 2 heads of 12\) is refused by torch: "
        rf".*; this runs on cpu \({dtype}\)$"
    )
    with pytest.raises(ValueError, match=refusal):
        build("tiny", device="cpu", attention=value, dtype=dtype, **SPAN)


def test_the_probe_answers_as_the_build_does():
    cpu = torch.device("cpu")
    assert attention_refusal("auto", cpu, torch.float32) is None
    assert attention_refusal("math", cpu, torch.bfloat16) is None
    assert attention_refusal("flash", cpu, torch.float32) is None  # torch's CPU flash kernel, Wan2.1-1.3B's heads
    assert attention_refusal("cudnn", cpu, torch.bfloat16).startswith(
        "attention: cudnn (torch's CUDNN_ATTENTION kernel, 12 heads of 128) is refused by torch: "
    )


def test_an_unknown_value_is_refused_naming_the_known_ones():
    assert list(ATTENTION) == ["auto", "flash", "cudnn", "efficient", "math"]
    known = "attention must be one of auto, flash, cudnn, efficient, math"
    with pytest.raises(ValueError, match=f"{known}, got 'sdpa'"):
        build("tiny", device="cpu", attention="sdpa", **SPAN)
    with pytest.raises(ValueError, match=f"{known}, got None"):
        build("tiny", device="cpu", attention=None, **SPAN)


def test_math_under_the_captured_step_path_is_eager_math_bit_for_bit():
    eager = _chunks(build("tiny", device="cpu", attention="math", **SPAN))
    captured = build("tiny", device="cpu", attention="math", cuda_graphs="eager", **SPAN)
    got = _chunks(captured)
    assert captured.graph_figures()["replays"] > 0
    for (frames, latent), (want_frames, want_latent) in zip(got, eager, strict=True):
        assert frames == want_frames and torch.equal(latent, want_latent)
