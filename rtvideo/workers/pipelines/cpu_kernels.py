"""Faster CPU kernels for the Wan VAE's decoder, computing the same functions.

Worker process. ``use_fast_cpu_kernels`` swaps a VAE's modules, in place and
weights kept, for the subclasses here. On a GPU, or in a dtype other than
fp32, they run as the modules they replace.

- **RMS norms** become ``FastRMSNorm``, ``x * rsqrt(sum(x^2))`` instead of
  ``F.normalize``, whose channel-dim reduction was half the tiny preset's
  decode time. The scale is folded into the per-position factor, and a bias of
  zero is not added, so two passes over the features are left instead of four.
- **Convolutions**: causal 3-D ones become ``OneDnnCausalConv3d``, and 2-D
  ones (the up-samplers' and the attention's) ``OneDnnConv2d``. On a CPU in
  fp32 they call oneDNN's convolution directly. Torch's backend heuristic
  sends batch-1 inputs with few channels (all of the tiny VAE's) to its
  unvectorised ``slow_conv3d`` / ``slow_conv2d``, which is about 9x slower and
  rounds differently by batch size. oneDNN's convolution computes each batch
  row as it computes it alone.
  - The causal convolution's spatial zero padding is the convolution's own,
    not a padded copy of its input. The time padding (the cache, or zeros)
    is still a copy.
- **Narrow convolutions over several rows.** A convolution whose channels are
  fewer than ``NARROW`` wastes most of oneDNN's vector lanes when it runs
  over a batch. Measured with the tiny preset's 4-channel 3x3x3 convolution
  at 64x64, one thread: 0.6 ms for one row, 3.2 ms for four.
  - The rows can instead go into the channels of one row, as a grouped
    convolution of one group per row (``_grouped``): 1.6 ms for the same four.
  - Which is faster, and whether the grouped kernel gives the very same bits
    as the batch, depends on the shape and the CPU.
  - So the module decides per input shape, the first time it sees one
    (``_RowGrouping``), and keeps its answer:
    - it runs both forms, and uses the grouped form only if its output is
      bit for bit the batched one;
    - then it times both (best of two after a warm call) and keeps the faster.
  - Either way the frames are the same bits; only the time differs.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d, WanRMS_norm

NARROW = 16
"""Channels below which a convolution over several rows may run grouped (oneDNN
blocks channels by 16 on AVX-512, by 8 on AVX2)."""

_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch, "mkldnn_convolution")


class FastRMSNorm(WanRMS_norm):
    """``WanRMS_norm`` with the normalisation written as a sum of squares and an
    rsqrt (in fp32 for half-precision inputs, as the original does); same
    parameters, same result to float rounding."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        work = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        squares = work.square().sum(dim=1 if self.channel_first else -1, keepdim=True)
        factor = torch.rsqrt(squares.clamp_min(1e-24)) * self.scale  # F.normalize's eps is 1e-12
        scaled = (work * factor).to(x.dtype) * self.gamma
        if isinstance(self.bias, float) and self.bias == 0.0:  # no bias parameter: nothing to add
            return scaled
        return scaled + self.bias


def _on_onednn(module: torch.nn.Module, x: torch.Tensor) -> bool:
    return _ONEDNN and x.device.type == "cpu" and x.dtype == torch.float32 and module.padding_mode == "zeros"


