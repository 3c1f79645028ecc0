"""``rtvideo bench pipeline``: what one chunk of the causal Wan pipeline costs.

Runs the pipeline in this process, one session, no server, through the
worker's own path (``rtvideo.workers.chunk_driver``: micro-steps through the
``ModelRunner``, the device synchronised around the commit and the decode
so their times are the device's): the worker's warm-up (``rtvideo.workers.warmup``, reported as
``warm_up_s``), then a fresh session's time to its first chunk (prompt
encode + first chunk, as a user of a started server sees it), then per chunk
the split between the boundary and denoise steps, the commit forward and the
VAE decode, and generated frames per second against playback (``fps``). ``--preset wan2.1-1.3b`` builds the real 1.3B
transformer with random weights (a GPU machine's measurement; bf16).
``--profile FILE`` writes a torch profiler table of one steady chunk.
``--sessions N[,N...]`` builds the pipeline for the most of them rows a
forward (``max_batch_rows``, so the warm-up runs a batched forward of that
many rows too), then for each count runs that many sessions side by side,
one row per forward and all of them per forward, and reports both
throughputs (``side_by_side``, one entry a count). ``--with SETTING[,...]``
applies speed settings (``rtvideo.bench.settings``: the names ``--versus`` takes) to
the measured configuration: the run, the sessions side by side and both
sides of ``--versus``; the summary names them (``with``). A setting the
pipeline refuses on this device is refused here, naming it and why. With
captured steps (``cuda-graphs``) each session's chunks that fill the window
and capture run untimed (``untimed_chunks``, after its first), so the
figures are the replays'. ``decode_overlap`` compares, side by side in the
same run, the decode in line and on the decode stage (a thread of its own
while the next chunk denoises): time to the first chunk and frames per second.
The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

import msgspec
import torch

from rtvideo.bench.machine import this_machine
from rtvideo.bench.settings import parse_with, pipeline_options, refusal
from rtvideo.engine.messages import StartSession
from rtvideo.engine.progress import Progress
from rtvideo.workers.chunk_driver import ChunkDriver
from rtvideo.workers.pipelines.causal_wan import CausalWanPipeline
from rtvideo.workers.pipelines.presets import WAN_1_3B_TRANSFORMER, Components, build_tiny, load_directory
from rtvideo.workers.runner import StageCall
from rtvideo.workers.warmup import warm_up

OVERLAP_ROUNDS = 2
"""Rounds of the decode overlap's comparison (``_decode_overlap``)."""


def _components(preset: str, device: str | None) -> Components:
    """The preset's components; a model directory's (``demo`` is the shipped one's)
    for any other name that is a directory."""
    if preset == "demo" or Path(preset).is_dir():
        from rtvideo.workers.demo import WEIGHTS

        return load_directory(WEIGHTS if preset == "demo" else preset, torch.float32)
    tiny = build_tiny()
    if preset == "tiny":
        return tiny
    if preset == "wan2.1-1.3b":
        from diffusers import AutoencoderKLWan, WanTransformer3DModel
        from transformers import UMT5Config, UMT5EncoderModel

        torch.manual_seed(0)
        target = device or ("cuda" if torch.cuda.is_available() else "cpu")
        with torch.device(target):  # random init where it will run: seconds on a GPU, not minutes on its host
            transformer = WanTransformer3DModel(**WAN_1_3B_TRANSFORMER)
            vae = AutoencoderKLWan()  # the Wan2.1 VAE configuration
            config = UMT5Config(vocab_size=384, d_model=4096, d_kv=64, d_ff=256, num_layers=1, num_heads=8)
            text = UMT5EncoderModel(config)
        return Components(transformer, vae, text, tiny.tokenizer, text_length=512, default_size=(832, 480))
    raise SystemExit(f"unknown preset {preset!r}: tiny, demo, wan2.1-1.3b or a model directory")


