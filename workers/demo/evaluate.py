"""Judge a demo model through the served pipeline: does each chunk show what its prompt says?

Worker side, in process (``python -m workers.demo.evaluate --model DIR``):
for a fixed set of prompts (``--prompts`` captions drawn from the
``EVALUATION`` stream's seed), one stream each of ``--chunks`` chunks through
``ChunkDriver`` (the worker's path), with the prompt switching to another
caption at chunk ``--switch-at``; every chunk is read by ``classify`` and
compared with the caption in force. Prints a JSON summary as its last line:
colour / shape / direction accuracy, the new colour's share from the switch
on, and presence (frames showing an object). A first cut of issue 13's
evaluation; its bars and its 200-chunk streams come later.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
import torch

from engine.messages import StartSession
from workers.chunk_driver import ChunkDriver
from workers.demo import scenes
from workers.demo.classify import classify
from workers.pipelines.causal_wan import build


def prompt_pairs(count: int, seed: int = 0) -> list[tuple[scenes.Attributes, scenes.Attributes]]:
    """``count`` (before, after) attribute pairs; the after differs in every attribute."""
    rng = np.random.default_rng([seed, scenes.EVALUATION])
    pairs = []
    for _ in range(count):
        before = scenes.ALL_ATTRIBUTES[int(rng.integers(len(scenes.ALL_ATTRIBUTES)))]
        others = [
            a
            for a in scenes.ALL_ATTRIBUTES
            if a.colour != before.colour and a.shape != before.shape and a.direction != before.direction
        ]
        pairs.append((before, others[int(rng.integers(len(others)))]))
    return pairs


def evaluate(model_dir: str, prompts: int, chunks: int, switch_at: int, seed: int = 0) -> dict:
    pipeline = build(model_dir=model_dir, device="cpu")
    driver = ChunkDriver(pipeline)
    hits = {"colour": [], "shape": [], "direction": []}
    switched_colour, presence = [], []
    for number, (before, after) in enumerate(prompt_pairs(prompts, seed)):
        sid = f"eval-{number}"
        driver.open(StartSession(session_id=sid, prompt=before.caption, seed=seed + number))
        for chunk in range(chunks):
            prompt = after.caption if chunk == switch_at else None
            output = driver.run_chunk(sid, prompt)
            frames = np.frombuffer(output.payload, dtype=np.uint8).reshape(-1, output.height, output.width, 3)
            reading = classify(frames)
            truth = after if chunk >= switch_at else before
            presence.append(reading.presence)
            for name in hits:
                hits[name].append(
                    reading.attributes is not None and getattr(reading.attributes, name) == getattr(truth, name)
                )
            if chunk >= switch_at:
                switched_colour.append(reading.attributes is not None and reading.attributes.colour == after.colour)
        driver.release(sid)
    summary = {name: round(float(np.mean(values)), 3) for name, values in hits.items()}
    summary["colour_after_switch"] = round(float(np.mean(switched_colour)), 3) if switched_colour else None
    summary["presence"] = round(float(np.mean(presence)), 3)
    summary.update(model=model_dir, prompts=prompts, chunks=chunks, switch_at=switch_at)
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workers.demo.evaluate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a demo model directory (train-demo's OUT/model)")
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--chunks", type=int, default=6)
    parser.add_argument("--switch-at", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(json.dumps(evaluate(args.model, args.prompts, args.chunks, args.switch_at)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
