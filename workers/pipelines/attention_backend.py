"""The causal Wan pipeline option ``attention``: which of torch's attention
kernels every block's self-attention (``CausalSelfAttnProcessor``) and
cross-attention (diffusers' ``WanAttnProcessor``) runs.

Worker process. Both processors call diffusers' ``dispatch_attention_fn`` with
their ``_attention_backend``; this sets it on each block's ``attn1`` and
``attn2`` processor (not through ``set_attention_backend``, which would also
change diffusers' process-wide default, every other model's in the process):

- ``auto`` (the default): None, as diffusers leaves it, so torch's
  ``scaled_dot_product_attention`` picks its kernel per call: today's
  behaviour, bit for bit (nothing is set, nothing is probed);
- ``flash``, ``cudnn``, ``efficient``, ``math``: diffusers' ``_native_flash``,
  ``_native_cudnn``, ``_native_efficient``, ``_native_math``, each torch's
  SDPA restricted to that one kernel (``torch.nn.attention.sdpa_kernel``).

Refused at build, not mid-session (``attention_refusal``): one tiny attention
call is run through the chosen backend on the pipeline's device, in its dtype,
with the model's head count and head dim, shaped as a self-attention over a
longer key span and as a cross-attention over the text's tokens; where torch
refuses it (no such kernel on this device, or not for this dtype or head dim)
the build raises ``ValueError`` naming the option, the value, torch's reason
(its error and the warnings that say why each kernel was passed over) and the
device and dtype. On this project's CPU torch's flash kernel runs (fp32 and
bf16) while the cuDNN and memory-efficient ones, CUDA kernels, are refused.

Under captured steps (``cuda_graphs: true``) nothing of a backend is made
inside a capture: the restriction is a Python-side switch of the dispatcher's
flags, entered and left around each call, which a capture does not see; the
flash, memory-efficient and math kernels keep no state between calls; the
cuDNN kernel builds an execution plan per shape, held per thread, and takes
a cuDNN handle made on the thread's first use, and ``CudaGraphCapture`` runs
each function once, eagerly, on the same thread and with the same shapes,
before capturing it (``workers.pipelines.step_graphs``): the plan and the
handle exist by then. The build's probe does not count on that (a worker may
step on another thread than it was built on).
"""

from __future__ import annotations

import warnings

import torch
from diffusers.models.attention_dispatch import AttentionBackendName, dispatch_attention_fn

ATTENTION: dict[str, AttentionBackendName | None] = {
    "auto": None,
    "flash": AttentionBackendName._NATIVE_FLASH,
    "cudnn": AttentionBackendName._NATIVE_CUDNN,
    "efficient": AttentionBackendName._NATIVE_EFFICIENT,
    "math": AttentionBackendName._NATIVE_MATH,
}
"""The option's values and the diffusers backend each stands for."""

_KERNELS = {
    "flash": "FLASH_ATTENTION",
    "cudnn": "CUDNN_ATTENTION",
    "efficient": "EFFICIENT_ATTENTION",
    "math": "MATH",
}  # torch's ``SDPBackend`` names, for the refusal's words

WAN_1_3B_HEADS = (12, 128, 512)
"""Wan2.1-1.3B's attention heads, head dim and text tokens: what the bench
asks about before any model is built (``bench.settings.refusal``)."""


def attention_backend(value: object) -> AttentionBackendName | None:
    """The diffusers backend of the option's ``value``; ``ValueError`` naming the
    known values for any other."""
    if not isinstance(value, str) or value not in ATTENTION:
        raise ValueError(f"attention must be one of {', '.join(ATTENTION)}, got {value!r}")
    return ATTENTION[value]


def attention_refusal(
    value: str,
    device: torch.device,
    dtype: torch.dtype,
    heads: int = WAN_1_3B_HEADS[0],
    head_dim: int = WAN_1_3B_HEADS[1],
    text_tokens: int = WAN_1_3B_HEADS[2],
) -> str | None:
    """Why torch will not run ``attention: value`` on ``device`` in ``dtype``
    for ``heads`` heads of ``head_dim`` (None: it runs, or ``auto``, torch's
    own choice, which always runs). One small self-attention call (8 queries
    over 24 keys) and one cross-attention call (8 queries over
    ``text_tokens`` keys) through the backend; ``ValueError`` for an unknown
    value."""
    backend = attention_backend(value)
    if backend is None:
        return None
    device = torch.device(device)
    generator = torch.Generator(device="cpu").manual_seed(0)

    def draw(tokens: int) -> torch.Tensor:
        return torch.randn(1, tokens, heads, head_dim, generator=generator).to(device=device, dtype=dtype)

    query = draw(8)
    said: list[str] = []
    try:
        with warnings.catch_warnings(record=True) as caught, torch.no_grad():
            warnings.simplefilter("always")
            for keys in (24, text_tokens):
                key, value_ = draw(keys), draw(keys)
                out = dispatch_attention_fn(query, key, value_, backend=backend)
                if out.shape != query.shape or not bool(torch.isfinite(out).all()):
                    raise RuntimeError(f"its output over {keys} keys was not finite or not the query's shape")
            if device.type == "cuda":
                torch.cuda.synchronize(device)
    except (RuntimeError, ValueError, NotImplementedError) as error:
        said = [" ".join(str(w.message).split()) for w in caught]
        reason = " ".join(str(error).split()).rstrip(".")
        detail = f" ({'; '.join(dict.fromkeys(said))})" if said else ""
        return (
            f"attention: {value} (torch's {_KERNELS[value]} kernel, {heads} heads of {head_dim}) is refused "
            f"by torch: {reason}{detail}; this runs on {device} ({str(dtype).replace('torch.', '')})"
        )
    return None


def set_attention(model: torch.nn.Module, value: str, device: torch.device, dtype: torch.dtype, text_tokens: int):
    """The option ``attention``: probe ``value`` with ``model``'s heads on
    ``device`` in ``dtype`` (``ValueError``, torch's reason, where refused), then
    set its backend on every block's ``attn1`` and ``attn2`` processor. ``auto``
    sets nothing: the processors keep diffusers' None."""
    backend = attention_backend(value)
    if backend is None:
        return
    config = model.config
    why = attention_refusal(value, device, dtype, config.num_attention_heads, config.attention_head_dim, text_tokens)
    if why is not None:
        raise ValueError(why)
    for block in model.blocks:
        for attention in (block.attn1, block.attn2):
            attention.processor._attention_backend = backend