def run(
    preset: str,
    width: int | None,
    height: int | None,
    chunks: int,
    steps: int,
    device: str | None,
    *,
    dtype: str | None = None,
    vae_dtype: str | None = None,
    warm: bool = True,
    profile: str | None = None,
    compile: bool = False,
    sessions: int | Sequence[int] = 1,
    with_settings: Sequence[str] = (),
    tiny_decoder: str | None = None,
    progress: Progress | None = None,
) -> dict:
    """The summary (module docstring); ``progress`` counts every chunk made
    (``run_chunks``). ``with_settings``: ``rtvideo.bench.settings`` names
    (``cudnn-benchmark`` switches cuDNN's algorithm timing on for the
    process); ``tiny_decoder``: the tiny decoder's weights file."""
    progress = progress or Progress.silent()
    counts = [sessions] if isinstance(sessions, int) else list(sessions)
    if "cudnn-benchmark" in with_settings:
        torch.backends.cudnn.benchmark = True
    progress.describe("building the pipeline")
    built = time.perf_counter()
    components = _components(preset, device)
    options = {"vae_dtype": vae_dtype, "compile": compile, **pipeline_options(with_settings)}
    if tiny_decoder is not None:
        options["tiny_decoder"] = tiny_decoder
    weights = tiny_decoder_weights(components, options)
    pipeline = _pipeline(components, device, dtype, warm=warm, sessions=max(counts), **options)
    build_s = time.perf_counter() - built
    settle = untimed_chunks(pipeline)
    progress.expect(run_chunks(chunks, counts, untimed=settle))
    progress.describe("warming up")
    warm_up_s = warm_up(pipeline, width, height)  # at the measured size
    progress.describe("one session")
    budget = pipeline.session_memory_budget()
    start = StartSession(
        session_id="bench", prompt="a red fox in the snow", width=width, height=height, num_inference_steps=steps
    )
    calls: list[StageCall] = []
    driver = ChunkDriver(pipeline, synchronize=partial(_wait_around_split, pipeline), on_stage=calls.append)
    one_session_peak = peak_device_memory(pipeline.device)  # from here: not the build or the warm-up
    began = _synchronized(pipeline)
    [state] = driver.open(start)
    rows = []
    first_chunk_s = None
    for chunk in range(chunks + settle):
        profiled = profile is not None and chunk == min(settle + 2, chunks + settle - 1)
        calls.clear()
        with _profiler(pipeline.device) if profiled else contextlib.nullcontext() as profiler:
            t0 = _synchronized(pipeline)
            out = driver.run_chunk("bench")
            t1 = _synchronized(pipeline)
        progress.advance()
        if profiled:
            _write_profile(profiler, pipeline.device, profile)
        if first_chunk_s is None:
            first_chunk_s = t1 - began
        total_ms = (t1 - t0) * 1e3
        commit_ms = sum(call.ms for call in calls if call.stage == "commit")
        decode_ms = sum(call.ms for call in calls if call.stage == "decode")
        rows.append(
            {
                "frames": out.num_frames,
                "denoise_ms": total_ms - commit_ms - decode_ms,  # the boundary, the steps and their planning
                "commit_ms": commit_ms,
                "decode_ms": decode_ms,
                "total_ms": total_ms,
            }
        )
    peak_bytes = one_session_peak()
    steady = rows[1 + settle :] or rows
    frames = sum(r["frames"] for r in steady)
    seconds = sum(r["total_ms"] for r in steady) / 1e3
    geometry = state.geometry
    driver.release("bench")
    side_by_side = []
    for count in (count for count in counts if count > 1):
        progress.describe(f"{count} sessions")
        graphs = pipeline.graph_figures()
        one_row = _sessions_fps(pipeline, start, count, chunks, batched=False, progress=progress, untimed=settle)
        between = pipeline.graph_figures()
        batched = _sessions_fps(pipeline, start, count, chunks, batched=True, progress=progress, untimed=settle)
        side_by_side.append(
            {
                "sessions": count,
                "one_row_fps": one_row,
                "batched_fps": batched,
                "batched_over_one_row": batched / one_row,
                # captured steps: what each way added (the batch's own graphs, captured untimed, then replayed)
                "one_row_step_graphs": graphs_added(graphs, between),
                "batched_step_graphs": graphs_added(between, pipeline.graph_figures()),
            }
        )
    progress.describe("decode overlap")
    overlap = _decode_overlap(pipeline, start, chunks, progress=progress, untimed=settle)
    return {
        "bench": "pipeline",
        "preset": preset,
        "device": str(pipeline.device),
        "machine": this_machine(pipeline.device),
        "with": list(with_settings),
        "dtype": str(pipeline.dtype).replace("torch.", ""),
        "vae_dtype": str(pipeline.vae_dtype).replace("torch.", ""),
        "threads": torch.get_num_threads(),
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "compiled": pipeline.compiled,
        "decoder": pipeline.default_decoder,
        "tiny_decoder_weights": weights,
        "commit_from_last_step": pipeline.commit_from_last_step,
        "quantize": pipeline.quantized,
        "cuda_graphs": pipeline.cuda_graphs,
        "fused_elementwise": pipeline.fused_elementwise,
        "attention": pipeline.attention,
        "step_graphs": pipeline.graph_figures(),  # captures, replays and fallbacks since it was built
        "width": geometry.width,
        "height": geometry.height,
        "steps": geometry.num_inference_steps,
        "chunks": chunks,
        "untimed_chunks": settle,
        "build_s": build_s,
        "warm_up_s": warm_up_s,
        "time_to_first_chunk_s": first_chunk_s,
        "per_chunk_ms": {
            key: statistics.median(r[key] for r in steady)
            for key in ("denoise_ms", "commit_ms", "decode_ms", "total_ms")
        },
        "state_bytes": geometry.state_bytes,
        "session_memory_budget": budget,
        "peak_device_bytes": peak_bytes,  # one session's chunks (not the build, the warm-up or the side by side)
        "generated_fps": frames / seconds,
        "playback_fps": geometry.fps,
        "realtime_factor": frames / seconds / geometry.fps,
        "side_by_side": side_by_side or None,
        "decode_overlap": overlap,
    }


