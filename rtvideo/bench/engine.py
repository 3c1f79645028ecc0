"""``rtvideo bench engine``: the engine loop's own cost, and where interactions land.

Runs real worker processes over the stub pipeline with a fixed simulated step
time, so everything that is not the pipeline is overhead of ours.

Overhead. For each mode (grouped, ungrouped) and each steps-per-chunk count S
in 1..4, one session runs ``chunks`` chunks; the worker reports how long its
loop was busy and how much of that was inside pipeline calls. Overhead per
chunk is fitted as ``a + b * S``: ``b`` is the overhead each denoise step adds,
``a`` what each chunk adds. Grouping should shrink ``b`` to the runner's inner
loop; the figure "grouping removes" is ``1 - b_grouped / b_ungrouped``.

Interactions. One endless session per mode; after each received chunk the
client waits a random fraction of a chunk and sends a new prompt. Each
interaction's lag is the chunk it was applied at minus the chunk the worker
was generating when it accepted it (from the ``queued`` acknowledgement): the
engine's guarantee is exactly 1.

The last line printed is one JSON object.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from collections.abc import Awaitable
from dataclasses import dataclass

from rtvideo.bench.machine import this_machine
from rtvideo.bench.stats import percentiles
from rtvideo.engine.client.engine_client import EngineClient
from rtvideo.engine.client.session_handle import SessionHandle
from rtvideo.engine.config import EngineConfig, PipelineSpec
from rtvideo.engine.messages import (
    ChunkReady,
    Interaction,
    InteractionApplied,
    InteractionQueued,
    InteractionRejected,
    InteractionSuperseded,
    ProbeReply,
    SessionDone,
    SessionFailed,
    StartSession,
)
from rtvideo.engine.progress import Progress
from rtvideo.server.dispatch import TypeDispatcher

STEP_COUNTS = (1, 2, 3, 4)
ZERO_STEP_CHUNKS = 300


@dataclass(frozen=True)
class BenchOptions:
    step_ms: float = 10.0
    chunks: int = 20
    interactions: int = 20
    seed: int = 0
    repeats: int = 3  # runs per configuration; the quietest one counts
    spin: bool = True  # simulate steps by spinning (a hot CPU, as on a GPU sync) or sleeping


def _fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares ``y = a + b x``; returns (a, b)."""
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / sum((x - mean_x) ** 2 for x in xs)
    return mean_y - b * mean_x, b


async def _engine(options: BenchOptions, grouped: bool, step_ms: float) -> EngineClient:
    stub = {"step_time_s": step_ms / 1000.0, "spin": options.spin, "width": 16, "height": 16}
    # The decode in line: overhead is busy time less pipeline time, which holds while
    # one stage runs at a time (an overlapped decode would count its time twice).
    config = EngineConfig(
        pipeline=PipelineSpec("stub", stub),
        group_chunk_steps=grouped,
        max_sessions=1,
        overlap_decode=False,
        max_pixels=1 << 30,  # the engine's own overhead is measured: no start-up calibration, no admission by cost
        max_realtime_load=None,
    )
    client = EngineClient(config)
    await client.start()
    return client


def _delta(after: ProbeReply, before: ProbeReply) -> dict[str, float]:
    return {
        "busy_s": after.busy_s - before.busy_s,
        "pipeline_s": after.pipeline_s - before.pipeline_s,
        "steps": after.steps - before.steps,
        "chunks": after.chunks - before.chunks,
        "iterations": after.iterations - before.iterations,
    }


async def _overhead_once(client: EngineClient, chunks: int, steps: int, run: int) -> dict:
    before = await client.probe()
    started = time.perf_counter()
    start = StartSession(
        session_id=f"overhead-{steps}-{run}", prompt="bench", num_chunks=chunks, num_inference_steps=steps
    )
    async for message in await client.start_session(start):
        if isinstance(message, SessionFailed):
            raise RuntimeError(message.message)
    wall = time.perf_counter() - started
    d = _delta(await client.probe(), before)
    overhead_s = d["busy_s"] - d["pipeline_s"]
    return {
        "steps_per_chunk": steps,
        "iterations": d["iterations"],
        "loop_overhead_per_chunk_ms": overhead_s / d["chunks"] * 1000.0,
        "loop_overhead_per_step_ms": overhead_s / d["steps"] * 1000.0,
        "end_to_end_over_pipeline": wall / d["pipeline_s"],
    }


