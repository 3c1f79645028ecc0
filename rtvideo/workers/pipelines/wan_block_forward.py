"""One Wan transformer block's forward, ours, and its elementwise work fused
(the pipeline option ``fused_elementwise``).

Worker process. ``block_forward(block, hidden, text, modulation, rotary)``
computes what diffusers' ``WanTransformerBlock.forward`` computes, with the
same operations in the same order, on the block's own modules: bit for bit
the same output (tested, fp32 and bf16), for Wan 2.1's modulation (one
``[rows, 6, inner_dim]`` projection per row: what the pipeline runs) and for
one per token (``[rows, tokens, 6, inner_dim]``: what the model's own
forward takes for a timestep per token, as the block-causal reference in
the tests does).
``install_block_forward`` makes it each block's forward (the pipeline does,
for its transformer), so ``wan_blocks.run_blocks``, which calls each block
as a module (hooks and ``compile`` as ever), runs it.

Around the attentions and the feed-forward a block does its elementwise
work in fp32 on a bf16 model: norm, modulate and cast back; add the gated
residual and cast back; and so on, about 25 kernels a block, each a pass
over the ``[rows, tokens, inner_dim]`` activations. Here each group is a
small named function (``ElementwiseOps``):

- ``modulate``: ``(norm(x.float()) * (1 + scale) + shift).type_as(x)``
  (before the self-attention and, fused with the residual before it, the
  feed-forward);
- ``gated_residual``: ``(x.float() + y * gate).type_as(x)`` (after
  the self-attention, fused with the cross-attention's ``norm_cast``, and
  after the feed-forward);
- ``norm_cast``: ``norm(x.float()).type_as(x)`` (the cross-attention's
  affine norm, or none: ``cross_attn_norm`` false);
- ``residual``: ``x + y`` (after the cross-attention).

Inside the self-attention, the queries and keys are rotated (RoPE,
``rope_into``): about 8 kernels each time, over fp32 temporaries of the
``[rows, tokens, heads, head_dim]`` queries or keys, for each forward's
queries and keys and once a chunk for the keys a session's cache holds
(``wan_attention``'s processor and ``RopedKeys`` call ``ElementwiseOps.rope``).

``EAGER`` runs them as written (the reference). ``fused_elementwise: true``
(``elementwise_ops_for``) runs ``fused_ops()``: each of the four groups
(``modulate``; ``gated_residual_norm``; ``residual_modulate``;
``gated_residual``) and the rotation through ``torch.compile(fullgraph=True, dynamic=None)``
with inductor, as a rule one kernel a group, on a GPU (Triton) and on a CPU
(C++, built with the machine's C++ compiler; refused where there is none).
The math inside stays the reference's: fp32 where it computes in fp32, and
every cast to the model's dtype that the reference makes is made
(``emulate_precision_casts``: Triton code would otherwise keep a fused
``x + y`` of two bf16 tensors, and a ``type_as`` followed by ``float()``, in
fp32 where the reference rounds). What differs is the norm's reduction
order (inductor's own reduction against ATen's layer norm kernel): an fp32
ulp or so per norm, so not bit for bit; the group without a norm,
``gated_residual``, and the rotation came out bit for bit on the CPU
(tested on the tiny preset, fp32), and on a GPU may differ by a fused
multiply-add's rounding.
Each compiled call costs its guards and wrapper (tens of microseconds on a
CPU), so on tiny activations the groups are slower fused than eager; the
saving is at real sizes, where each group is memory-bound.

Shapes: before each call the rows and the tokens of every ``[rows, tokens,
inner_dim]`` argument (and the rows of each ``[rows, 1, inner_dim]``
modulation) are marked dynamic (``torch._dynamo.maybe_mark_dynamic``), so a
group's first compile already serves every session size and batch width;
the width ``inner_dim``, which never changes, stays fixed, so the norm is a
reduction of a known width. Torch specialises a dimension of size 1, so one
row and several rows are two compiles. So a pipeline compiles each group
twice at most, both at warm-up (``max_batch_rows`` rows, then one row),
and the rotation once (``rope_any_size``: row by row, as [tokens, heads,
head_dim], whatever the store a view is of), and never mid-serving: a session of a new size, or a batch of a new width,
would otherwise stall every session of the worker for a compile (seconds
on a GPU).

Under captured steps (``cuda_graphs: true``) nothing is compiled during a
capture: ``StepGraphs`` captures a key on its second use, and its first use
ran the same forward uncaptured (through the same compiled groups) with the
same shapes, dtypes and strides, under ``no_grad`` as every forward, so
every group it calls was compiled for those inputs then; and
``CudaGraphCapture`` runs the function once more on its side stream before
capturing. The guards that passed on those runs pass during the capture, so
it records compiled kernels and compiles none. The worker's warm-up runs
the default size's captures, so the groups are compiled before the first
session (``tests/model/test_fused_elementwise.py`` runs captured steps on
the CPU's eager replay and checks no graph is compiled inside a capture or
a replay; ``tests/gpu/test_fused_elementwise_on_gpu.py`` the CUDA capture).

The ``compile`` option compiles each whole block's call (``block.compile()``,
through this forward: one graph shared by every block); it fuses the same
elementwise work inside each compiled piece, so ``compile`` and
``fused_elementwise`` together are refused (``elementwise_ops_for``).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial, wraps
from types import MethodType

import torch
import torch.nn.functional as F
from diffusers.models.transformers.transformer_wan import WanTransformerBlock
from torch import nn

Tensor = torch.Tensor


def _norm(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float) -> Tensor:
    """diffusers' ``FP32LayerNorm`` over the last dimension of ``x`` (fp32 in, fp32 out)."""
    return F.layer_norm(
        x.float(),
        x.shape[-1:],
        weight.float() if weight is not None else None,
        bias.float() if bias is not None else None,
        eps,
    )