def run_chunks(chunks: int, sessions: int | Sequence[int] = 1, rounds: int = OVERLAP_ROUNDS, untimed: int = 0) -> int:
    """The chunks ``run`` makes: ``chunks`` of one session, with each count of
    ``sessions`` above 1 that many sessions' twice (one row a forward, then
    batched), and the decode overlap's two modes in each of ``rounds`` rounds,
    ``session_chunks`` each; every session ``untimed`` more."""
    counts = [sessions] if isinstance(sessions, int) else sessions
    each = session_chunks(chunks) + untimed
    side_by_side = sum(2 * count * each for count in counts if count > 1)
    return chunks + untimed + side_by_side + 2 * rounds * each


def session_chunks(chunks: int) -> int:
    """The chunks of one fresh session timed as ``one_session`` times it: the first, then at least one."""
    return 1 + max(1, chunks - 1)


def peak_device_memory(device: torch.device) -> Callable[[], int | None]:
    """The device memory's peak from this call on: a function that reads it
    (a GPU's; one that reads None elsewhere)."""
    if device.type != "cuda":
        return lambda: None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    return lambda: torch.cuda.max_memory_allocated(device)


def graphs_added(before: dict | None, after: dict | None) -> dict | None:
    """What ran between two readings of a pipeline's captured-step counts
    (``graph_figures``): captures, replays, eager runs (first uses, or all
    since a capture failed) and failed captures (the worker's log says why);
    None without captured steps."""
    if before is None or after is None:
        return None
    return {name: after[name] - before[name] for name in ("captures", "replays", "fallbacks", "capture_failures")}


def window_chunks(pipeline: CausalWanPipeline) -> int:
    """The chunks that fill a session's KV cache (sink and window)."""
    return (pipeline.sink_frames + pipeline.window_frames) // pipeline.latent_frames


def untimed_chunks(pipeline: CausalWanPipeline, captured_at_warm_up: bool = False) -> int:
    """The chunks after a session's first that a bench leaves out of its
    figures: with captured steps, those that fill the window and, unless
    ``captured_at_warm_up`` (the session takes over graphs the warm-up made
    at its size), those until its denoise and commit graphs are captured
    (``capture_chunks``); else none."""
    if pipeline.capture_chunks == 0:
        return 0
    if captured_at_warm_up:
        return window_chunks(pipeline)
    return pipeline.capture_chunks - 1


def tiny_decoder_weights(components: Components, options: dict) -> str | None:
    """Whose weights the tiny decoder of a pipeline of ``options`` has where its
    sessions decode with it by default: ``given`` (a file named, or the model
    directory's), else ``random`` (``_pipeline`` draws them); None where they do not."""
    if options.get("decoder") != "tiny":
        return None
    return "given" if options.get("tiny_decoder") or components.tiny_decoder else "random"


def _build(
    preset: str,
    device: str | None,
    dtype: str | None,
    vae_dtype: str | None = None,
    warm: bool = True,
    sessions: int = 1,
    **options,
) -> CausalWanPipeline:
    """The preset's pipeline with these pipeline options (``_pipeline``)."""
    return _pipeline(
        _components(preset, device), device, dtype, warm=warm, sessions=sessions, vae_dtype=vae_dtype, **options
    )


