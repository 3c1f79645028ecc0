"""``rtvideo eval-demo``: does each chunk a demo model serves show what its prompt says?

Torch side, in the command's process: the model directory is loaded by the serving loader
and run through the served pipeline (``CausalWanPipeline``) by ``ChunkDriver``,
micro-step by micro-step through ``ModelRunner`` as the worker runs it, several
sessions a forward (``--rows``) as the worker batches them. The streams
(``metrics.switch_trials`` and ``metrics.long_trials``, fixed by ``--seed``;
every session's noise seeded from it) are:

- ``--trials`` streams of ``--chunks`` chunks whose prompt changes, at chunk
  ``--switch-at``, to a caption that differs in colour, shape and direction
  (an interaction at that chunk's boundary, the server's default ``soft``
  prompt change);
- ``--long-streams`` streams of ``--long-chunks`` chunks under one prompt.

Every chunk is judged by ``metrics`` (``classify`` on the raw RGB frames the
pipeline returns). Prints the bars, then a JSON summary as its last line
(``--json``: only that): the figures, each bar with its value and whether it
passes, the model's trained steps (its ``rtvideo.json``), the time taken.
``--ground-truth`` judges the scenes' own rendering of the same streams
instead of a model: the judge's self-check, every figure 1.0.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from rtvideo.engine.progress import Progress
from rtvideo.training.demo import metrics
from rtvideo.training.demo.metrics import StreamJudge, Trial
from rtvideo.workers.demo import WEIGHTS


def _groups(trials: list[Trial], rows: int) -> list[list[Trial]]:
    """Trials in groups of at most ``rows``, each of one length (they run in lockstep)."""
    groups: list[list[Trial]] = []
    for trial in trials:
        if groups and len(groups[-1]) < rows and groups[-1][0].chunks == trial.chunks:
            groups[-1].append(trial)
        else:
            groups.append([trial])
    return groups


def judge_model(
    model: str, trials: list[Trial], rows: int = 8, device: str = "cpu", progress: Progress | None = None
) -> list[StreamJudge]:
    """Run every trial through the served pipeline of ``model`` (a model directory,
    ``demo`` or ``tiny``), ``rows`` sessions a forward, and judge each chunk
    (``progress`` advanced by each chunk made)."""
    from rtvideo.engine.messages import StartSession
    from rtvideo.workers.chunk_driver import ChunkDriver
    from rtvideo.workers.pipelines.causal_wan import build

    progress = progress or Progress.silent()
    progress.describe(f"loading {model}")
    if model in ("tiny", "demo"):
        pipeline = build(preset=model, device=device, max_batch_rows=rows)
    else:
        pipeline = build(model_dir=model, device=device, max_batch_rows=rows)
    driver = ChunkDriver(pipeline)
    progress.describe("")
    judges: list[StreamJudge] = []
    try:
        for group in _groups(trials, rows):
            names = [trial.name for trial in group]
            driver.open(*(StartSession(session_id=t.name, prompt=t.attributes[0].caption, seed=t.seed) for t in group))
            group_judges = [StreamJudge(trial) for trial in group]
            for chunk in range(group[0].chunks):
                interactions = {}
                for trial in group:
                    prompt = trial.prompt_at(chunk) if chunk > 0 else None
                    if prompt is not None:
                        interactions[trial.name] = (prompt, 0)
                outputs = driver.run(names, 1, interactions)
                for judge in group_judges:
                    [output] = outputs[judge.trial.name]
                    shape = (output.num_frames, output.height, output.width, 3)
                    judge.add(np.frombuffer(output.payload, dtype=np.uint8).reshape(shape))
                progress.advance(len(group))
            driver.release(*names)
            judges += group_judges
    finally:
        driver.close()
    return judges


def judge_ground_truth(trials: list[Trial], size: int = 64, progress: Progress | None = None) -> list[StreamJudge]:
    """Judge the scenes' own rendering of every trial (no model; ``progress``
    advanced by each chunk judged)."""
    progress = progress or Progress.silent()
    judges = []
    for trial in trials:
        judge = StreamJudge(trial)
        for frames in metrics.ground_truth(trial, size):
            judge.add(frames)
            progress.advance()
        judges.append(judge)
    return judges


def trained_steps(model: str) -> int | None:
    """The steps the model directory was trained for (``rtvideo.json``'s ``demo.trained_steps``)."""
    file = Path(WEIGHTS if model == "demo" else model) / "rtvideo.json"
    if not file.is_file():
        return None
    return json.loads(file.read_text()).get("demo", {}).get("trained_steps")


def record(model: str, name: str, summary: dict) -> None:
    """Keep ``summary`` in ``model``'s ``rtvideo.json`` as ``demo.evaluation[name]``."""
    file = Path(WEIGHTS if model == "demo" else model) / "rtvideo.json"
    data = json.loads(file.read_text())
    data.setdefault("demo", {}).setdefault("evaluation", {})[name] = summary
    file.write_text(json.dumps(data, indent=2) + "\n")


def evaluate(
    model: str | None,
    trials: int = 60,
    chunks: int = 6,
    switch_at: int = 3,
    long_streams: int = 5,
    long_chunks: int = 200,
    seed: int = 0,
    rows: int = 8,
    progress: Progress | None = None,
) -> dict:
    """The summary of one evaluation; ``model`` None judges ground truth.
    ``progress`` counts the chunks judged."""
    streams = metrics.switch_trials(trials, chunks, switch_at, seed) + metrics.long_trials(
        long_streams, long_chunks, seed
    )
    progress = progress or Progress.silent()
    progress.expect(sum(trial.chunks for trial in streams))
    began = time.perf_counter()
    if model is None:
        judges = judge_ground_truth(streams, progress=progress)
    else:
        judges = judge_model(model, streams, rows, progress=progress)
    seconds = time.perf_counter() - began
    summary = metrics.summarize(judges)
    judged = sum(len(j.readings) for j in judges)
    summary.update(
        model=model or "ground-truth",
        trained_steps=None if model is None else trained_steps(model),
        seed=seed,
        trials=trials,
        chunks=chunks,
        switch_at=switch_at,
        long_streams=long_streams,
        long_chunks=long_chunks,
        rows=rows,
        chunks_judged=judged,
        seconds=round(seconds, 1),
    )
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rtvideo eval-demo", description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--model",
        help="demo (the shipped model), or a demo model directory (train-demo's OUT/model; copy it while training)",
    )
    source.add_argument("--ground-truth", action="store_true", help="judge the scenes' own clips (self-check)")
    parser.add_argument("--trials", type=int, default=60, help="streams with a prompt change (default 60)")
    parser.add_argument("--chunks", type=int, default=6, help="chunks per such stream (default 6)")
    parser.add_argument("--switch-at", type=int, default=3, help="the chunk the prompt changes at (default 3)")
    parser.add_argument("--long-streams", type=int, default=5, help="streams under one prompt (default 5)")
    parser.add_argument("--long-chunks", type=int, default=200, help="chunks per long stream (default 200)")
    parser.add_argument("--seed", type=int, default=0, help="prompts and noise (default 0)")
    parser.add_argument("--rows", type=int, default=8, help="sessions per forward (default 8)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--json", action="store_true", help="print only the JSON summary")
    parser.add_argument(
        "--record",
        metavar="NAME",
        help="also keep the summary in the model directory's rtvideo.json as demo.evaluation.NAME "
        "(`full`: the figures the docs quote; `check`: the short run the tests repeat)",
    )
    args = parser.parse_args(argv)
    if args.record and (args.ground_truth or args.model == "tiny"):
        parser.error("--record needs a model directory (or demo) to record into")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    with Progress("eval-demo", unit="chunk", quiet=args.json) as progress:
        summary = evaluate(
            None if args.ground_truth else args.model,
            trials=args.trials,
            chunks=args.chunks,
            switch_at=args.switch_at,
            long_streams=args.long_streams,
            long_chunks=args.long_chunks,
            seed=args.seed,
            rows=args.rows,
            progress=progress,
        )
    if args.record:
        record(args.model, args.record, summary)
    if not args.json:
        for name, bar in summary["bars"].items():
            verdict = {True: "passes", False: "FAILS", None: "not measured"}[bar["passes"]]
            value = "-" if bar["value"] is None else f"{bar['value']:.3f}"
            print(f"{name:<12} {value:>6}  bar {bar['bar']:.2f}  {verdict}")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
