"""Splitting the transformer's blocks over pipeline ranks by measured cost.

``split_blocks`` is pure: given each block's cost and the extra work the first
rank does per pass (embedding, the sampler step, and its share of prompt
encoding, boundaries and decoding) and the last rank does (the output head),
it returns the contiguous block ranges, one per rank, that minimise the
slowest rank's time per micro-step (the pipeline's pace). Every rank gets at
least one block. ``measure_costs`` times those parts on the pipeline itself,
at its default geometry, before the ranks start. ``split_decoder`` chooses
where a decode split over two ranks (``pp_decode`` ``split``) changes rank,
by the same rule.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StageCosts:
    """Seconds per pass: each block's forward, and the edges' extra work."""

    blocks: tuple[float, ...]
    first_extra: float = 0.0  # rank 0: embed, sampler step, amortised encode / boundary / decode
    last_extra: float = 0.0  # the last rank: the output head
    passes: int = 1  # passes a chunk takes (its denoise steps and the commit)


def split_blocks(costs: StageCosts, ranks: int) -> list[range]:
    """Contiguous ranges of ``range(len(costs.blocks))``, one per rank, at least
    one block each, minimising the largest per-rank cost (ties: the earliest
    split). ``ValueError`` when there are fewer blocks than ranks."""
    n = len(costs.blocks)
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    if n < ranks:
        raise ValueError(f"the model has {n} transformer blocks: it cannot be split over {ranks} pipeline ranks")
    prefix = [0.0]
    for cost in costs.blocks:
        prefix.append(prefix[-1] + cost)

    def stage(rank: int, start: int, stop: int) -> float:
        return prefix[stop] - prefix[start] + _extra(costs, rank, ranks)

    # best[r][i]: the smallest pace for ranks r.. over blocks i..n, and the split it takes
    best: dict[tuple[int, int], tuple[float, tuple[int, ...]]] = {}
    for rank in reversed(range(ranks)):
        for start in range(rank, n - (ranks - rank) + 1):
            if rank == ranks - 1:
                best[rank, start] = (stage(rank, start, n), (n,))
                continue
            options = []
            for stop in range(start + 1, n - (ranks - rank - 1) + 1):
                pace, rest = best[rank + 1, stop]
                options.append((max(stage(rank, start, stop), pace), (stop, *rest)))
            best[rank, start] = min(options, key=lambda option: option[0])
    stops = best[0, 0][1]
    starts = (0, *stops[:-1])
    return [range(a, b) for a, b in zip(starts, stops, strict=True)]


def pace(costs: StageCosts, split: Sequence[range]) -> float:
    """The slowest rank's cost per pass under ``split``."""
    return max(rank_seconds(costs, split))


def rank_seconds(costs: StageCosts, split: Sequence[range]) -> list[float]:
    """Each rank's cost per pass under ``split``."""
    return [sum(costs.blocks[i] for i in blocks) + _extra(costs, r, len(split)) for r, blocks in enumerate(split)]


def split_decoder(stages: Sequence[float], front_rank: float, back_rank: float) -> int:
    """How many of the decoder's stages (their seconds per chunk, ``stages``)
    run on the front rank, the rest on the back rank, beside what each does
    per chunk already (``front_rank``, ``back_rank``): the split, 1 to
    ``len(stages) - 1``, minimising the busier rank's time (ties: the fewer
    stages in front, as the front rank also plans). ``ValueError`` for fewer
    than two stages."""
    if len(stages) < 2:
        raise ValueError(f"a decoder of {len(stages)} stages cannot be split")
    total = sum(stages)
    best, best_pace = 1, float("inf")
    front = 0.0
    for split in range(1, len(stages)):
        front += stages[split - 1]
        slowest = max(front_rank + front, back_rank + total - front)
        if slowest < best_pace:
            best, best_pace = split, slowest
    return best


def _extra(costs: StageCosts, rank: int, ranks: int) -> float:
    """What rank ``rank`` of ``ranks`` does per pass beside its blocks."""
    return (costs.first_extra if rank == 0 else 0.0) + (costs.last_extra if rank == ranks - 1 else 0.0)


def measure_costs(pipeline, repeats: int = 3, decode_inline: bool = True) -> StageCosts:
    """Time each block, the embedding and the head on one forward of a
    throwaway session at the pipeline's default geometry (the best of
    ``repeats``: they only read), and the first rank's per-chunk work (the
    boundary, the sampler steps, the decode: once each, as a chunk runs them)
    spread over the chunk's passes (the decode only when it runs ``inline``
    on the first rank's thread, not as a stage of its own). The session is
    released."""
    from rtvideo.engine.messages import StartSession
    from rtvideo.workers.pipelines.base import BatchRow, StepBatch
    from rtvideo.workers.pipelines.wan_blocks import head, run_blocks

    sync = pipeline.synchronize if pipeline.capabilities.synchronize else lambda: None

    def timed(function, times: int = repeats):
        best, value = float("inf"), None
        for _ in range(times):
            sync()
            began = time.perf_counter()
            value = function()
            sync()
            best = min(best, time.perf_counter() - began)
        return best, value

    start = StartSession(session_id="rtvideo.partition", prompt="partition")
    prompt = pipeline.encode_prompt(start.prompt)
    session = pipeline.open(start, pipeline.describe(start), prompt)
    sid = start.session_id
    try:
        boundary_s, _ = timed(lambda: pipeline.boundary(session, 0), times=1)
        rows = StepBatch((BatchRow(sid, 0, 0),))
        embed_s, groups = timed(lambda: pipeline.embed_rows(rows, [session]))
        activations = groups[0][1]
        context = pipeline.context
        context.caches, context.grid = (session.kv,), activations.latent_shape[3:]
        try:
            blocks = []
            for index in range(pipeline.num_blocks):
                cost, activations = timed(
                    lambda i=index, a=activations: run_blocks(pipeline.transformer, a, range(i, i + 1))
                )
                blocks.append(cost)
        finally:
            context.caches = ()
        head_s, prediction = timed(lambda: head(pipeline.transformer, activations))
        steps = session.geometry.num_inference_steps
        sampler_s = 0.0
        for step in range(steps):
            cost, _ = timed(lambda s=step: pipeline.sampler_step(session, BatchRow(sid, 0, s), prediction), times=1)
            sampler_s += cost
        pipeline.commit(session, 0)
        decode_s, _ = timed(lambda: pipeline.decode(session, 0), times=1)
    finally:
        pipeline.release(session)
    passes = steps + 1
    first_extra = embed_s + sampler_s / steps + (boundary_s + (decode_s if decode_inline else 0.0)) / passes
    return StageCosts(tuple(blocks), first_extra=first_extra, last_extra=head_s, passes=passes)
