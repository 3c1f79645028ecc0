"""What a CUDA graph cannot capture, checked on any device before a capture.

Worker process. A CUDA graph records the kernels a function launches; it
cannot record the host waiting on the device or the device waiting on the
host. A captured step that reads a value back (``.item()``, ``bool(t)``, an
``if`` on a tensor), computes an output whose size depends on the data
(``nonzero``, a boolean mask), copies host memory to the device or draws
random numbers in the middle of the forward fails on a GPU with a CUDA error
that names no line of ours, or, worse, replays the value it saw once.

``CaptureRules`` is a ``TorchDispatchMode`` that sees every operator a
function runs and raises ``CaptureBreak`` naming the first one that breaks
those rules. ``rehearse(function)`` runs a function under it:

- on a CPU (``EagerReplay``, ``cuda_graphs: "eager"``) every captured step is
  rehearsed once when its capture would be made, so the CPU tests of the
  captured steps fail where the GPU's capture would;
- on a GPU (``CudaGraphCapture``) the warm-up run before a capture is the
  rehearsal, so a step that cannot be captured is named before the capture
  begins (and ``StepGraphs`` then runs every step eagerly).

Data-dependent sizes and reads back are caught everywhere; a copy from the
host to the device only where the device is not the host (a CPU has none),
0-d tensors included. ``torch.tensor(data, device=...)`` copies below the
dispatcher, so ``HostData``, a function mode, names that one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

T = TypeVar("T")
aten = torch.ops.aten

BREAKERS: dict[Any, str] = {
    aten._local_scalar_dense: "reads a value back to the host (.item(), bool(), int(), float() of a tensor)",
    aten.is_nonzero: "reads a value back to the host (bool() of a tensor)",
    aten.equal: "reads a value back to the host (torch.equal)",
    aten.nonzero: "has an output whose size depends on the data",
    aten.masked_select: "has an output whose size depends on the data (a boolean mask)",
    aten._unique2: "has an output whose size depends on the data",
    aten.unique_dim: "has an output whose size depends on the data",
    aten.unique_consecutive: "has an output whose size depends on the data",
}
"""Operators no capture can hold, by overload packet, with why."""

COPIES = frozenset({aten._to_copy, aten.copy_, aten._copy_from})
INDEXING = frozenset({aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_})
MASKS = (torch.bool, torch.uint8)


class CaptureBreak(RuntimeError):
    """A captured step runs an operator a CUDA graph cannot capture; the
    message names it and why."""


def _devices(value: Any) -> set[torch.device]:
    if isinstance(value, torch.Tensor):
        return {value.device}
    if isinstance(value, (list, tuple)):
        return set().union(*(_devices(item) for item in value)) if value else set()
    return set()


def _data_sized(func: Any, args: tuple, kwargs: dict) -> str | None:
    """Why an indexing or repeat has an output whose size depends on the data:
    a boolean mask (``x[mask]``, ``x[mask] = v``) or ``repeat_interleave`` by a
    tensor without ``output_size``; None: neither."""
    if func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:  # (repeats, *, output_size)
        return "repeats by a tensor without output_size: its output's size depends on the data"
    if func.overloadpacket in INDEXING and len(args) > 1:
        if any(isinstance(index, torch.Tensor) and index.dtype in MASKS for index in args[1] or ()):
            return "indexes with a boolean mask: its output's size depends on the data"
    return None


def _draws(func: Any, args: tuple, kwargs: dict) -> bool:
    """A seeded operator that draws here: not an attention kernel with no
    dropout (``dropout_p`` 0), nor a dropout outside training (``train`` false)."""
    if torch.Tag.nondeterministic_seeded not in func.tags:
        return False
    schema = func._schema.arguments
    defaults = {argument.name: argument.default_value for argument in schema if argument.has_default_value()}
    bound = {**defaults, **dict(zip([argument.name for argument in schema], args, strict=False)), **kwargs}
    if "dropout_p" in bound:
        return bound["dropout_p"] > 0
    return bound.get("train", True) is not False


def _copies_from_the_host(func: Any, args: tuple, kwargs: dict, out: Any) -> bool:
    """A copy whose source is a host tensor and whose result is on a device.
    A 0-d one too (``torch.tensor(x, device=...)``, ``.to(device)``): CUDA
    refuses that capture as well (torch issue 168991). A 0-d host tensor
    passed to an operator beside device tensors (``y * torch.tensor(0.5)``)
    is no copy: the kernel takes it as a scalar, and no copy is dispatched."""
    if func.overloadpacket not in COPIES:
        return False
    sources = [a for a in args if isinstance(a, torch.Tensor) and a.device.type == "cpu"]
    return bool(sources) and any(device.type != "cpu" for device in _devices(out))


class CaptureRules(TorchDispatchMode):
    """Raise ``CaptureBreak`` at the first operator a CUDA graph cannot capture.
    ``host_waits_only``: only those that make the host wait on the device (a read
    back, a data-dependent size; random numbers and copies in pass): the rules of
    an eager chunk that keeps a GPU busy (``tests/model/test_capture_rules.py``)."""

    def __init__(self, host_waits_only: bool = False) -> None:
        super().__init__()
        self.host_waits_only = host_waits_only

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        why = BREAKERS.get(func.overloadpacket)
        if why is None:
            why = _data_sized(func, args, kwargs)
        if self.host_waits_only:
            if why is not None:
                raise CaptureBreak(f"{func} {why}: the host waits on the device there")
            return func(*args, **kwargs)
        if why is None and _draws(func, args, kwargs):
            why = "draws random numbers (a replay would draw the captured ones again)"
        if why is not None:
            raise CaptureBreak(f"{func} {why}: a CUDA graph cannot capture it")
        out = func(*args, **kwargs)
        if _copies_from_the_host(func, args, kwargs, out):
            raise CaptureBreak(f"{func} copies host memory to the device: a CUDA graph cannot capture it")
        return out


MAKERS = frozenset({torch.tensor, torch.as_tensor, torch.asarray})
"""Functions that make a tensor from data: given host data and a device, they
copy it there below the dispatcher, where ``CaptureRules`` cannot see it."""


def _made_from_the_host(func: Any, args: tuple, kwargs: dict) -> bool:
    """``torch.tensor`` / ``as_tensor`` / ``asarray`` of host data (a number, a
    list, a host tensor) onto a device, or a device tensor's ``new_tensor`` of
    it: a copy from the host. Data already on that device is no such copy."""
    if func is torch.Tensor.new_tensor:  # (self, data): on self's device unless told
        device, data = kwargs.get("device", args[0].device), args[1] if len(args) > 1 else kwargs.get("data")
    elif func in MAKERS:  # (data, *, device): ``with torch.device(...)`` passes its device as the keyword
        device, data = kwargs.get("device"), args[0] if args else kwargs.get("data", kwargs.get("obj"))
    else:
        return False
    if device is None or torch.device(device).type == "cpu":
        return False
    return not (isinstance(data, torch.Tensor) and data.device.type != "cpu")


class HostData(TorchFunctionMode):
    """Raise ``CaptureBreak`` where a tensor is made on a device from host data
    (``torch.tensor(x, device=...)``): its copy happens below the dispatcher, so
    ``CaptureRules`` never sees it, and CUDA refuses it in a capture."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _made_from_the_host(func, args, kwargs):
            name = getattr(func, "__name__", str(func))
            raise CaptureBreak(f"torch.{name}(...) copies host data to a device: a CUDA graph cannot capture it")
        return func(*args, **kwargs)


def rehearse(function: Callable[[], T]) -> T:
    """``function()`` under ``CaptureRules`` and ``HostData``: its result, or ``CaptureBreak``.
    Compiled code (``fused_elementwise``, ``compile``) runs as its Python source
    (``torch.compiler.set_stance("force_eager")``): ``torch.compile`` cannot run
    under a dispatch mode, and a try would mark the compiled functions skipped
    for good. The operators checked are the same ones compiled; the compiled
    kernels add no read back of their own."""
    with torch.compiler.set_stance("force_eager"), HostData(), CaptureRules():
        return function()