async def _overhead(client: EngineClient, options: BenchOptions, step_ms: float, progress: Progress) -> dict:
    """Per steps-per-chunk count, the quietest of ``repeats`` runs (the least
    disturbed by the rest of the machine), then the linear fit."""
    chunks = options.chunks if step_ms > 0 else ZERO_STEP_CHUNKS  # free steps: afford many chunks
    runs = []
    for steps in STEP_COUNTS:
        tries = []
        for i in range(options.repeats):
            tries.append(await _overhead_once(client, chunks, steps, i))
            progress.advance()
        runs.append(min(tries, key=lambda r: r["loop_overhead_per_chunk_ms"]))
    per_chunk_ms = [r["loop_overhead_per_chunk_ms"] for r in runs]
    per_chunk, per_step = _fit([float(s) for s in STEP_COUNTS], per_chunk_ms)
    figures = {"runs": runs, "fit_per_chunk_ms": per_chunk, "fit_per_step_ms": per_step}
    if step_ms > 0:
        figures["per_step_overhead_ratio"] = per_step / step_ms
        figures["per_chunk_overhead_ratio"] = per_chunk_ms[-1] / (STEP_COUNTS[-1] * step_ms)
    return figures


class InteractionsRun:
    """The interactions' session (``_interactions``): each result it yields goes
    to its type's handler (``results``, a ``rtvideo.server.dispatch`` table: one entry
    per result a session's handle yields), which says whether the run is over."""

    def __init__(self, handle: SessionHandle, options: BenchOptions, rng: random.Random, chunk_s: float) -> None:
        self.handle, self.options, self.rng, self.chunk_s = handle, options, rng, chunk_s
        self.queued: dict[str, InteractionQueued] = {}
        self.lags: list[int] = []
        self.latencies: list[float] = []
        self.at_boundary = 0
        self.in_flight: asyncio.Task | None = None
        self.results: TypeDispatcher[Awaitable[bool]] = TypeDispatcher(
            "bench engine result",
            {
                ChunkReady: self._on_chunk,
                InteractionQueued: self._on_queued,
                InteractionApplied: self._on_applied,
                InteractionRejected: self._on_not_applied,
                InteractionSuperseded: self._on_not_applied,
                SessionDone: self._on_end,
                SessionFailed: self._on_end,
            },
        )

    async def _send_later(self, event_id: str, delay: float) -> None:
        await asyncio.sleep(delay)
        await self.handle.interact(event_id, Interaction(prompt=f"prompt {event_id}"))

    async def _on_chunk(self, message: ChunkReady) -> bool:
        """A chunk came: the next interaction goes out at a random point of the next chunk."""
        if self.in_flight is None and len(self.lags) < self.options.interactions:
            event_id = f"e{len(self.lags) + 1}"
            self.in_flight = asyncio.create_task(self._send_later(event_id, self.rng.uniform(0.0, self.chunk_s)))
        return False

    async def _on_queued(self, message: InteractionQueued) -> bool:
        self.queued[message.event_id] = message
        return False

    async def _on_applied(self, message: InteractionApplied) -> bool:
        """Its lag: the chunk it applied at less the one in progress when it was accepted."""
        q = self.queued[message.event_id]
        if q.in_progress_chunk_index is None:
            self.at_boundary += 1
            reference = q.expected_chunk_index - 1  # accepted between chunks: the last one done
        else:
            reference = q.in_progress_chunk_index
        self.lags.append(message.generation_chunk_index - reference)
        self.latencies.append(message.queued_to_applied_ms)
        self.in_flight = None
        if len(self.lags) == self.options.interactions:
            await self.handle.stop()
        return False

    async def _on_not_applied(self, message: InteractionRejected | InteractionSuperseded) -> bool:
        raise RuntimeError(f"interaction {message.event_id} did not apply: {message}")

    async def _on_end(self, message: SessionDone | SessionFailed) -> bool:
        return True


async def _interactions(client: EngineClient, options: BenchOptions, rng: random.Random) -> dict:
    """Send one interaction at a time, at a random point of a chunk, and see
    where each lands; the next goes out once the previous one was applied."""
    chunk_s = 4 * options.step_ms / 1000.0
    handle = await client.start_session(StartSession(session_id="interactions", prompt="p0", num_inference_steps=4))
    run = InteractionsRun(handle, options, rng, chunk_s)
    async for message in handle:
        if await run.results(message):
            break
    lags, latencies = run.lags, run.latencies
    return {
        "n": len(lags),
        "accepted_between_chunks": run.at_boundary,
        "queued_to_applied_ms": percentiles(latencies),
        "queued_to_applied_chunks": percentiles([ms / (chunk_s * 1000.0) for ms in latencies]),
        "lag_chunks": percentiles([float(x) for x in lags]),
        "lag_exactly_one_chunk": bool(lags) and all(x == 1 for x in lags),
    }


