"""``rtvideo bench pipeline``: what one chunk of the causal Wan pipeline costs.

Runs the pipeline in this process, one session, no server, through the
worker's own path (``workers.chunk_driver``: micro-steps through the
``ModelRunner``, the device synchronised around the commit and the decode
so their times are the device's): the worker's warm-up (``workers.warmup``, reported as
``warm_up_s``), then a fresh session's time to its first chunk (prompt
encode + first chunk, as a user of a started server sees it), then per chunk
the split between the boundary and denoise steps, the commit forward and the
VAE decode, and generated frames per second against playback (``fps``). ``--preset wan2.1-1.3b`` builds the real 1.3B
transformer with random weights (a GPU machine's measurement; bf16).
``--profile FILE`` writes a torch profiler table of one steady chunk.
``--sessions N`` builds the pipeline for N rows a forward (``max_batch_rows``,
so the warm-up runs a batched forward of N rows too), then runs N sessions
side by side, one row per forward and all N rows per forward, and reports
both throughputs. ``decode_overlap`` compares, side by side in the same run,
the decode in line and on the decode stage (a thread of its own while the
next chunk denoises): time to the first chunk and frames per second.
The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import msgspec
import torch

from engine.messages import StartSession
from engine.progress import Progress
from workers.chunk_driver import ChunkDriver
from workers.pipelines.causal_wan import CausalWanPipeline
from workers.pipelines.presets import WAN_1_3B_TRANSFORMER, Components, build_tiny, load_directory
from workers.runner import StageCall
from workers.warmup import warm_up

OVERLAP_ROUNDS = 2
"""Rounds of the decode overlap's comparison (``_decode_overlap``)."""


def _components(preset: str, device: str | None) -> Components:
    """The preset's components; a model directory's (``demo`` is the shipped one's)
    for any other name that is a directory."""
    if preset == "demo" or Path(preset).is_dir():
        from workers.demo import WEIGHTS

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
    sessions: int = 1,
    progress: Progress | None = None,
) -> dict:
    """The summary (module docstring); ``progress`` counts every chunk made (``run_chunks``)."""
    progress = progress or Progress.silent()
    progress.expect(run_chunks(chunks, sessions))
    progress.describe("building the pipeline")
    built = time.perf_counter()
    pipeline = _build(preset, device, dtype, vae_dtype, warm, compile, sessions)
    build_s = time.perf_counter() - built
    progress.describe("warming up")
    warm_up_s = warm_up(pipeline, width, height)  # at the measured size
    progress.describe("one session")
    budget = pipeline.session_memory_budget()
    on_gpu = pipeline.device.type == "cuda"
    start = StartSession(
        session_id="bench", prompt="a red fox in the snow", width=width, height=height, num_inference_steps=steps
    )
    calls: list[StageCall] = []
    driver = ChunkDriver(pipeline, synchronize=partial(_wait_around_split, pipeline), on_stage=calls.append)
    began = _synchronized(pipeline)
    [state] = driver.open(start)
    rows = []
    first_chunk_s = None
    for chunk in range(chunks):
        profiled = profile is not None and chunk == min(2, chunks - 1)
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
    steady = rows[1:] or rows
    frames = sum(r["frames"] for r in steady)
    seconds = sum(r["total_ms"] for r in steady) / 1e3
    geometry = state.geometry
    driver.release("bench")
    side_by_side = None
    if sessions > 1:
        progress.describe(f"{sessions} sessions")
        one_row = _sessions_fps(pipeline, start, sessions, chunks, batched=False, progress=progress)
        batched = _sessions_fps(pipeline, start, sessions, chunks, batched=True, progress=progress)
        side_by_side = {
            "sessions": sessions,
            "one_row_fps": one_row,
            "batched_fps": batched,
            "batched_over_one_row": batched / one_row,
        }
    progress.describe("decode overlap")
    overlap = _decode_overlap(pipeline, start, chunks, progress=progress)
    return {
        "bench": "pipeline",
        "preset": preset,
        "device": str(pipeline.device),
        "dtype": str(pipeline.dtype).replace("torch.", ""),
        "vae_dtype": str(pipeline.vae_dtype).replace("torch.", ""),
        "threads": torch.get_num_threads(),
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "compiled": compile,
        "width": geometry.width,
        "height": geometry.height,
        "steps": geometry.num_inference_steps,
        "chunks": chunks,
        "build_s": build_s,
        "warm_up_s": warm_up_s,
        "time_to_first_chunk_s": first_chunk_s,
        "per_chunk_ms": {
            key: statistics.median(r[key] for r in steady)
            for key in ("denoise_ms", "commit_ms", "decode_ms", "total_ms")
        },
        "state_bytes": geometry.state_bytes,
        "session_memory_budget": budget,
        "peak_device_bytes": torch.cuda.max_memory_allocated(pipeline.device) if on_gpu else None,
        "generated_fps": frames / seconds,
        "playback_fps": geometry.fps,
        "realtime_factor": frames / seconds / geometry.fps,
        "side_by_side": side_by_side,
        "decode_overlap": overlap,
    }