def modulate(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, scale: Tensor, shift: Tensor) -> Tensor:
    """``(norm(x.float()) * (1 + scale) + shift).type_as(x)``: a modulated norm, cast back."""
    return (_norm(x.float(), weight, bias, eps) * (1 + scale) + shift).type_as(x)


def gated_residual(x: Tensor, y: Tensor, gate: Tensor) -> Tensor:
    """``(x.float() + y * gate).type_as(x)``: ``y`` added to ``x``, gated, in fp32 (``gate`` is fp32, so
    ``y * gate`` is), cast back. The reference writes ``ff_output.float() * gate`` after the feed-forward:
    the same bits, as promotion converts ``y`` exactly before multiplying."""
    return (x.float() + y * gate).type_as(x)


def norm_cast(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float | None) -> Tensor:
    """``norm(x.float()).type_as(x)``; ``eps`` None: no norm (``nn.Identity``), ``x.float().type_as(x)``."""
    if eps is None:
        return x.float().type_as(x)
    return _norm(x.float(), weight, bias, eps).type_as(x)


def residual(x: Tensor, y: Tensor) -> Tensor:
    """``x + y`` in the tensors' dtype."""
    return x + y


def gated_residual_norm(
    x: Tensor, y: Tensor, gate: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float | None
) -> tuple[Tensor, Tensor]:
    """``gated_residual`` then ``norm_cast`` of its result: (the new ``x``, its norm)."""
    x = gated_residual(x, y, gate)
    return x, norm_cast(x, weight, bias, eps)


def residual_modulate(
    x: Tensor, y: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, scale: Tensor, shift: Tensor
) -> tuple[Tensor, Tensor]:
    """``residual`` then ``modulate`` of its result: (the new ``x``, its modulated norm)."""
    x = residual(x, y)
    return x, modulate(x, weight, bias, eps, scale, shift)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor, out: Tensor | None = None) -> Tensor:
    """Rotate interleaved pairs of ``x`` [batch, tokens, heads, head_dim] (Wan's
    convention, diffusers' ``WanAttnProcessor``'s rotation): ``cos`` / ``sin``
    are [1 or batch, tokens, 1, head_dim], in fp32, so the products and sums
    are fp32, rounded once to ``x``'s dtype where they are stored. Into ``out``
    (``x``'s shape and dtype) when given, else a new tensor: the same values
    either way. The processors call ``ElementwiseOps.rope``, ``rope_into``,
    which always names ``out``: one compiled graph for every call."""
    if out is None:
        out = torch.empty_like(x)
    return rope_into(x, cos, sin, out)


