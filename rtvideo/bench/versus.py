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
- ``vae-float32``: a second pipeline whose VAE runs in fp32;
- ``tiny-decoder``: the same pipeline, the variant's sessions decoded by the
  tiny streaming decoder (``rtvideo.workers.pipelines.tiny_decoder``): its weights
  from ``--tiny-decoder`` or the model directory, else random ones (its
  speed is the same; its quality figure then means nothing, and the summary
  says ``tiny_decoder_weights: random``);
- ``fp8``: a second pipeline whose blocks' linears run in FP8
  (``rtvideo.workers.pipelines.quantize``; refused, naming why, where they cannot);
- ``commit-from-last-step``: a second pipeline whose commits write the keys
  and values of each chunk's last denoise step instead of running a clean
  pass (a forward less a chunk; its quality figure is what that costs);
- ``cuda-graphs``: a second pipeline whose denoise forwards and commits over
  a full window are captured as CUDA graphs and replayed (``cuda_graphs``;
  ``rtvideo.workers.pipelines.step_graphs``). Only a full window's forwards are
  captured, so in each session the chunks that fill the window
  (``untimed_chunks`` after the first) run untimed, through both pipelines
  alike; the timed chunks follow them. The
  warm-up captured the graphs at the measured size and each round's session
  takes them over with the cache the session before it left, so no capture
  is timed (each round's ``step_graphs`` shows its captures: 0, and
  replays). On a CPU there is nothing to capture: the variant runs
  ``cuda_graphs: "eager"``, the same path replayed eagerly (its frames
  identical; its speed the cost of the path's copies), and its settings say
  so. Each contender's ``step_graphs`` counts the captures and replays since
  it was built, and the caches kept.
- ``short-window``: a second pipeline whose KV window holds
  ``SHORT_WINDOW_FRAMES`` latent frames after the sink (the option
  ``window_frames``). The two differ only once the shorter window is full,
  and their costs once the longer one is, so every session runs untimed
  until the default's window is full (``window_chunks``): the timed chunks
  compare the two steady states, and the quality figure, over every chunk,
  what the shorter memory changed. Refused where the default's window is no
  longer.
- ``combined``: a second pipeline with ``rtvideo.bench.settings.FASTEST`` together
  (the tiny decoder, captured steps and FP8; why these: ``rtvideo.bench.settings``),
  timed as ``cuda-graphs`` is, after the window is full; its quality figure
  is the three's cost at once. Refused where any part is (on a CPU: FP8 and
  CUDA graphs both, each reason given): unlike ``cuda-graphs`` alone it has
  no eager stand-in, since it is a speed figure or nothing.