class _RowGrouping:
    """Per convolution module: for each input shape it has seen over several
    rows, whether its rows run as one grouped convolution (see the module
    docstring). Each decision is made once, on the first input of that shape;
    the grouped weights are kept per row count and rebuilt when the module's
    weights change."""

    def __init__(self) -> None:
        self.grouped: dict[tuple, bool] = {}
        self._weights: dict[int, tuple[int, torch.Tensor, torch.Tensor | None]] = {}

    def weights(self, conv: torch.nn.Module, rows: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        version = conv.weight._version + (conv.bias._version if conv.bias is not None else 0)
        held = self._weights.get(rows)
        if held is None or held[0] != version:
            weight = conv.weight.detach().repeat(rows, *([1] * (conv.weight.dim() - 1)))
            bias = conv.bias.detach().repeat(rows) if conv.bias is not None else None
            held = self._weights[rows] = (version, weight, bias)
        return held[1], held[2]

    def decide(
        self, key: tuple, batched: Callable[[], torch.Tensor], grouped: Callable[[], torch.Tensor]
    ) -> torch.Tensor:
        """The batched output; on the way, whether ``grouped`` gives the same
        bits faster, kept under ``key``."""
        expected = batched()
        if not torch.equal(grouped(), expected):
            self.grouped[key] = False
            return expected
        self.grouped[key] = _best_of_two(grouped) < _best_of_two(batched)
        return expected


def _best_of_two(call: Callable[[], torch.Tensor]) -> float:
    best = float("inf")
    for _ in range(2):
        began = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - began)
    return best


def _convolve(conv, x: torch.Tensor, padding: tuple[int, ...]) -> torch.Tensor:
    """``conv``'s oneDNN convolution of ``x`` with ``padding``: over several rows
    of a narrow convolution, grouped where ``_RowGrouping`` decided so."""
    x = x.contiguous()
    rows = x.shape[0]

    def batched() -> torch.Tensor:
        return torch.mkldnn_convolution(x, conv.weight, conv.bias, padding, conv.stride, conv.dilation, conv.groups)

    if rows == 1 or conv.groups != 1 or max(conv.in_channels, conv.out_channels) >= NARROW:
        return batched()
    grouping = conv.__dict__.get("_row_grouping")
    if grouping is None:
        grouping = conv.__dict__["_row_grouping"] = _RowGrouping()

    def grouped() -> torch.Tensor:
        weight, bias = grouping.weights(conv, rows)
        one = x.view(1, rows * x.shape[1], *x.shape[2:])
        y = torch.mkldnn_convolution(one, weight, bias, padding, conv.stride, conv.dilation, rows)
        return y.view(rows, conv.out_channels, *y.shape[2:])

    key = (tuple(x.shape), padding)
    choice = grouping.grouped.get(key)
    if choice is None:
        return grouping.decide(key, batched, grouped)
    return grouped() if choice else batched()


class OneDnnCausalConv3d(WanCausalConv3d):
    """``WanCausalConv3d`` whose CPU fp32 convolution goes to oneDNN, with its
    spatial padding inside the convolution (``_convolve``)."""

    def forward(self, x: torch.Tensor, cache_x: torch.Tensor | None = None) -> torch.Tensor:
        if not _on_onednn(self, x):
            return super().forward(x, cache_x)
        width, _, height, _, time_padding, _ = self._padding
        if cache_x is not None and time_padding > 0:
            x = torch.cat([cache_x.to(x.device), x], dim=2)
            time_padding -= cache_x.shape[2]
        if time_padding > 0:
            x = F.pad(x, (0, 0, 0, 0, time_padding, 0))
        return _convolve(self, x, (0, height, width))


class OneDnnConv2d(torch.nn.Conv2d):
    """``nn.Conv2d`` whose CPU fp32 convolution goes to oneDNN (``_convolve``)."""

    def _conv_forward(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if _on_onednn(self, x) and not isinstance(self.padding, str) and weight is self.weight:
            return _convolve(self, x, self.padding)
        return super()._conv_forward(x, weight, bias)  # "same" / "valid": torch works the numbers out


_FAST = {WanRMS_norm: FastRMSNorm, WanCausalConv3d: OneDnnCausalConv3d, torch.nn.Conv2d: OneDnnConv2d}


def use_fast_cpu_kernels(vae: torch.nn.Module) -> int:
    """Swap ``vae``'s RMS norms and convolutions for the subclasses above (in
    place, weights kept); returns how many modules were swapped."""
    swapped = 0
    for module in vae.modules():
        fast = _FAST.get(type(module))
        if fast is not None:
            module.__class__ = fast
            swapped += 1
    return swapped