def rope_into(x: Tensor, cos: Tensor, sin: Tensor, out: Tensor) -> Tensor:
    """``apply_rope`` into ``out``; returns it."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[..., 0::2], sin[..., 1::2]
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out


@dataclass(frozen=True)
class ElementwiseOps:
    """The four elementwise groups of a block's forward, in the order it calls
    them, and the rotation its self-attention gives the queries and keys (the
    causal processor's, ``wan_attention``: ``rope_into``)."""

    modulate: Callable[..., Tensor]
    gated_residual_norm: Callable[..., tuple[Tensor, Tensor]]
    residual_modulate: Callable[..., tuple[Tensor, Tensor]]
    gated_residual: Callable[..., Tensor]
    rope: Callable[..., Tensor]


EAGER = ElementwiseOps(modulate, gated_residual_norm, residual_modulate, gated_residual, rope_into)


def _norm_args(norm: nn.Module) -> tuple[Tensor | None, Tensor | None, float | None]:
    """A block norm's (weight, bias, eps): an ``FP32LayerNorm``'s, or (None, None, None) for ``nn.Identity``."""
    if isinstance(norm, nn.Identity):
        return None, None, None
    return norm.weight, norm.bias, norm.eps


def block_forward(
    block: WanTransformerBlock,
    hidden: Tensor,
    text: Tensor,
    modulation: Tensor,
    rotary: tuple[Tensor, Tensor],
    ops: ElementwiseOps = EAGER,
) -> Tensor:
    """``block``'s forward over ``hidden`` [rows, tokens, inner_dim], as
    ``WanTransformerBlock.forward(hidden, text, modulation, rotary)``, with a
    ``[rows, 6, inner_dim]`` modulation or a ``[rows, tokens, 6, inner_dim]``
    one; its elementwise groups by ``ops``."""
    if modulation.ndim == 4:  # [rows, tokens, 6, inner_dim]: a timestep per token
        parts = (block.scale_shift_table.unsqueeze(0) + modulation.float()).chunk(6, dim=2)
        shift_msa, scale_msa, gate_msa, c_shift_msa, c_scale_msa, c_gate_msa = (part.squeeze(2) for part in parts)
    else:  # [rows, 6, inner_dim]: a timestep per row (Wan 2.1)
        shift_msa, scale_msa, gate_msa, c_shift_msa, c_scale_msa, c_gate_msa = (
            block.scale_shift_table + modulation.float()
        ).chunk(6, dim=1)

    # 1. Self-attention
    norm1, norm2, norm3 = _norm_args(block.norm1), _norm_args(block.norm2), _norm_args(block.norm3)
    normed = ops.modulate(hidden, *norm1, scale_msa, shift_msa)
    attn_output = block.attn1(normed, None, None, rotary)
    hidden, normed = ops.gated_residual_norm(hidden, attn_output, gate_msa, *norm2)

    # 2. Cross-attention
    attn_output = block.attn2(normed, text, None, None)
    hidden, normed = ops.residual_modulate(hidden, attn_output, *norm3, c_scale_msa, c_shift_msa)

    # 3. Feed-forward
    ff_output = block.ffn(normed)
    return ops.gated_residual(hidden, ff_output, c_gate_msa)


# -- the option ---------------------------------------------------------------------

# Inductor's options for the fused groups: keep every cast to bf16/fp16 the reference makes.
_INDUCTOR_OPTIONS = {"emulate_precision_casts": True}
_fused: dict[str, ElementwiseOps] = {}  # by backend: one compiled set a process (torch caches by code anyway)


def fused_ops(backend: str = "inductor") -> ElementwiseOps:
    """``EAGER``'s groups, each through ``torch.compile(fullgraph=True,
    dynamic=None)`` with ``backend`` (inductor: one fused kernel a group;
    ``aot_eager``: the same tracing without code generation, for checks).
    Compiled lazily, at each group's first call."""
    if backend not in _fused:
        options = _INDUCTOR_OPTIONS if backend == "inductor" else None

        def compiled(function: Callable) -> Callable:
            return torch.compile(function, fullgraph=True, dynamic=None, backend=backend, options=options)

        groups = {name: any_size(compiled(getattr(EAGER, name))) for name in EAGER.__dataclass_fields__}
        groups["rope"] = rope_any_size(compiled(rope_into))
        _fused[backend] = ElementwiseOps(**groups)
    return _fused[backend]


def any_size(compiled: Callable) -> Callable:
    """``compiled`` (a ``torch.compile``d group), called with the rows and the
    tokens of its 3-D tensor arguments marked dynamic: its first compile
    serves any session size and batch width (the module's docstring)."""

    @wraps(compiled)
    def call(*args: object) -> object:
        for arg in args:
            if isinstance(arg, Tensor) and arg.ndim == 3:
                mark_any_size(arg, 0, 1)
        return compiled(*args)

    return call


def rope_any_size(compiled: Callable) -> Callable:
    """``compiled`` (a ``torch.compile``d ``rope_into``), called row by row on
    [tokens, heads, head_dim] views, tokens marked dynamic, so that its first
    compile serves every call: a session's queries and keys, its held keys and
    the tail of its key buffer (views of stores of other lengths, at other
    offsets: other row strides, each a compile as 4-D tensors), and a batch
    of any width with one RoPE table or one a row."""

    @wraps(compiled)
    def call(x: Tensor, cos: Tensor, sin: Tensor, out: Tensor) -> Tensor:
        for row in range(x.shape[0]):
            table = row if cos.shape[0] > 1 else 0
            parts = (x[row], cos[table], sin[table], out[row])
            for part in parts:
                mark_any_size(part, 0)
            compiled(*parts)
        return out

    return call


def mark_any_size(tensor: Tensor, *dims: int) -> None:
    """Mark ``dims`` of ``tensor`` dynamic for ``torch.compile``d code it is
    passed to (those of size 1 stay specialised, as torch does anyway)."""
    for dim in dims:
        if tensor.shape[dim] > 1:
            torch._dynamo.maybe_mark_dynamic(tensor, dim)


def fused_refusal(device: torch.device) -> str | None:
    """Why inductor cannot make ``fused_elementwise``'s kernels on ``device`` (None: it can)."""
    if device.type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            return f"fused_elementwise: inductor's GPU kernels need Triton, not installed; this runs on {device}"
        return None
    if device.type == "cpu":
        from torch._inductor import config

        cxx = config.cpp.cxx if isinstance(config.cpp.cxx, (list, tuple)) else (config.cpp.cxx,)
        compilers = [name for name in cxx if name]
        if not any(shutil.which(name) for name in compilers):
            wanted = " or ".join(compilers) or "g++"
            return (
                f"fused_elementwise: inductor's CPU kernels need a C++ compiler ({wanted}), none found; "
                f"this runs on {device}"
            )
        return None
    return f"fused_elementwise: fused kernels are made for a GPU (cuda) or a CPU; this runs on {device}"


def elementwise_ops_for(fused_elementwise: bool, compile: bool, device: torch.device) -> ElementwiseOps:
    """The pipeline option ``fused_elementwise``: ``False``, ``EAGER``; ``True``,
    ``fused_ops()``, refused (``ValueError`` naming the option and the device)
    where ``fused_refusal`` says why, and beside ``compile``, which compiles
    the whole block and so fuses the same work."""
    if fused_elementwise not in (True, False):
        raise ValueError(f"fused_elementwise must be true or false, got {fused_elementwise!r}")
    if not fused_elementwise:
        return EAGER
    if compile:
        raise ValueError(
            "fused_elementwise and compile: compile already runs each whole block through torch.compile, "
            "which fuses the same elementwise work; choose one"
        )
    refusal = fused_refusal(device)
    if refusal is not None:
        raise ValueError(refusal)
    return fused_ops()


def install_block_forward(model: nn.Module, ops: ElementwiseOps = EAGER) -> None:
    """Make ``block_forward`` with ``ops`` the forward of every block of ``model``
    (a ``WanTransformer3DModel``): calling a block, as ``run_blocks`` and the
    model's own forward do, then runs it, hooks and ``compile`` included. Set
    on each block object (its class keeps diffusers' forward)."""
    forward = block_forward if ops is EAGER else partial(block_forward, ops=ops)
    for block in model.blocks:
        if not isinstance(block, WanTransformerBlock):
            raise ValueError(f"install_block_forward: a WanTransformerBlock's forward, not {type(block).__name__}'s")
        block.forward = MethodType(forward, block)