def _pipeline(
    components: Components, device: str | None, dtype: str | None, *, warm: bool = True, sessions: int = 1, **options
) -> CausalWanPipeline:
    """The pipeline of ``components`` for ``sessions`` rows a forward; ``options``
    are its own (``vae_dtype``, ``compile``, ``decoder``, ...). Sessions that
    decode with the tiny decoder by default get random weights for it where
    none are named or in the model directory (``tiny_decoder_weights``)."""
    if tiny_decoder_weights(components, options) == "random":
        options = {**options, "tiny_decoder": "random"}
    return CausalWanPipeline(
        components,
        device=device,
        dtype=dtype,
        warm_up_chunks=2 if warm else 0,
        max_batch_rows=sessions,
        **options,
    )


def _versus(args: argparse.Namespace, progress: Progress) -> dict:
    """``--versus``: the variant against these options, side by side (``rtvideo.bench.versus``),
    both sides with ``--with``'s settings."""
    from rtvideo.bench.versus import ALL, versus, versus_all

    given = {"vae_dtype": args.vae_dtype, "compile": args.compile, **pipeline_options(args.with_settings)}
    weights = {}

    def build(**options) -> CausalWanPipeline:
        options = {**given, **options}
        if args.tiny_decoder:
            options["tiny_decoder"] = args.tiny_decoder
        components = _components(args.preset, args.device)
        weights.setdefault("with", tiny_decoder_weights(components, options) if "decoder" in given else None)
        return _pipeline(components, args.device, args.dtype, **options)

    start = StartSession(
        session_id="versus",
        prompt="a red fox in the snow",
        width=args.width,
        height=args.height,
        num_inference_steps=args.steps,
    )
    common = {"cudnn_benchmark": args.cudnn_benchmark, "given": args.with_settings, "progress": progress}
    try:
        if args.versus == ALL:
            summary = versus_all(build, start, args.chunks, args.rounds, **common)
        else:
            summary = versus(build, args.versus, start, args.chunks, args.rounds, **common)
    except ValueError as error:  # a comparison that would measure nothing, or one refused here, named
        raise SystemExit(f"--versus {args.versus}: {error}") from None
    summary["with_tiny_decoder_weights"] = weights.get("with")
    return summary


def _wait_around_split(pipeline: CausalWanPipeline, stage: str) -> None:
    """The device is waited for around the commit and the decode only, as their
    split needs; inside a chunk's denoise steps nothing waits for it, as when serving."""
    if stage in ("commit", "decode"):
        pipeline.synchronize()


def _synchronized(pipeline: CausalWanPipeline) -> float:
    """``perf_counter`` once the device has finished its queued work."""
    pipeline.synchronize()
    return time.perf_counter()


def _sessions_fps(
    pipeline: CausalWanPipeline,
    start: StartSession,
    count: int,
    chunks: int,
    batched: bool,
    progress: Progress | None = None,
    untimed: int = 0,
) -> float:
    """Frames per second generated by ``count`` sessions stepped together, each
    step one forward over all rows (``batched``) or one forward per row; the
    first chunk and ``untimed`` more are not timed."""
    progress = progress or Progress.silent()
    driver = ChunkDriver(pipeline, max_rows=count if batched else 1)
    ids = [f"side-{i}" for i in range(count)]
    driver.open(*(msgspec.structs.replace(start, session_id=sid, seed=i) for i, sid in enumerate(ids)))
    driver.run(ids, 1 + untimed)  # the first chunk, and the untimed ones
    progress.advance(count * (1 + untimed))
    began = _synchronized(pipeline)
    made = driver.run(ids, max(1, chunks - 1))
    seconds = _synchronized(pipeline) - began
    progress.advance(count * max(1, chunks - 1))
    driver.release(*ids)
    return sum(out.num_frames for outputs in made.values() for out in outputs) / seconds


