"""The causal Wan pipeline option ``attention``: which of torch's attention
kernels every block's self-attention (``CausalSelfAttnProcessor``) runs.

Worker process. The self-attention is where a chunk's attention costs: at
832x480 its ~4680 queries attend to ~37k cached keys in each block, while the
cross-attention reads 512 text tokens. Values:

- ``auto`` (the default): torch's ``scaled_dot_product_attention`` picks its
  kernel per call, through diffusers' dispatch as before: today's behaviour,
  bit for bit (nothing is set, nothing is probed);
- ``flash``, ``cudnn``, ``efficient``, ``math``: that one kernel, called
  directly (``KERNELS``: torch's ``aten._scaled_dot_product_*`` operators;
  the CPU's flash kernel is its own operator).

Why the operators and not ``torch.nn.attention.sdpa_kernel`` (which is what
diffusers' ``_native_flash`` etc. backends enter around each call): that
context manager sets torch's allowed-kernel flags for the whole process, not
the calling thread, so while a denoise step attended under it, a decode on
the decode stage's thread (the VAE's own attention, head dim 384) would be
held to the same kernel, refused by it, or computed by another kernel than
usual, depending on timing. Calling an operator changes no flag. The
cross-attention keeps torch's choice: it is small, and it is diffusers'
processor. A call with a mask (the block-causal reference of the tests, never
serving) also keeps torch's choice.

Refused at build, not mid-session (``attention_refusal``): one small
self-attention call (and one over the text's length of keys) runs through
the chosen kernel on the pipeline's device, in its dtype, with the model's
head count and head dim; where the operator refuses it (no such kernel on
this device, or not for this dtype or head dim) the build raises
``ValueError`` naming the option, the value, torch's reason and the device
and dtype. On this project's CPU the flash and math kernels run (fp32 and
bf16), the cuDNN and memory-efficient ones, CUDA kernels, are refused.

Under captured steps (``cuda_graphs: true``) nothing of a kernel is made
inside a capture: the flash, memory-efficient and math kernels keep no state
between calls; the cuDNN kernel builds an execution plan per shape, held per
thread, and takes a cuDNN handle made on the thread's first use, and
``CudaGraphCapture`` runs each function once, eagerly, on the same thread and
with the same shapes, before capturing it (``rtvideo.workers.pipelines.step_graphs``):
the plan and the handle exist by then.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""query, key, value ``[rows, heads, tokens, head_dim]`` → the attention's output, the query's shape."""


def _flash(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    if query.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value)[0]
    return torch.ops.aten._scaled_dot_product_flash_attention(query, key, value)[0]


def _cudnn(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten._scaled_dot_product_cudnn_attention(query, key, value, None, False)[0]


def _efficient(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten._scaled_dot_product_efficient_attention(query, key, value, None, False)[0]


def _math(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten._scaled_dot_product_attention_math(query, key, value)[0]


ATTENTION: dict[str, Kernel | None] = {
    "auto": None,
    "flash": _flash,
    "cudnn": _cudnn,
    "efficient": _efficient,
    "math": _math,
}
"""The option's values and the kernel each calls (None: torch's choice)."""


def attend(kernel: Kernel, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``kernel`` over query, key and value in diffusers' layout ``[rows, tokens,
    heads, head_dim]`` (viewed as ``[rows, heads, tokens, head_dim]``, no copy);
    the output in the query's layout."""
    return kernel(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)).transpose(1, 2)


_KERNELS = {
    "flash": "FLASH_ATTENTION",
    "cudnn": "CUDNN_ATTENTION",
    "efficient": "EFFICIENT_ATTENTION",
    "math": "MATH",
}  # torch's ``SDPBackend`` names, for the refusal's words

WAN_1_3B_HEADS = (12, 128, 512)
"""Wan2.1-1.3B's attention heads, head dim and text tokens: what the bench
asks about before any model is built (``rtvideo.bench.settings.refusal``)."""


def attention_kernel(value: object) -> Kernel | None:
    """The kernel of the option's ``value`` (None: ``auto``); ``ValueError`` naming the
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
    kernel = attention_kernel(value)
    if kernel is None:
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
                out = attend(kernel, query, key, value_)
                if out.shape != query.shape or not bool(torch.isfinite(out).all()):
                    raise RuntimeError(f"its output over {keys} keys was not finite or not the query's shape")
            if device.type == "cuda":
                torch.cuda.synchronize(device)
    except (RuntimeError, ValueError, NotImplementedError) as error:
        said = [" ".join(str(w.message).split()) for w in caught]
        reason = " ".join(str(error).split()).split(". ")[0].rstrip(".")  # torch's first sentence says it
        detail = f" ({'; '.join(dict.fromkeys(said))})" if said else ""
        return (
            f"attention: {value} (torch's {_KERNELS[value]} kernel, {heads} heads of {head_dim}) is refused "
            f"by torch: {reason}{detail}; this runs on {device} ({str(dtype).replace('torch.', '')})"
        )
    return None


def set_attention(model: torch.nn.Module, value: str, device: torch.device, dtype: torch.dtype, text_tokens: int):
    """The option ``attention``: probe ``value`` with ``model``'s heads on
    ``device`` in ``dtype`` (``ValueError``, torch's reason, where refused), then
    give its kernel to every block's self-attention processor (``kernel``).
    ``auto`` sets nothing: the processors keep torch's choice."""
    kernel = attention_kernel(value)
    if kernel is None:
        return
    config = model.config
    why = attention_refusal(value, device, dtype, config.num_attention_heads, config.attention_head_dim, text_tokens)
    if why is not None:
        raise ValueError(why)
    for block in model.blocks:
        block.attn1.processor.kernel = kernel
