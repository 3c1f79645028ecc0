"""The causal Wan pipeline in bf16, on the CPU: the GPU's precision path
(casting, pinned fp32 modules, bf16 KV cache, bf16 VAE) runs and tracks fp32."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rtvideo.workers.pipelines.causal_wan import build, resolve_dtype
from tests.model.test_causal_wan import open_session, release, run_chunk


@pytest.fixture(scope="module")
def fp32():
    return build("tiny", device="cpu")


@pytest.fixture(scope="module")
def bf16():
    return build("tiny", device="cpu", dtype="bfloat16")


def test_auto_dtype_is_bf16_on_gpu_and_fp32_elsewhere():
    assert resolve_dtype(None, torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("fp32", torch.device("cuda")) == torch.float32
    with pytest.raises(ValueError, match="dtype must be auto, bfloat16 or float32, got 'float16'"):
        resolve_dtype("float16", torch.device("cpu"))
    with pytest.raises(ValueError, match="dtype"):
        build("tiny", device="cpu", vae_dtype="half")


def test_bf16_casts_the_weights_but_keeps_the_pinned_modules_in_fp32(bf16):
    for model in (bf16.transformer, bf16.text_encoder):
        pinned = set(model._keep_in_fp32_modules)
        assert pinned  # both classes pin some modules (norms, time embedder; T5's wo)
        for name, parameter in model.named_parameters():
            is_pinned = any(part in pinned for part in name.split("."))
            assert parameter.dtype == (torch.float32 if is_pinned else torch.bfloat16), name
    assert bf16.rope.freqs_cos.dtype in (torch.float32, torch.float64)  # RoPE tables stay full precision
    assert {p.dtype for p in bf16.vae.parameters()} == {torch.bfloat16}
    state = open_session(bf16, "pinned")
    assert state.kv.keys[0].dtype == torch.bfloat16
    release(bf16, state)


def test_bf16_frames_track_the_fp32_frames(fp32, bf16):
    a, b = open_session(fp32, "a", seed=4), open_session(bf16, "b", seed=4)
    for _ in range(3):
        out32, clean32 = run_chunk(fp32, a)
        out16, clean16 = run_chunk(bf16, b)
        assert (out16.num_frames, out16.width, out16.height) == (out32.num_frames, out32.width, out32.height)
        assert clean16.dtype == torch.bfloat16 and torch.isfinite(clean16.float()).all()
        scale = clean32.abs().max().item()
        assert (clean32 - clean16.float()).abs().max().item() <= 0.1 * scale
        pixels32 = np.frombuffer(out32.payload, np.uint8).astype(np.int16)
        pixels16 = np.frombuffer(out16.payload, np.uint8).astype(np.int16)
        assert np.abs(pixels32 - pixels16).mean() < 6.0  # of 255 levels
    release(fp32, a)
    release(bf16, b)


def test_a_bf16_transformer_can_decode_with_an_fp32_vae():
    pipeline = build("tiny", device="cpu", dtype="bfloat16", vae_dtype="float32")
    assert pipeline.dtype == torch.bfloat16 and {p.dtype for p in pipeline.vae.parameters()} == {torch.float32}
    state = open_session(pipeline, "mixed")
    out, _ = run_chunk(pipeline, state)
    assert out.num_frames == 9 and len(out.payload) == 9 * 64 * 64 * 3


def test_bf16_cached_forward_tracks_the_block_causal_forward(bf16):
    """The cache path and the masked full forward agree to bf16 precision."""
    torch.manual_seed(0)
    state = open_session(bf16, "cached")
    conditioning, shape = state.prompt.target, state.latent_shape
    chunk0, chunk1 = torch.randn(shape, dtype=torch.bfloat16), torch.randn(shape, dtype=torch.bfloat16)
    t = 937.5
    with torch.no_grad():
        bf16._run((state.kv,), chunk0, [0.0], conditioning, commit=True)
        out1 = bf16._run((state.kv,), chunk1, [t], conditioning)
        per_chunk = shape[2] * shape[3] * shape[4] // 4
        chunk_of = torch.arange(2 * per_chunk) // per_chunk
        bf16.context.mask = chunk_of[None, :] <= chunk_of[:, None]
        try:
            timesteps = torch.where(chunk_of == 0, 0.0, t)[None, :]
            full = bf16.transformer(
                torch.cat([chunk0, chunk1], dim=2),
                timesteps,
                encoder_hidden_states=conditioning,
                return_dict=False,
            )[0]
        finally:
            bf16.context.mask = None
    error = (full[:, :, 3:].float() - out1.float()).abs().max().item()
    assert error <= 0.05 * out1.float().abs().max().item()
    release(bf16, state)