def _decode_overlap(
    pipeline: CausalWanPipeline,
    start: StartSession,
    chunks: int,
    rounds: int = OVERLAP_ROUNDS,
    progress: Progress | None = None,
    untimed: int = 0,
) -> dict:
    """One session with the decode in line (after the commit, in the same
    micro-step) and on the decode stage (a thread of its own, while the next
    chunk denoises), alternated ``rounds`` times, the best of each counted:
    time to the first chunk (open to its frames) and frames per second over
    the chunks after it and ``untimed`` more (``one_session``)."""
    best: dict[str, dict] = {}
    for _ in range(rounds):
        for mode, overlap in (("in_line", False), ("overlapped", True)):
            figures = one_session(pipeline, start, chunks, overlap_decode=overlap, progress=progress, untimed=untimed)
            kept = best.setdefault(mode, figures)
            kept["time_to_first_chunk_s"] = min(kept["time_to_first_chunk_s"], figures["time_to_first_chunk_s"])
            kept["fps"] = max(kept["fps"], figures["fps"])
    return {**best, "fps_overlapped_over_in_line": best["overlapped"]["fps"] / best["in_line"]["fps"]}


def one_session(
    pipeline: CausalWanPipeline,
    start: StartSession,
    chunks: int,
    *,
    overlap_decode: bool = False,
    frames: list | None = None,
    progress: Progress | None = None,
    untimed: int = 0,
) -> dict:
    """A fresh session of ``start``: seconds to its first chunk (open to its
    frames), then ``untimed`` chunks not timed, then frames per second over the
    ``chunks - 1`` after them (at least one), the device waited for at both
    ends of each span. ``frames``: a list its chunks (``ChunkOutput``) are
    added to; ``progress`` advanced by each chunk made (``session_chunks``,
    and the untimed ones)."""
    progress = progress or Progress.silent()
    driver = ChunkDriver(pipeline, overlap_decode=overlap_decode)
    began = _synchronized(pipeline)
    driver.open(start)
    first_chunk = driver.run([start.session_id])
    first = _synchronized(pipeline) - began
    progress.advance()
    settled = driver.run([start.session_id], untimed)[start.session_id] if untimed else []
    progress.advance(untimed)
    began = _synchronized(pipeline)
    made = driver.run([start.session_id], max(1, chunks - 1))
    seconds = _synchronized(pipeline) - began
    progress.advance(max(1, chunks - 1))
    driver.release(start.session_id)
    driver.close()
    if frames is not None:
        frames.extend([first_chunk[start.session_id][0], *settled, *made[start.session_id]])
    count = sum(out.num_frames for out in made[start.session_id])
    return {"time_to_first_chunk_s": first, "fps": count / seconds}


def _print_rounds(summary: dict) -> None:
    """A ``--versus`` summary's rounds, a line each."""
    for number, one in enumerate(summary["rounds"], 1):
        print(
            f"round {number} ({one['first']} first): default {one['default']['fps']:.1f} fps, "
            f"first chunk {one['default']['time_to_first_chunk_s']:.3f} s; {summary['variant']} "
            f"{one['variant']['fps']:.1f} fps, first chunk {one['variant']['time_to_first_chunk_s']:.3f} s "
            f"({one['fps_ratio']:.2f}x)"
        )


def _profiler(device: torch.device) -> torch.profiler.profile:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(activities=activities)


def _write_profile(profiler: torch.profiler.profile, device: torch.device, path: str) -> None:
    sort_by = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    with open(path, "w") as out:
        out.write(profiler.key_averages().table(sort_by=sort_by, row_limit=40))


def _session_counts(text: str) -> tuple[int, ...]:
    """``--sessions``' value: counts of sessions, each at least 1."""
    try:
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N[,N...], counts of sessions, got {text!r}") from None
    if min(counts) < 1:
        raise argparse.ArgumentTypeError(f"counts of sessions must be >= 1, got {text!r}")
    return counts