async def _mode(options: BenchOptions, grouped: bool, rng: random.Random, progress: Progress) -> dict:
    """One mode's figures; ``progress`` advanced by each overhead run and the interactions' session."""
    mode = "grouped" if grouped else "ungrouped"
    figures = {}
    progress.describe(f"{mode}: starting the worker")
    client = await _engine(options, grouped, options.step_ms)
    try:
        progress.describe(f"{mode}: overhead")
        figures["overhead"] = await _overhead(client, options, options.step_ms, progress)
        progress.describe(f"{mode}: interactions")
        figures["interactions"] = await _interactions(client, options, rng)
        progress.advance()
    finally:
        await client.shutdown()
    progress.describe(f"{mode}: starting the worker")
    client = await _engine(options, grouped, 0.0)
    try:
        progress.describe(f"{mode}: overhead with 0 ms steps")
        figures["overhead_zero_step"] = await _overhead(client, options, 0.0, progress)
    finally:
        await client.shutdown()
    return figures


def bench_runs(options: BenchOptions) -> int:
    """What ``run``'s progress counts: per mode, the overhead runs at both step
    times and the interactions' session."""
    return 2 * (2 * len(STEP_COUNTS) * options.repeats + 1)


def _removed(summary: dict, key: str) -> float | None:
    grouped, ungrouped = summary["grouped"][key]["fit_per_step_ms"], summary["ungrouped"][key]["fit_per_step_ms"]
    return 1.0 - grouped / ungrouped if ungrouped > 0 else None


async def run(options: BenchOptions, progress: Progress | None = None) -> dict:
    progress = progress or Progress.silent()
    progress.expect(bench_runs(options))
    rng = random.Random(options.seed)
    summary: dict = {
        "bench": "engine",
        "machine": this_machine(),
        "step_ms": options.step_ms,
        "step_wait": "spin" if options.spin else "sleep",
        "chunks_per_run": options.chunks,
        "repeats": options.repeats,
    }
    for mode, grouped in (("grouped", True), ("ungrouped", False)):
        summary[mode] = await _mode(options, grouped, rng, progress)
    removed = _removed(summary, "overhead")
    removed_zero = _removed(summary, "overhead_zero_step")
    summary["grouping_removes_per_step_overhead"] = removed
    summary["grouping_removes_per_step_overhead_zero_step"] = removed_zero
    worst = max(summary[m]["overhead"]["per_step_overhead_ratio"] for m in ("grouped", "ungrouped"))
    summary["targets"] = {
        "overhead_le_2pct_of_step": worst <= 0.02,
        "grouping_removes_ge_90pct": removed is not None and removed >= 0.9,
        "grouping_removes_ge_90pct_zero_step": removed_zero is not None and removed_zero >= 0.9,
        "lag_exactly_one_chunk": all(
            summary[m]["interactions"]["lag_exactly_one_chunk"] for m in ("grouped", "ungrouped")
        ),
    }
    return summary


def main(options: BenchOptions, as_json: bool) -> int:
    with Progress("bench engine", unit="run", quiet=as_json) as progress:
        summary = asyncio.run(run(options, progress))
    if not as_json:
        for mode in ("grouped", "ungrouped"):
            o, z, i = summary[mode]["overhead"], summary[mode]["overhead_zero_step"], summary[mode]["interactions"]
            step_us, chunk_us, free_us = (
                1000 * x for x in (o["fit_per_step_ms"], o["fit_per_chunk_ms"], z["fit_per_step_ms"])
            )
            print(
                f"{mode:>9}: per step {step_us:.1f} us ({o['per_step_overhead_ratio']:.2%} of a step), "
                f"per chunk {chunk_us:.1f} us; with 0 ms steps {free_us:.1f} us per step; "
                f"lag {i['lag_chunks']}, queued->applied p50 {i['queued_to_applied_ms'].get('p50', 0):.1f} ms"
            )
    print(json.dumps(summary))
    return 0
