"""FP8 linears for the causal Wan transformer (the pipeline option ``quantize: fp8``).

Worker process. The transformer blocks' linear layers (self- and
cross-attention projections, the feed-forward network) are swapped for
torchao's dynamic float8 ones: weights stored in ``float8_e4m3fn`` with a
scale per output row, each activation quantized per row as it comes, the
matrix product in FP8 on the tensor cores (``torch._scaled_mm``). What the
model keeps in higher precision stays there: the patch and condition
embeddings, the time embedder, the head, every norm and modulation (none of
them a block's ``Linear``), and any linear whose sides are not multiples of
16 (the FP8 kernels' tile).

FP8 matrix products need a GPU of compute capability 8.9 or newer (Ada,
Hopper, Blackwell): elsewhere the option is refused at start, naming the
device, as it is where torchao is not installed (it is part of the CUDA
lock only).
"""

from __future__ import annotations

import torch
from torch import nn

QUANTIZE = ("fp8",)  # the pipeline option quantize's values (None: off)
FP8_CAPABILITY = (8, 9)


def fp8_refusal(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> str | None:
    """Why FP8 linears cannot run on ``device`` for a model in ``dtype`` (None:
    they can). Per-row scales take bfloat16 weights and activations only."""
    if device.type != "cuda":
        return f"quantize fp8: FP8 matrix products need a GPU of compute capability 8.9 or newer; this runs on {device}"
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        return (
            f"quantize fp8: {name} has compute capability {capability[0]}.{capability[1]}; "
            "FP8 matrix products need 8.9 or newer (Ada, Hopper, Blackwell)"
        )
    if dtype != torch.bfloat16:
        return f"quantize fp8: FP8 linears with per-row scales need the model in bfloat16, not {str(dtype)[6:]}"
    try:
        import torchao  # noqa: F401
    except ImportError:
        return "quantize fp8: torchao is not installed (it comes with requirements-cuda.lock)"
    return None


def fp8_linears(transformer: nn.Module) -> list[str]:
    """The names of the linear layers FP8 would take: inside the transformer's
    blocks, with both sides multiples of 16."""
    return [
        name
        for name, module in transformer.named_modules()
        if name.startswith("blocks.")
        and isinstance(module, nn.Linear)
        and module.in_features % 16 == 0
        and module.out_features % 16 == 0
    ]


def quantize_fp8(transformer: nn.Module, device: torch.device, dtype: torch.dtype) -> int:
    """Swap ``fp8_linears`` of a model in ``dtype`` for dynamic float8 ones with
    per-row scales; ``ValueError`` saying why where it cannot run
    (``fp8_refusal``). Returns how many were swapped."""
    refusal = fp8_refusal(device, dtype)
    if refusal is not None:
        raise ValueError(refusal)
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

    chosen = set(fp8_linears(transformer))
    config = Float8DynamicActivationFloat8WeightConfig(granularity=PerRow(), set_inductor_config=False)
    quantize_(transformer, config, filter_fn=lambda module, name: name in chosen)
    return len(chosen)
