"""``rtvideo bench pipeline --versus VARIANT``: one speed setting against the
default, side by side in one process.

Runs in different processes differ by more than these settings do (on one GPU
the same eager denoise step took 364-435 ms a chunk from one run to the next;
docs/MODEL.md, "Measured"), so a setting is judged here by rounds that
alternate the two: each round runs a fresh session through each pipeline
(which goes first alternates from round to round), its first chunk timed
apart, then frames per second over the chunks after it. The ratio of a round
is the variant's frames per second over the default's; the summary gives
each round's and their median.

Variants (``VARIANTS``):

- ``compile``: a second pipeline with ``compile`` on (the same weights:
  random ones are drawn from the same seed), warmed up, so compilation is
  not timed;
- ``cudnn-benchmark``: the same pipeline, cuDNN's algorithm timing switched
  on for the variant's runs only (its warm-up ran with it on, so it paid the
  timing for the measured shapes);
- ``vae-float32``: a second pipeline whose VAE runs in fp32.
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Callable, Iterator

import torch

from engine.messages import StartSession
from workers.bench_pipeline import one_session
from workers.pipelines.causal_wan import CausalWanPipeline
from workers.warmup import warm_up

VARIANTS = ("compile", "cudnn-benchmark", "vae-float32")


@contextlib.contextmanager
def _cudnn_benchmark(on: bool) -> Iterator[None]:
    was = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = on
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark = was


def versus(
    build: Callable[..., CausalWanPipeline],
    variant: str,
    start: StartSession,
    chunks: int,
    rounds: int,
    *,
    cudnn_benchmark: bool = False,
) -> dict:
    """``build(**options)`` makes a pipeline (the default with no options); the
    two pipelines (or one, for ``cudnn-benchmark``) are warmed up at
    ``start``'s size, then ``rounds`` alternating rounds of one session of
    ``chunks`` chunks each. Both run with cuDNN's algorithm timing as
    ``cudnn_benchmark`` says, but for the ``cudnn-benchmark`` variant, which
    switches it on. Returns the summary (module docstring)."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}: {', '.join(VARIANTS)}")
    if chunks < 2:
        raise ValueError(f"chunks must be >= 2 (the first chunk is timed apart), got {chunks}")
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    if variant == "cudnn-benchmark" and cudnn_benchmark:
        raise ValueError("the default it is measured against has cuDNN's algorithm timing on already")
    default = build()
    if variant == "compile" and default.compiled:
        raise ValueError("the default it is measured against is compiled already")
    if variant == "vae-float32" and default.vae_dtype == torch.float32:
        raise ValueError("the default pipeline's VAE is fp32 already (--dtype bfloat16 makes it bf16)")
    if variant == "cudnn-benchmark":
        contenders = {"default": (default, False), variant: (default, True)}
    else:
        options = {"compile": True} if variant == "compile" else {"vae_dtype": "float32"}
        contenders = {"default": (default, cudnn_benchmark), variant: (build(**options), cudnn_benchmark)}
    for pipeline, benchmark in contenders.values():  # the default twice for cudnn-benchmark: once each way
        with _cudnn_benchmark(benchmark):
            warm_up(pipeline, start.width, start.height)
    results = []
    for number in range(rounds):
        order = list(contenders) if number % 2 == 0 else list(reversed(contenders))
        figures = {}
        for name in order:
            pipeline, benchmark = contenders[name]
            with _cudnn_benchmark(benchmark):
                figures[name] = one_session(pipeline, start, chunks)
        results.append(
            {
                "first": order[0],
                "default": figures["default"],
                "variant": figures[variant],
                "fps_ratio": figures[variant]["fps"] / figures["default"]["fps"],
            }
        )
    ratios = [r["fps_ratio"] for r in results]
    return {
        "bench": "pipeline-versus",
        "variant": variant,
        "pipelines": {name: _settings(*contender) for name, contender in contenders.items()},
        "device": str(default.device),
        "width": start.width or default.default_size[0],
        "height": start.height or default.default_size[1],
        "steps": start.num_inference_steps,
        "chunks": chunks,
        "rounds": results,
        "fps_ratios": ratios,
        "median_fps_ratio": statistics.median(ratios),
    }


def _settings(pipeline: CausalWanPipeline, cudnn_benchmark: bool) -> dict:
    """What a contender ran with, as the pipeline reports it."""
    return {
        "dtype": str(pipeline.dtype).replace("torch.", ""),
        "vae_dtype": str(pipeline.vae_dtype).replace("torch.", ""),
        "compiled": pipeline.compiled,
        "cudnn_benchmark": cudnn_benchmark,
    }
