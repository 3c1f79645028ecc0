"""The speed settings of ``rtvideo bench pipeline``: one table from a
setting's name to the pipeline options that turn it on (``SETTINGS``), read
both by ``--with`` (the settings the measured configuration runs with) and by
``--versus`` (a setting, or ``combined``, against the default: ``rtvideo.bench.versus``).

- ``compile``: each transformer block through ``torch.compile``;
- ``cudnn-benchmark``: cuDNN's algorithm timing, a switch of the process
  (``torch.backends.cudnn.benchmark``), no pipeline option;
- ``vae-float32``: the VAE in fp32;
- ``tiny-decoder``: sessions decoded by the tiny streaming decoder (its
  weights named by ``--tiny-decoder``, else the model directory's, else
  random ones: the bench says which);
- ``commit-from-last-step``: the commit writes the last denoise step's keys
  and values instead of a clean pass;
- ``fp8``: the blocks' linears in FP8 (a GPU of compute capability 8.9 or newer);
- ``cuda-graphs``: a full window's forwards and commits (one row or a batch)
  captured as CUDA graphs (a GPU);
- ``fused-elementwise``: each block's norms, modulation and gated residuals
  compiled into fused kernels (inductor: Triton on a GPU, C++ on a CPU);
- ``cudnn-attention``, ``flash-attention``: every block's self-attention on
  torch's cuDNN, or flash, kernel instead of torch's choice (pipeline option
  ``attention``; refused where torch will not run that kernel: a CPU has no
  cuDNN one);
- ``short-window``: the KV window held to ``SHORT_WINDOW_FRAMES`` (9 latent
  frames, three chunks) after the sink, instead of the model's (15 for
  Self-Forcing's weights): a chunk attends to 15 frames instead of 21, about
  30 % fewer keys, and at 832x480 the attention is most of a forward's work.
  Its cost is that later chunks see less of the past, which the quality
  figure measures once the default's window is full (``rtvideo.bench.versus`` times
  both sides from there).

``combined`` (``COMBINED``) is ``FASTEST`` together: the tiny decoder, captured
steps and FP8, the settings that are each a speed-up for their own cost
(detail in the decode, the dtype's rounding, FP8's precision), which its
quality figure measures at once. ``commit-from-last-step`` is not part of it:
it changes what later chunks attend to, which is why it is off by default.
Neither is ``fused-elementwise`` yet (not measured on a GPU; it should
join once its side-by-side figure is in), nor the attention kernels (the
same: to be measured first), nor ``compile`` (on the one GPU measured so far it fell inside eager's
spread, and it is untried with captured steps), ``cudnn-benchmark`` (not yet
measured side by side), ``vae-float32`` (a quality setting, slower) or
``short-window`` (a trade of what the model remembers for speed, for an
operator to choose with its figures: the option ``window_frames``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

SETTINGS: dict[str, dict] = {
    "compile": {"compile": True},
    "cudnn-benchmark": {},  # the process's cuDNN switch, not a pipeline option
    "vae-float32": {"vae_dtype": "float32"},
    "tiny-decoder": {"decoder": "tiny"},
    "commit-from-last-step": {"commit_from_last_step": True},
    "fp8": {"quantize": "fp8"},
    "cuda-graphs": {"cuda_graphs": True},
    "fused-elementwise": {"fused_elementwise": True},
    "cudnn-attention": {"attention": "cudnn"},
    "flash-attention": {"attention": "flash"},
    "short-window": {"window_frames": 9},
}
SHORT_WINDOW_FRAMES = SETTINGS["short-window"]["window_frames"]
COMBINED = "combined"
FASTEST = ("tiny-decoder", "cuda-graphs", "fp8")
"""The settings of ``combined`` (module docstring)."""


def parts(name: str) -> tuple[str, ...]:
    """The settings a variant or ``--with`` name stands for: ``combined``'s, else itself."""
    return FASTEST if name == COMBINED else (name,)


def parse_with(text: str) -> tuple[str, ...]:
    """``--with``'s value, ``SETTING[,SETTING...]`` (``combined`` for its parts), as
    settings in the order given, each once; ``ValueError`` naming an unknown one
    and the known ones."""
    chosen: list[str] = []
    for name in (part.strip() for part in text.split(",")):
        if name not in SETTINGS and name != COMBINED:
            raise ValueError(f"unknown setting {name!r}: known are {', '.join([*SETTINGS, COMBINED])}")
        chosen.extend(setting for setting in parts(name) if setting not in chosen)
    return tuple(chosen)


def pipeline_options(settings: Iterable[str]) -> dict:
    """The pipeline options of ``settings`` together (``SETTINGS``)."""
    options: dict = {}
    for setting in settings:
        options.update(SETTINGS[setting])
    return options


def refusal(setting: str, device: torch.device, dtype: str | None = None) -> str | None:
    """Why the pipeline refuses ``setting`` on ``device`` (its own words: the
    option and the device), None where it runs there. ``dtype``: the model's
    (``--dtype``; None: the device's default), for the attention kernels,
    probed with Wan2.1-1.3B's heads as the pipeline probes its own."""
    if setting == "fp8":
        from rtvideo.workers.pipelines.causal_wan_weights import resolve_dtype
        from rtvideo.workers.pipelines.quantize import fp8_refusal

        return fp8_refusal(device, resolve_dtype(dtype, device))
    if setting == "fused-elementwise":
        from rtvideo.workers.pipelines.wan_block_forward import fused_refusal

        return fused_refusal(device)
    if "attention" in SETTINGS[setting]:
        from rtvideo.workers.pipelines.attention_backend import attention_refusal
        from rtvideo.workers.pipelines.causal_wan_weights import resolve_dtype

        return attention_refusal(SETTINGS[setting]["attention"], device, resolve_dtype(dtype, device))
    if setting == "cuda-graphs" and device.type != "cuda":
        from rtvideo.workers.pipelines.step_graphs import step_graphs_for

        try:
            step_graphs_for(True, device)
        except ValueError as error:
            return str(error)
    return None
