"""``rtvideo bench pipeline``: what one chunk of the causal Wan pipeline costs.

Runs the pipeline in this process, one session, no server: time to the first
chunk (encode + first chunk), then per chunk the split between the denoise
steps, the commit forward and the VAE decode, and generated frames per second
against playback (``fps``). ``--preset wan2.1-1.3b`` builds the real 1.3B
transformer with random weights (a GPU machine's measurement; bf16). The last
line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from engine.messages import StartSession
from workers.pipelines.base import BatchRow, PipelineState, StepBatch
from workers.pipelines.causal_wan import CausalWanPipeline
from workers.pipelines.presets import WAN_1_3B_TRANSFORMER, Components, build_tiny


def _components(preset: str) -> Components:
    tiny = build_tiny()
    if preset == "tiny":
        return tiny
    if preset == "wan2.1-1.3b":
        from diffusers import AutoencoderKLWan, WanTransformer3DModel
        from transformers import UMT5Config, UMT5EncoderModel

        torch.manual_seed(0)
        transformer = WanTransformer3DModel(**WAN_1_3B_TRANSFORMER)
        vae = AutoencoderKLWan()  # the Wan2.1 VAE configuration
        text = UMT5EncoderModel(UMT5Config(vocab_size=384, d_model=4096, d_kv=64, d_ff=256, num_layers=1, num_heads=8))
        return Components(transformer, vae, text, tiny.tokenizer, text_length=512, default_size=(832, 480))
    raise SystemExit(f"unknown preset {preset!r}: tiny or wan2.1-1.3b")


def run(preset: str, width: int | None, height: int | None, chunks: int, steps: int, device: str | None) -> dict:
    built = time.perf_counter()
    pipeline = CausalWanPipeline(_components(preset), device=device)
    build_s = time.perf_counter() - built
    start = StartSession(
        session_id="bench", prompt="a red fox in the snow", width=width, height=height, num_inference_steps=steps
    )
    state = PipelineState("bench", start, pipeline.describe(start))
    began = pipeline._synchronized()
    pipeline.prepare_encode(state)
    rows = []
    first_chunk_s = None
    for chunk in range(chunks):
        state.chunk_index = chunk
        t0 = pipeline._synchronized()
        pipeline.prepare_next_chunk(state)
        for step in range(state.geometry.num_inference_steps):
            batch = StepBatch((BatchRow("bench", chunk, step),))
            [prediction] = pipeline.denoise_step(batch, [state])
            pipeline.step_scheduler(state, prediction)
        t1 = pipeline._synchronized()
        out = pipeline.post_decode(state)
        t2 = pipeline._synchronized()
        if first_chunk_s is None:
            first_chunk_s = t2 - began
        split = state.extra["post_decode_ms"]
        rows.append(
            {
                "frames": out.num_frames,
                "denoise_ms": (t1 - t0) * 1e3,
                "commit_ms": split["commit"],
                "decode_ms": split["decode"],
                "total_ms": (t2 - t0) * 1e3,
            }
        )
    steady = rows[1:] or rows
    frames = sum(r["frames"] for r in steady)
    seconds = sum(r["total_ms"] for r in steady) / 1e3
    fps = state.geometry.fps
    return {
        "bench": "pipeline",
        "preset": preset,
        "device": str(pipeline.device),
        "dtype": str(pipeline.dtype).replace("torch.", ""),
        "threads": torch.get_num_threads(),
        "width": state.geometry.width,
        "height": state.geometry.height,
        "steps": state.geometry.num_inference_steps,
        "chunks": chunks,
        "build_s": build_s,
        "time_to_first_chunk_s": first_chunk_s,
        "per_chunk_ms": {
            key: statistics.median(r[key] for r in steady)
            for key in ("denoise_ms", "commit_ms", "decode_ms", "total_ms")
        },
        "generated_fps": frames / seconds,
        "playback_fps": fps,
        "realtime_factor": frames / seconds / fps,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rtvideo bench pipeline", description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny", help="tiny | wan2.1-1.3b")
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--height", type=int, default=None)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    parser.add_argument("--json", action="store_true", help="print only the JSON summary")
    args = parser.parse_args(argv)
    summary = run(args.preset, args.width, args.height, args.chunks, args.steps, args.device)
    if not args.json:
        p = summary["per_chunk_ms"]
        print(
            f"{summary['preset']} {summary['width']}x{summary['height']} on {summary['device']}: "
            f"first chunk {summary['time_to_first_chunk_s']:.3f} s; per chunk denoise {p['denoise_ms']:.1f} ms, "
            f"commit {p['commit_ms']:.1f} ms, decode {p['decode_ms']:.1f} ms; "
            f"{summary['generated_fps']:.1f} fps generated vs {summary['playback_fps']:g} playback"
        )
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