def _with_settings(text: str) -> tuple[str, ...]:
    """``--with``'s value (``rtvideo.bench.settings.parse_with``), an argparse error when wrong."""
    try:
        return parse_with(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def build_parser() -> argparse.ArgumentParser:
    """The bench's options (``rtvideo bench pipeline --help``); parsing checks a
    ``--versus`` variant and the ``--with`` settings by name."""
    parser = argparse.ArgumentParser(prog="rtvideo bench pipeline", description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny", help="tiny | demo | wan2.1-1.3b | a model directory")
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--height", type=int, default=None)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    parser.add_argument("--dtype", default=None, help="bfloat16 | float32 (default: bf16 on GPU, fp32 on CPU)")
    parser.add_argument("--vae-dtype", default=None, help="bfloat16 | float32 (default: the model's dtype)")
    parser.add_argument("--no-warm-up", dest="warm", action="store_false", help="measure a cold first chunk")
    parser.add_argument(
        "--cudnn-benchmark", action="store_true", help="let cuDNN time its convolution algorithms (warm-up pays)"
    )
    parser.add_argument("--compile", action="store_true", help="torch.compile each transformer block (warm-up pays)")
    parser.add_argument("--profile", default=None, metavar="FILE", help="write a profiler table of one chunk")
    parser.add_argument(
        "--sessions",
        type=_session_counts,
        default=(1,),
        metavar="N[,N...]",
        help="also compare N sessions batched vs one row a forward, for each N",
    )
    from rtvideo.bench.versus import ALL, VARIANTS  # it imports this module

    parser.add_argument(
        "--with",
        dest="with_settings",
        type=_with_settings,
        default=(),
        metavar="SETTING[,SETTING...]",
        help=f"run the measured configuration (both sides of --versus) with these: {', '.join(VARIANTS)}",
    )

    parser.add_argument(
        "--versus",
        choices=(*VARIANTS, ALL),
        default=None,
        help="instead: that setting against these options, in alternating rounds in one process",
    )
    parser.add_argument("--rounds", type=int, default=3, help="--versus: rounds of one session each way")
    parser.add_argument(
        "--tiny-decoder",
        default=None,
        metavar="FILE",
        help="the tiny decoder's weights (--with or --versus tiny-decoder; default: the model directory's, "
        "else random weights)",
    )
    parser.add_argument("--json", action="store_true", help="print only the JSON summary")
    return parser


def main(argv: list[str] | None = None) -> int:
    from rtvideo.bench.versus import ALL  # it imports this module

    args = build_parser().parse_args(argv)
    args.cudnn_benchmark = args.cudnn_benchmark or "cudnn-benchmark" in args.with_settings
    torch.backends.cudnn.benchmark = args.cudnn_benchmark
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    for setting in args.with_settings:
        if (why := refusal(setting, device, args.dtype)) is not None:
            raise SystemExit(f"rtvideo bench pipeline: --with {setting} is refused on {device}: {why}")
    if args.versus is not None:
        with Progress("bench pipeline", unit="chunk", quiet=args.json) as progress:
            summary = _versus(args, progress)
        if not args.json:
            each = summary["variants"].values() if args.versus == ALL else [summary]
            for one_variant in each:
                _print_rounds(one_variant)
            for variant, why in summary.get("refused", {}).items():
                print(f"{variant}: refused: {why}")
        print(json.dumps(summary))
        return 0
    with Progress("bench pipeline", unit="chunk", quiet=args.json) as progress:
        summary = run(
            args.preset,
            args.width,
            args.height,
            args.chunks,
            args.steps,
            args.device,
            dtype=args.dtype,
            vae_dtype=args.vae_dtype,
            warm=args.warm,
            profile=args.profile,
            compile=args.compile,
            sessions=args.sessions,
            with_settings=args.with_settings,
            tiny_decoder=args.tiny_decoder,
            progress=progress,
        )
    if not args.json:
        p = summary["per_chunk_ms"]
        print(
            f"{summary['preset']} {summary['width']}x{summary['height']} on {summary['device']}"
            f"{' with ' + ','.join(summary['with']) if summary['with'] else ''}: "
            f"warm-up {summary['warm_up_s']:.2f} s, first chunk {summary['time_to_first_chunk_s']:.3f} s; "
            f"per chunk denoise {p['denoise_ms']:.1f} ms, "
            f"commit {p['commit_ms']:.1f} ms, decode {p['decode_ms']:.1f} ms; "
            f"{summary['generated_fps']:.1f} fps generated vs {summary['playback_fps']:g} playback"
        )
        for side in summary["side_by_side"] or []:
            print(
                f"{side['sessions']} sessions: {side['one_row_fps']:.1f} fps one row a forward, "
                f"{side['batched_fps']:.1f} fps batched ({side['batched_over_one_row']:.2f}x)"
            )
        line, lapped = summary["decode_overlap"]["in_line"], summary["decode_overlap"]["overlapped"]
        print(
            f"decode in line: first chunk {line['time_to_first_chunk_s']:.3f} s, {line['fps']:.1f} fps; "
            f"overlapped: first chunk {lapped['time_to_first_chunk_s']:.3f} s, {lapped['fps']:.1f} fps "
            f"({summary['decode_overlap']['fps_overlapped_over_in_line']:.2f}x)"
        )
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