Each variant's pipeline options come from ``rtvideo.bench.settings.SETTINGS``, the
table ``--with`` reads too. ``given`` (``--with``): settings both sides run
with (already in ``build``'s options), so that ``--with tiny-decoder
--versus cuda-graphs`` measures captured steps on top of the tiny decoder; a
variant that is, or has a part that is, one of them is refused (both sides
would run it). With captured steps on either side the window is filled
untimed, as for ``cuda-graphs``.

``all`` (``versus_all``) runs every variant in turn, each as above with
pipelines of its own, and reports each one's summary; a variant this device
or these options cannot run (``fp8``, ``cudnn-attention`` and ``combined`` on
a CPU, ``vae-float32`` where the VAE is fp32 already, one given by
``--with``) is listed under ``refused`` with the reason, not measured.

Each round also compares the variant's frames with the default's (the same
seed, prompt and noise): PSNR in dB and the mean absolute difference in
levels of 255 over every pixel of every frame (``quality``; identical frames
have no PSNR: ``null``, and ``identical`` true). On a GPU each session's
peak memory is reported too.
"""

from __future__ import annotations

import contextlib
import gc
import math
import statistics
from collections.abc import Callable, Iterator, Sequence

import msgspec
import numpy as np
import torch

from rtvideo.bench.machine import this_machine
from rtvideo.bench.pipeline import (
    graphs_added,
    one_session,
    peak_device_memory,
    session_chunks,
    untimed_chunks,
    window_chunks,
)
from rtvideo.bench.settings import COMBINED, SETTINGS, SHORT_WINDOW_FRAMES, parts, pipeline_options, refusal
from rtvideo.engine.messages import StartSession
from rtvideo.engine.progress import Progress
from rtvideo.workers.pipelines.causal_wan import CausalWanPipeline
from rtvideo.workers.warmup import warm_up

VARIANTS = (*SETTINGS, COMBINED)
ALL = "all"  # every variant in turn (``versus_all``)


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
    given: Sequence[str] = (),
    progress: Progress | None = None,
) -> dict:
    """``build(**options)`` makes a pipeline (the default with no options, but
    ``given``'s settings, which it applies itself: module docstring); the
    two pipelines (or one, for ``cudnn-benchmark``) are warmed up at
    ``start``'s size, then ``rounds`` alternating rounds of one session of
    ``chunks`` chunks each. Both run with cuDNN's algorithm timing as
    ``cudnn_benchmark`` says, but for the ``cudnn-benchmark`` variant, which
    switches it on. Returns the summary (module docstring). ``progress`` counts
    the rounds' chunks."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}: {', '.join(VARIANTS)}")
    if chunks < 2:
        raise ValueError(f"chunks must be >= 2 (the first chunk is timed apart), got {chunks}")
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    twice = [setting for setting in parts(variant) if setting in given]
    if twice:
        named = ",".join(twice)
        raise ValueError(f"{named} is on both sides already (--with {named}): there would be nothing to compare")
    if variant == "cudnn-benchmark" and cudnn_benchmark:
        raise ValueError("the default it is measured against has cuDNN's algorithm timing on already")
    progress = progress or Progress.silent()
    progress.describe("building the pipelines")
    default = build()
    if variant == COMBINED:
        dtype = str(default.dtype).replace("torch.", "")
        reasons = [why for setting in parts(variant) if (why := refusal(setting, default.device, dtype))]
        if reasons:
            raise ValueError("; ".join(reasons))
    if variant == "compile" and default.compiled:
        raise ValueError("the default it is measured against is compiled already")
    if variant == "vae-float32" and default.vae_dtype == torch.float32:
        raise ValueError("the default pipeline's VAE is fp32 already (--dtype bfloat16 makes it bf16)")
    if variant == "short-window" and default.window_frames <= SHORT_WINDOW_FRAMES:
        raise ValueError(
            f"the default's KV window is {default.window_frames} latent frames already, "
            f"no longer than short-window's {SHORT_WINDOW_FRAMES}"
        )
    weights = None  # the tiny decoder's, where the variant has it
    if "tiny-decoder" in parts(variant):
        weights = "given" if "tiny" in default.decoders else "random"
    tiny = msgspec.structs.replace(start, decoder="tiny")
    if variant == "cudnn-benchmark":
        contenders = {"default": (default, False, start), variant: (default, True, start)}
    elif variant == "tiny-decoder":
        if weights == "random":
            default = build(tiny_decoder="random")
        contenders = {"default": (default, cudnn_benchmark, start), variant: (default, cudnn_benchmark, tiny)}
    else:
        options = pipeline_options(parts(variant))
        if variant == "cuda-graphs" and default.device.type != "cuda":
            options["cuda_graphs"] = "eager"  # the same path, replayed eagerly (module docstring)
        if weights == "random":
            options["tiny_decoder"] = "random"
        contenders = {
            "default": (default, cudnn_benchmark, start),
            variant: (build(**options), cudnn_benchmark, start),
        }
    # captured steps: the window filled before the timed chunks (its graphs were captured at warm-up); windows
    # of two lengths (short-window): both timed once the longer one is full, where they differ
    pipelines = [pipeline for pipeline, _, _ in contenders.values()]
    untimed = max(untimed_chunks(pipeline, captured_at_warm_up=True) for pipeline in pipelines)
    if len({pipeline.window_frames for pipeline in pipelines}) > 1:
        untimed = max(untimed, *(window_chunks(pipeline) for pipeline in pipelines))
    progress.expect(2 * rounds * (session_chunks(chunks) + untimed))
    progress.describe("warming up")
    for pipeline, benchmark, _ in contenders.values():  # the default twice for cudnn-benchmark: once each way
        with _cudnn_benchmark(benchmark):
            warm_up(pipeline, start.width, start.height)
    if variant == "tiny-decoder":  # the warm-up runs the default decoder: one session warms the tiny one
        one_session(default, tiny, 2)
    results = []
    for number in range(rounds):
        progress.describe(f"round {number + 1} of {rounds}")
        order = list(contenders) if number % 2 == 0 else list(reversed(contenders))
        figures, frames = {}, {}
        for name in order:
            pipeline, benchmark, session = contenders[name]
            frames[name] = []
            graphs = pipeline.graph_figures()
            peak = peak_device_memory(pipeline.device)
            with _cudnn_benchmark(benchmark):
                figures[name] = one_session(
                    pipeline, session, chunks, frames=frames[name], progress=progress, untimed=untimed
                )
            figures[name]["peak_memory_bytes"] = peak()
            figures[name]["step_graphs"] = graphs_added(graphs, pipeline.graph_figures())
        results.append(
            {
                "first": order[0],
                "default": figures["default"],
                "variant": figures[variant],
                "fps_ratio": figures[variant]["fps"] / figures["default"]["fps"],
                "quality": frame_difference(frames["default"], frames[variant]),
            }
        )
    ratios = [r["fps_ratio"] for r in results]
    return {
        "bench": "pipeline-versus",
        "variant": variant,
        "settings": list(parts(variant)),
        "with": list(given),
        "pipelines": {name: _settings(*contender) for name, contender in contenders.items()},
        "device": str(default.device),
        "machine": this_machine(default.device),
        "width": start.width or default.default_size[0],
        "height": start.height or default.default_size[1],
        "steps": start.num_inference_steps,
        "chunks": chunks,
        "untimed_chunks": untimed,
        "rounds": results,
        "fps_ratios": ratios,
        "median_fps_ratio": statistics.median(ratios),
        "tiny_decoder_weights": weights,
    }


def versus_all(
    build: Callable[..., CausalWanPipeline],
    start: StartSession,
    chunks: int,
    rounds: int,
    *,
    cudnn_benchmark: bool = False,
    given: Sequence[str] = (),
    progress: Progress | None = None,
    variants: Sequence[str] = VARIANTS,
) -> dict:
    """``versus`` of each of ``variants`` in turn (each with pipelines of its
    own, dropped before the next is built): every summary by variant, the
    median ratios side by side, and the variants refused here with the reason
    (the ``ValueError`` that refused them)."""
    progress = progress or Progress.silent()
    summaries, refused = {}, {}
    for variant in variants:
        progress.expect(0, done=0)
        try:
            summaries[variant] = versus(
                build,
                variant,
                start,
                chunks,
                rounds,
                cudnn_benchmark=cudnn_benchmark,
                given=given,
                progress=progress,
            )
        except ValueError as error:
            refused[variant] = str(error)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return {
        "bench": "pipeline-versus-all",
        "with": list(given),
        "variants": summaries,
        "median_fps_ratios": {variant: summary["median_fps_ratio"] for variant, summary in summaries.items()},
        "refused": refused,
    }


def frame_difference(reference: Sequence, other: Sequence) -> dict:
    """How far ``other``'s frames are from ``reference``'s (``ChunkOutput``s of one
    session each, the same count and size): PSNR in dB (None when identical)
    and the mean absolute difference, in levels of 255."""
    if [(c.num_frames, c.width, c.height) for c in reference] != [(c.num_frames, c.width, c.height) for c in other]:
        raise ValueError("the two sessions' chunks differ in frames or size")
    a = np.frombuffer(b"".join(c.payload for c in reference), np.uint8).astype(np.float64)
    b = np.frombuffer(b"".join(c.payload for c in other), np.uint8).astype(np.float64)
    squared = float(np.mean((a - b) ** 2))
    psnr = None if squared == 0 else 10.0 * math.log10(255.0**2 / squared)
    return {"psnr_db": psnr, "mean_abs_levels": float(np.mean(np.abs(a - b))), "identical": squared == 0}


def _settings(pipeline: CausalWanPipeline, cudnn_benchmark: bool, start: StartSession) -> dict:
    """What a contender ran with, as the pipeline reports it."""
    return {
        "dtype": str(pipeline.dtype).replace("torch.", ""),
        "vae_dtype": str(pipeline.vae_dtype).replace("torch.", ""),
        "compiled": pipeline.compiled,
        "commit_from_last_step": pipeline.commit_from_last_step,
        "quantize": pipeline.quantized,
        "cuda_graphs": pipeline.cuda_graphs,
        "fused_elementwise": pipeline.fused_elementwise,
        "attention": pipeline.attention,
        "sink_frames": pipeline.sink_frames,
        "window_frames": pipeline.window_frames,
        "step_graphs": pipeline.graph_figures(),
        "cudnn_benchmark": cudnn_benchmark,
        "decoder": start.decoder or pipeline.default_decoder,
    }
