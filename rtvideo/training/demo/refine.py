"""``rtvideo refine-demo-decoder``: train the demo codec's causal refiner.

Training (torch), in the command's process. The demo model's latents are a fixed projection of 8x8
blocks of 4 frames (``rtvideo.workers.demo.codec``), whose linear inverse loses most
of the motion inside a block. The refiner (``CausalRefiner``) learns to put it
back from the latent frame and the one before it. It is trained here by
regression, with no transformer involved: scenes clips (``scenes.DECODER_FIT``
stream of the seed) are encoded by the model directory's own codec, each
clip's latents get Gaussian noise of a random level up to ``noise`` (the
transformer's latents are never exact), and the refined decode, streamed as
the served pipeline streams it (the first latent frame alone, then the
rest with the cache), is fitted to the clip's frames (mean squared error).
Everything is a function of the seed. The model directory's ``vae/`` is then
replaced by the refined codec (same encoder, same latent space: the
transformer is untouched) and ``rtvideo.json`` records how it was made
(``demo.decoder``).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from rtvideo.engine.progress import Progress
from rtvideo.training.demo import scenes
from rtvideo.workers.demo import WEIGHTS
from rtvideo.workers.demo.codec import LinearVideoCodec

SIZE = 64


def clip_pixels(seed: int, index: int, chunks: int) -> tuple[torch.Tensor, bool]:
    """Clip ``index`` of the seed's decoder-fitting stream: ``[1, 3, frames, H, W]`` in
    [-1, 1], and whether it begins a stream."""
    clip = scenes.clip_for(seed, index, SIZE, SIZE, chunks, stream=scenes.DECODER_FIT)
    frames = scenes.render(clip, SIZE, SIZE)
    pixels = torch.from_numpy(frames).float().permute(3, 0, 1, 2).unsqueeze(0) / 127.5 - 1.0
    return pixels, clip.first_chunk == 0


def refined_copy(codec: LinearVideoCodec, width: int) -> LinearVideoCodec:
    """``codec`` with a fresh refiner of ``width`` (zero: decodes as ``codec`` does)."""
    config = {k: v for k, v in codec.config.items() if not k.startswith("_")}
    refined = LinearVideoCodec(**{**config, "refiner_width": width})
    refined.decoder.basis.copy_(codec.decoder.basis)
    refined.decoder.mean.copy_(codec.decoder.mean)
    return refined


def streamed_decode(codec: LinearVideoCodec, latents: torch.Tensor, first: bool) -> torch.Tensor:
    """The served pipeline's decode of a clip: a stream's first latent frame alone, then the rest."""
    cache = codec.new_cache()
    if not first:
        return codec.decode_stream(latents, cache, first=False)
    head = codec.decode_stream(latents[:, :, :1], cache, first=True)
    return torch.cat([head, codec.decode_stream(latents[:, :, 1:], cache, first=False)], dim=2)


def train(
    codec: LinearVideoCodec,
    steps: int,
    seed: int = 0,
    width: int = 96,
    batch: int = 8,
    chunks: int = 2,
    noise: float = 0.3,
    lr: float = 2e-3,
    log_every: int = 100,
    progress: Progress | None = None,
) -> tuple[LinearVideoCodec, float]:
    """A copy of ``codec`` with a refiner trained for ``steps`` steps; and the mean
    loss of the last ``log_every`` steps. ``progress`` counts the steps; the log's
    lines go through it."""
    progress = progress or Progress.silent()
    progress.expect(steps)
    torch.manual_seed(seed)
    refined = refined_copy(codec, width)
    parameters = list(refined.decoder.refiner.parameters())
    optimizer = torch.optim.AdamW(parameters, lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps)
    generator = torch.Generator().manual_seed(seed)
    losses: list[float] = []
    began = time.perf_counter()
    for step in range(steps):
        total = 0.0
        optimizer.zero_grad()
        for i in range(batch):
            pixels, first = clip_pixels(seed, step * batch + i, chunks)
            with torch.no_grad():
                latents = codec.encode_frames(pixels, first=first)
                level = noise * float(torch.rand((), generator=generator))
                latents = latents + level * torch.randn(latents.shape, generator=generator)
            decoded = streamed_decode(refined, latents, first)
            loss = torch.nn.functional.mse_loss(decoded, pixels) / batch
            loss.backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(parameters, 1.0)
        optimizer.step()
        schedule.step()
        losses.append(total)
        progress.advance()
        if log_every and (step + 1) % log_every == 0:
            mean = float(np.mean(losses[-log_every:]))
            line = {"step": step + 1, "loss": round(mean, 6), "s": round(time.perf_counter() - began, 1)}
            progress.print(json.dumps(line))
            progress.describe(f"loss {line['loss']}")
    return refined, float(np.mean(losses[-max(1, log_every) :]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="rtvideo refine-demo-decoder",
        description="Train the causal refiner of a demo model's decoder and write it into the model directory.",
    )
    parser.add_argument("--model", required=True, help="demo (the shipped model) or a demo model directory")
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--width", type=int, default=96, help="the refiner's channels")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--noise", type=float, default=0.3, help="largest noise level added to the latents")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    root = Path(WEIGHTS if args.model == "demo" else args.model)
    codec = LinearVideoCodec.from_pretrained(root, subfolder="vae", torch_dtype=torch.float32, local_files_only=True)
    base = refined_copy(codec, 0)  # the linear decode, whatever the directory held
    with Progress("refine-demo-decoder", args.steps, unit="step") as progress:
        refined, loss = train(base, args.steps, args.seed, args.width, noise=args.noise, lr=args.lr, progress=progress)
    refined.save_pretrained(root / "vae")
    meta = root / "rtvideo.json"
    data = json.loads(meta.read_text())
    data.setdefault("demo", {})["decoder"] = {
        "refiner_width": args.width,
        "steps": args.steps,
        "seed": args.seed,
        "noise": args.noise,
        "lr": args.lr,
        "loss": round(loss, 6),
    }
    meta.write_text(json.dumps(data, indent=2) + "\n")
    print(json.dumps({"model": str(root), **data["demo"]["decoder"]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