def run_chunks(chunks: int, sessions: int = 1, rounds: int = OVERLAP_ROUNDS) -> int:
    """The chunks ``run`` makes: ``chunks`` of one session, with ``sessions`` above 1
    that many sessions' twice (one row a forward, then batched), and the decode
    overlap's two modes in each of ``rounds`` rounds, ``session_chunks`` each."""
    side_by_side = 2 * sessions * session_chunks(chunks) if sessions > 1 else 0
    return chunks + side_by_side + 2 * rounds * session_chunks(chunks)


def session_chunks(chunks: int) -> int:
    """The chunks of one fresh session timed as ``one_session`` times it: the first, then at least one."""
    return 1 + max(1, chunks - 1)


def _build(
    preset: str,
    device: str | None,
    dtype: str | None,
    vae_dtype: str | None,
    warm: bool = True,
    compile: bool = False,
    sessions: int = 1,
    tiny_decoder: str | None = None,
    commit_from_last_step: bool = False,
    quantize: str | None = None,
    cuda_graphs: bool | str = False,
) -> CausalWanPipeline:
    return CausalWanPipeline(
        _components(preset, device),
        device=device,
        dtype=dtype,
        vae_dtype=vae_dtype,
        warm_up_chunks=2 if warm else 0,
        compile=compile,
        max_batch_rows=sessions,
        tiny_decoder=tiny_decoder,
        commit_from_last_step=commit_from_last_step,
        quantize=quantize,
        cuda_graphs=cuda_graphs,
    )


def _versus(args: argparse.Namespace, progress: Progress) -> dict:
    """``--versus``: the variant against these options, side by side (``bench.versus``)."""
    from bench.versus import ALL, versus, versus_all

    def build(
        compile: bool = args.compile,
        vae_dtype: str | None = args.vae_dtype,
        tiny_decoder: str | None = None,
        commit_from_last_step: bool = False,
        quantize: str | None = None,
        cuda_graphs: bool | str = False,
    ) -> CausalWanPipeline:
        tiny_decoder = args.tiny_decoder or tiny_decoder
        return _build(
            args.preset,
            args.device,
            args.dtype,
            vae_dtype,
            compile=compile,
            tiny_decoder=tiny_decoder,
            commit_from_last_step=commit_from_last_step,
            quantize=quantize,
            cuda_graphs=cuda_graphs,
        )

    start = StartSession(
        session_id="versus",
        prompt="a red fox in the snow",
        width=args.width,
        height=args.height,
        num_inference_steps=args.steps,
    )
    try:
        if args.versus == ALL:
            return versus_all(
                build, start, args.chunks, args.rounds, cudnn_benchmark=args.cudnn_benchmark, progress=progress
            )
        return versus(
            build,
            args.versus,
            start,
            args.chunks,
            args.rounds,
            cudnn_benchmark=args.cudnn_benchmark,
            progress=progress,
        )
    except ValueError as error:  # a comparison that would measure nothing, named
        raise SystemExit(f"--versus {args.versus}: {error}") from None


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
) -> float:
    """Frames per second generated by ``count`` sessions stepped together, each
    step one forward over all rows (``batched``) or one forward per row; the
    first chunk is not timed."""
    progress = progress or Progress.silent()
    driver = ChunkDriver(pipeline, max_rows=count if batched else 1)
    ids = [f"side-{i}" for i in range(count)]
    driver.open(*(msgspec.structs.replace(start, session_id=sid, seed=i) for i, sid in enumerate(ids)))
    driver.run(ids)  # the first chunk
    progress.advance(count)
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
) -> dict:
    """One session with the decode in line (after the commit, in the same
    micro-step) and on the decode stage (a thread of its own, while the next
    chunk denoises), alternated ``rounds`` times, the best of each counted:
    time to the first chunk (open to its frames) and frames per second over
    the chunks after it."""
    best: dict[str, dict] = {}
    for _ in range(rounds):
        for mode, overlap in (("in_line", False), ("overlapped", True)):
            figures = one_session(pipeline, start, chunks, overlap_decode=overlap, progress=progress)
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


def main(argv: list[str] | None = None) -> int:
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
    parser.add_argument("--sessions", type=int, default=1, help="also compare N sessions batched vs one row a forward")
    from bench.versus import ALL, VARIANTS  # it imports this module

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
        help="--versus tiny-decoder: its weights (default: the model directory's, else random weights)",
    )
    parser.add_argument("--json", action="store_true", help="print only the JSON summary")
    args = parser.parse_args(argv)
    torch.backends.cudnn.benchmark = args.cudnn_benchmark
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
            progress=progress,
        )
    if not args.json:
        p = summary["per_chunk_ms"]
        print(
            f"{summary['preset']} {summary['width']}x{summary['height']} on {summary['device']}: "
            f"warm-up {summary['warm_up_s']:.2f} s, first chunk {summary['time_to_first_chunk_s']:.3f} s; "
            f"per chunk denoise {p['denoise_ms']:.1f} ms, "
            f"commit {p['commit_ms']:.1f} ms, decode {p['decode_ms']:.1f} ms; "
            f"{summary['generated_fps']:.1f} fps generated vs {summary['playback_fps']:g} playback"
        )
        if summary["side_by_side"]:
            side = summary["side_by_side"]
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
