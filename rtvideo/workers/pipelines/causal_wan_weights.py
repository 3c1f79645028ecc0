"""Where and in which dtype the causal Wan pipeline's models live.

Worker process. ``resolve_dtype`` turns the pipeline options ``dtype`` /
``vae_dtype`` into a torch dtype; ``cast`` moves a loaded model to its device
in that dtype, keeping in fp32 what the model's class pins there (diffusers'
rule), and on a CPU gives every tensor an aligned allocation of its own, so a
model loaded from a directory computes bit for bit as the same weights built
in memory (``own_aligned_memory``). No pipeline state: pure functions of the
model they are given.
"""

from __future__ import annotations

import torch

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32}


def resolve_dtype(name: str | None, device: torch.device, option: str = "dtype") -> torch.dtype:
    """``None`` or ``"auto"``: bf16 on a GPU, fp32 elsewhere; else ``bfloat16`` /
    ``float32`` (or ``bf16`` / ``fp32``). ``ValueError`` names anything else, as
    the pipeline option ``option``."""
    if name is None or name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if not isinstance(name, str) or name not in DTYPES:
        raise ValueError(f"{option} must be auto, bfloat16 or float32, got {name!r}")
    return DTYPES[name]


def cast(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """Move ``model`` to ``device`` in ``dtype``, keeping the modules its class pins
    to fp32 (RoPE tables, time embedder, norms) in fp32; on a CPU, every tensor
    then sits in an allocation of its own (``own_aligned_memory``)."""
    model = model.to(device)
    if dtype == torch.float32:
        model = model.float()
    else:
        to_dtype_keeping_pinned(model, dtype)
    if device.type == "cpu":
        own_aligned_memory(model)
    return model


def to_dtype_keeping_pinned(model: torch.nn.Module, dtype: torch.dtype) -> None:
    keep = set(getattr(model, "_keep_in_fp32_modules", None) or ())

    def pinned(name: str) -> bool:  # diffusers' rule: any dotted part of the full name
        return any(part in keep for part in name.split("."))

    for name, parameter in model.named_parameters():
        if not pinned(name):
            parameter.data = parameter.data.to(dtype)
    for module_name, module in model.named_modules():
        for tensor_name, tensor in list(module.named_buffers(recurse=False)):
            full = f"{module_name}.{tensor_name}" if module_name else tensor_name
            if tensor.is_floating_point() and "freqs" not in tensor_name and not pinned(full):
                module._buffers[tensor_name] = tensor.to(dtype)


_CPU_ALIGNMENT = 64  # bytes: what torch's CPU allocator gives every new tensor


def own_aligned_memory(model: torch.nn.Module) -> int:
    """Copy every CPU parameter and buffer of ``model`` that does not start on a
    64-byte boundary into fresh memory; returns how many were copied.

    ``from_pretrained`` (diffusers 0.42) leaves a loaded model's tensors as
    zero-copy views into the memory-mapped safetensors file, at the file's
    offsets, which are only 4- or 8-byte aligned. The CPU matrix-vector product
    of a one-row ``Linear`` (the timestep embedding: one row per batch row)
    sums in another order when its weight is misaligned, so the same weights
    loaded from a directory gave the timestep embedding, hence every block's
    modulation, a last-bit difference, and frames one grey level off the same
    weights built in memory. Owned, aligned copies compute exactly as a built
    model does. A tensor shared by several modules (tied weights) stays shared."""
    copied: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (original, copy); originals kept alive
    for module in model.modules():
        for store in (module._parameters, module._buffers):
            for name, tensor in store.items():
                if tensor is None or tensor.device.type != "cpu":
                    continue
                if id(tensor) in copied:
                    store[name] = copied[id(tensor)][1]
                elif tensor.data_ptr() % _CPU_ALIGNMENT:
                    if isinstance(tensor, torch.nn.Parameter):  # in place: every module holding it sees the copy
                        tensor.data = tensor.data.clone(memory_format=torch.preserve_format)
                        copied[id(tensor)] = (tensor, tensor)
                    else:
                        copied[id(tensor)] = (tensor, tensor.clone(memory_format=torch.preserve_format))
                        store[name] = copied[id(tensor)][1]
    return len(copied)
