"""FP8 linears (``rtvideo.workers.pipelines.quantize``): which layers they take, and the
refusal, naming why, wherever they cannot run: a CPU, a GPU older than
compute capability 8.9, a model not in bfloat16, no torchao. (Running them needs such a GPU:
tests/gpu/test_wan_on_gpu.py.)"""

from __future__ import annotations

import sys

import pytest
import torch

from rtvideo.workers.pipelines import quantize
from rtvideo.workers.pipelines.causal_wan import build


def test_fp8_takes_the_blocks_linears_only_and_only_those_the_kernels_tile():
    from diffusers import WanTransformer3DModel

    from rtvideo.workers.pipelines.presets import WAN_1_3B_TRANSFORMER

    with torch.device("meta"):  # Wan2.1-1.3B's layout, one block, no memory
        wan = WanTransformer3DModel(**{**WAN_1_3B_TRANSFORMER, "num_layers": 1})
    names = quantize.fp8_linears(wan)
    block = [n for n, m in wan.named_modules() if isinstance(m, torch.nn.Linear) and n.startswith("blocks.")]
    assert names == block and len(names) == 10  # q, k, v, out of both attentions; the feed-forward's two
    outside = [n for n, m in wan.named_modules() if isinstance(m, torch.nn.Linear) and not n.startswith("blocks.")]
    assert outside and not set(outside) & set(names)  # embedders and head keep their precision
    tiny = build("tiny", device="cpu", warm_up_chunks=0).transformer
    assert quantize.fp8_linears(tiny) == []  # 24-wide: not a multiple of the FP8 kernels' 16


def test_fp8_is_refused_naming_why_where_it_cannot_run(monkeypatch):
    with pytest.raises(ValueError, match="quantize fp8: FP8 matrix products need a GPU .* this runs on cpu"):
        build("tiny", device="cpu", warm_up_chunks=0, quantize="fp8")
    with pytest.raises(ValueError, match="quantize must be one of fp8 or null, got 'int4'"):
        build("tiny", device="cpu", warm_up_chunks=0, quantize="int4")
    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    assert quantize.fp8_refusal(gpu) == (
        "quantize fp8: NVIDIA A100 has compute capability 8.0; FP8 matrix products need 8.9 or newer "
        "(Ada, Hopper, Blackwell)"
    )
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert quantize.fp8_refusal(gpu, torch.float32) == (  # torchao's per-row scales take bf16 weights only
        "quantize fp8: FP8 linears with per-row scales need the model in bfloat16, not float32"
    )
    from rtvideo.bench.settings import refusal

    assert refusal("fp8", gpu, "float32") == quantize.fp8_refusal(gpu, torch.float32)  # the bench's --dtype too
    monkeypatch.setitem(sys.modules, "torchao", None)  # an import of it fails, as where it is not installed
    assert quantize.fp8_refusal(gpu) == "quantize fp8: torchao is not installed (it comes with requirements-cuda.lock)"
