"""``rtvideo bench pp``: what temporal pipeline parallelism buys on this machine.

Real worker processes over the given model (default: the tiny preset), side by
side in one run: each configuration starts a fresh engine, runs ``sessions``
concurrent sessions of ``chunks`` chunks at ``size`` x ``size`` (a
configuration of fewer sessions proportionally more each: ``session_chunks``),
and reports frames per second (every frame of every session over the wall
time from the first start to the last chunk) and, from the worker's
``EngineStats``, every
rank's busy and bubble fraction over the run (bubble: the share of its time
inside micro-steps spent waiting on the ring) and the mean rows per
micro-step; and where the CPU went (``cpu``, from ``/proc``, Linux only):
each rank's threads' CPU seconds over the same wall time, by thread name,
this process's (the client receiving the chunks), their total and the cores
it kept busy. With the cores full, the total against one rank's is what
caps the ratio of frames per second. Configurations:

- ``pp1-1t``: one rank, one CPU thread (the baseline the issue's targets use);
- ``pp1-2t``: one rank, two threads (the honest baseline on two cores);
- ``pp2``: two ranks, one thread each, the ring on the ranks' own sockets,
  decodes placed by ``pp_decode`` ``auto`` (on a CPU: each session decoded
  whole on one of the ranks, the sessions shared out);
- ``pp2-gloo``: the same over ``torch.distributed`` point-to-point (gloo;
  ``pp_transport`` ``torch``), side by side with ``pp2``;
- ``pp2-decode-split``: the same with every session's decoder split over
  the two ranks, a latent frame at a time, a round of their chunks decoded
  as one batch (``pp_decode`` ``split``), side by side with ``pp2``;
- ``pp2-decode-first``: the same with rank 0 decoding every session on a
  lane per rank (``pp_decode`` ``first``), side by side with ``pp2``;
- ``pp2-batch2``: two ranks with up to two rows per micro-step
  (``max_batch_rows`` 2: with four sessions and two ranks, the two sessions
  whose passes are not in the ring enter together), against ``pp1-batch4``,
  the same four sessions batched on one rank;
- ``pp2-stream``: two ranks with stream batch (one session's next chunk enters
  while the chunk before it is still in the ring), against which the
  output's difference from the exact one (``pp1-1t``, the same session and
  seed) is measured: mean and largest absolute difference in pixel levels
  (decodes by ``auto``: on a CPU, whole on one rank);
- ``pp2-stream-decode-split``: ``pp2-stream`` with its session's decoder
  split over the two ranks (``split``), side by side with it;
- ``pp2-nice0`` and ``pp2-stream-nice0``: ``pp2`` (four sessions) and
  ``pp2-stream`` with the decode threads at the ranks' own priority
  (``decode_nice`` 0) instead of the CPU's default 10 steps below
  (``rtvideo.workers.os_threads``), side by side with them;
- ``pp1-batch4`` and ``pp1-serial``: four sessions batched in one forward
  (``max_batch_rows`` 4) against the same four run one after another, one
  thread each.

With ranks, chunks decode on a stage of their own beside the ring: on the
tiny preset, whose VAE decode is most of the work, that is where the second
core pays.

The CPU thread count of a worker is its ``EngineConfig.cpu_threads``;
pipeline ranks take the cores shared out (one each on two
cores). With ``repeats`` above 1 every configuration runs once per round
and each ratio is the median of the rounds' ratios, each round's
configurations side by side (``ratios_per_round``). ``--only`` runs a
selection (``select``) at the same chunk counts, for more rounds of the
configurations a question is about. The last line printed is one JSON
object.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import time
from dataclasses import dataclass

from rtvideo.bench import thread_cpu
from rtvideo.bench.machine import this_machine
from rtvideo.engine.client.engine_client import EngineClient
from rtvideo.engine.config import EngineConfig, PipelineSpec
from rtvideo.engine.messages import (
    ChunkReady,
    EngineStats,
    InteractionApplied,
    InteractionQueued,
    InteractionRejected,
    InteractionSuperseded,
    SessionDone,
    SessionFailed,
    StartSession,
)
from rtvideo.engine.progress import Progress
from rtvideo.server.dispatch import TypeDispatcher


@dataclass(frozen=True)
class PpBenchOptions:
    model: str = "tiny"
    chunks: int = 6
    size: int = 64
    steps: int = 4
    repeats: int = 1


@dataclass(frozen=True)
class Config:
    name: str
    pp: int
    threads: int | None  # the worker's CPU threads (EngineConfig.cpu_threads); None: the ranks share the cores
    sessions: int
    max_batch_rows: int = 1
    serial: bool = False  # sessions one after another instead of together
    stream_batch: bool = False
    transport: str = "auto"  # EngineConfig.pp_transport
    decode: str = "auto"  # EngineConfig.pp_decode
    decode_nice: int | None = None  # EngineConfig.decode_nice


CONFIGS = (
    Config("pp1-1t", 1, 1, 1),
    Config("pp1-2t", 1, 2, 1),
    Config("pp2", 2, None, 1),
    Config("pp2-decode-split", 2, None, 1, decode="split"),
    Config("pp2-stream", 2, None, 1, stream_batch=True),
    Config("pp2-stream-decode-split", 2, None, 1, stream_batch=True, decode="split"),
    Config("pp2-stream-nice0", 2, None, 1, stream_batch=True, decode_nice=0),
    Config("pp1-1t", 1, 1, 4),
    Config("pp1-2t", 1, 2, 4),
    Config("pp2", 2, None, 4),
    Config("pp2-gloo", 2, None, 4, transport="torch"),
    Config("pp2-nice0", 2, None, 4, decode_nice=0),
    Config("pp2-decode-split", 2, None, 4, decode="split"),
    Config("pp2-decode-first", 2, None, 4, decode="first"),
    Config("pp2-batch2", 2, None, 4, max_batch_rows=2),
    Config("pp1-batch4", 1, 1, 4, max_batch_rows=4),
    Config("pp1-serial", 1, 1, 4, serial=True),
)


def select(only: str, configs=CONFIGS) -> tuple[Config, ...]:
    """The configurations ``only`` names, in the order it names them: a
    comma-separated list of ``NAME`` (every session count of that name) or
    ``NAME@SESSIONS`` (``pp2-stream@1``). ``ValueError`` names an entry that
    matches nothing, with the configurations there are."""
    chosen: list[Config] = []
    for entry in (part.strip() for part in only.split(",")):
        if not entry:
            continue
        name, at, sessions = entry.partition("@")
        matches = [c for c in configs if c.name == name and (not at or str(c.sessions) == sessions)]
        if not matches:
            there = ", ".join(f"{c.name}@{c.sessions}" for c in configs)
            raise ValueError(f"--only: no configuration {entry!r}; there are {there}")
        chosen += [c for c in matches if c not in chosen]
    if not chosen:
        raise ValueError("--only: name at least one configuration")
    return tuple(chosen)


def session_chunks(options: PpBenchOptions, config: Config, configs=CONFIGS) -> int:
    """Chunks each of ``config``'s sessions makes: ``options.chunks`` at the
    most sessions of ``configs``, proportionally more with fewer (one session
    of four: 4x), so that every configuration makes about as many chunks and
    runs for about as long (one session's 24 chunks of the tiny preset took
    under a second, shorter than this machine's swings in speed)."""
    most = max(c.sessions for c in configs)
    return options.chunks * max(1, most // config.sessions)


async def run_config(options: PpBenchOptions, config: Config, chunks: int | None = None) -> dict:
    """``config`` once on a fresh engine, its sessions ``chunks`` chunks each
    (default ``options.chunks``)."""
    chunks = options.chunks if chunks is None else chunks
    spec = (
        PipelineSpec(options.model, {"device": "cpu"})
        if options.model == "tiny"
        else PipelineSpec("causal_wan", {"model_dir": options.model})
    )
    engine_config = EngineConfig(
        pipeline=spec,
        pp=config.pp,
        cpu_threads=config.threads,
        stream_batch=config.stream_batch,
        pp_transport=config.transport,
        pp_decode=config.decode,
        decode_nice=config.decode_nice,
        max_batch_rows=config.max_batch_rows,
        max_sessions=max(4, config.sessions),
        startup_timeout_s=600,
        max_undelivered_seconds=1e9,  # nobody reads the media here: never hold a session for it
        max_pixels=1 << 30,  # a measurement beyond real time: no size bound, no admission by cost
        max_realtime_load=None,
    )
    client = EngineClient(engine_config)
    await client.start()
    try:
        await client.probe()
        before = client.stats
        starts = [
            StartSession(
                session_id=f"bench-{i}",
                prompt=f"bench prompt {i}",
                seed=i,
                width=options.size,
                height=options.size,
                num_chunks=chunks,
                num_inference_steps=options.steps,
            )
            for i in range(config.sessions)
        ]
        ranks = [client.worker_pid, *(client.ready.pipeline_ranks if client.ready else ())]
        watched = [os.getpid(), *ranks]
        cpu_before = thread_cpu.sample(watched)
        began = time.perf_counter()
        payloads: dict[str, list[bytes]] = {start.session_id: [] for start in starts}
        frames = 0
        if config.serial:
            for start in starts:
                frames += await _run(client, start, payloads[start.session_id])
        else:
            runs = (_run(client, start, payloads[start.session_id]) for start in starts)
            frames = sum(await asyncio.gather(*runs))
        wall = time.perf_counter() - began
        cpu_after = thread_cpu.sample(watched)
        await client.probe()
        after = client.stats
    finally:
        await client.shutdown()
    return {
        "config": config.name,
        "sessions": config.sessions,
        "pp": config.pp,
        "chunks_per_session": chunks,
        "fps": frames / wall,
        "wall_s": wall,
        "frames": frames,
        **_figures(before, after),
        "cpu": _cpu(cpu_before, cpu_after, ranks, wall),
        "_payloads": payloads["bench-0"] if config.sessions == 1 else None,
    }


class SessionRun:
    """One session's results, each to its type's handler (``results``, a
    ``rtvideo.server.dispatch`` table: one entry per result a session's handle
    yields), which says whether the session is over: its chunks' frames
    counted and their payloads kept; a failure raises, naming the session."""

    def __init__(self, session_id: str, payloads: list[bytes]) -> None:
        self.session_id = session_id
        self.payloads = payloads
        self.frames = 0
        self.results: TypeDispatcher[bool] = TypeDispatcher(
            "bench pp result",
            {
                ChunkReady: self._on_chunk,
                SessionDone: self._on_done,
                SessionFailed: self._on_failed,
                InteractionQueued: self._on_interaction,
                InteractionApplied: self._on_interaction,
                InteractionRejected: self._on_interaction,
                InteractionSuperseded: self._on_interaction,
            },
        )

    def _on_chunk(self, message: ChunkReady) -> bool:
        self.frames += message.num_frames
        self.payloads.append(message.payload)
        return False

    def _on_done(self, message: SessionDone) -> bool:
        return True

    def _on_failed(self, message: SessionFailed) -> bool:
        raise RuntimeError(f"session {self.session_id} did not complete: {message}")

    def _on_interaction(self, message) -> bool:  # the bench sends none: nothing to do
        return False


async def _run(client: EngineClient, start: StartSession, payloads: list[bytes]) -> int:
    handle = await client.start_session(start)
    run = SessionRun(start.session_id, payloads)
    while not run.results(await handle.next(600.0)):
        pass
    return run.frames


def _figures(before: EngineStats | None, after: EngineStats | None) -> dict:
    if after is None:
        return {}
    old = {f.rank: f for f in before.ranks} if before is not None else {}
    ranks = []
    for figure in after.ranks:
        prior = old.get(figure.rank)
        busy = figure.busy_s - (prior.busy_s if prior else 0.0)
        wall = figure.wall_s - (prior.wall_s if prior else 0.0)
        ranks.append({"rank": figure.rank, "busy_s": busy, "bubble": 1.0 - busy / wall if wall > 0 else 0.0})
    steps = after.micro_steps - (before.micro_steps if before else 0)
    rows = after.rows - (before.rows if before else 0)
    return {"micro_steps": steps, "mean_rows": rows / steps if steps else 0.0, "ranks": ranks}


def _cpu(before: thread_cpu.Sample, after: thread_cpu.Sample, ranks: list[int], wall: float) -> dict | None:
    """Where the run's CPU went (``rtvideo.bench.thread_cpu``; None where it cannot be
    read): each rank's threads' CPU seconds by name, this process's (the
    client, receiving the chunks), their total, and the cores that total kept
    busy over the wall time."""
    if not after:
        return None
    per_rank = [thread_cpu.spent(before, after, [pid]) for pid in ranks]
    api = thread_cpu.spent(before, after, [os.getpid()])
    total = sum(sum(threads.values()) for threads in [*per_rank, api])
    return {
        "ranks": [{name: round(s, 3) for name, s in threads.items()} for threads in per_rank],
        "api_s": round(sum(api.values()), 3),
        "total_s": round(total, 3),
        "cores_busy": round(total / wall, 3) if wall > 0 else None,
    }


def stream_difference(exact: list[bytes] | None, streamed: list[bytes] | None) -> dict | None:
    """How far stream batch's frames are from the exact ones (one session, same
    seed): per chunk after the first, the mean absolute difference in pixel
    levels (of 255); and whether chunk 0, which has nothing before it, is equal."""
    if not exact or not streamed or len(exact) != len(streamed):
        return None
    import numpy as np

    def levels(payload: bytes):
        return np.frombuffer(payload, np.uint8).astype(np.int16)

    means = [float(np.abs(levels(a) - levels(b)).mean()) for a, b in zip(exact[1:], streamed[1:], strict=True)]
    largest = max((int(np.abs(levels(a) - levels(b)).max()) for a, b in zip(exact, streamed, strict=True)), default=0)
    return {
        "first_chunk_equal": exact[0] == streamed[0],
        "mean_abs_levels_per_chunk": [round(m, 3) for m in means],
        "mean_abs_levels": sum(means) / len(means) if means else 0.0,
        "max_abs_levels": largest,
    }


RATIOS = {
    "pp2_vs_pp1_1t_4_sessions": (("pp2", 4), ("pp1-1t", 4)),
    "pp2_vs_pp1_2t_4_sessions": (("pp2", 4), ("pp1-2t", 4)),
    "pp2_vs_pp1_1t_1_session": (("pp2", 1), ("pp1-1t", 1)),
    "pp2_vs_pp2_gloo_4_sessions": (("pp2", 4), ("pp2-gloo", 4)),
    "pp2_vs_pp2_decode_split_1_session": (("pp2", 1), ("pp2-decode-split", 1)),
    "pp2_vs_pp2_decode_split_4_sessions": (("pp2", 4), ("pp2-decode-split", 4)),
    "pp2_vs_pp2_decode_first_4_sessions": (("pp2", 4), ("pp2-decode-first", 4)),
    "pp2_batch2_vs_pp1_1t_4_sessions": (("pp2-batch2", 4), ("pp1-1t", 4)),
    "pp2_batch2_vs_pp1_batch4": (("pp2-batch2", 4), ("pp1-batch4", 4)),
    "batch4_vs_serial": (("pp1-batch4", 4), ("pp1-serial", 4)),
    "pp2_stream_vs_pp1_1t_1_session": (("pp2-stream", 1), ("pp1-1t", 1)),
    "pp2_stream_vs_pp2_1_session": (("pp2-stream", 1), ("pp2", 1)),
    "pp2_stream_vs_pp2_stream_nice0_1_session": (("pp2-stream", 1), ("pp2-stream-nice0", 1)),
    "pp2_stream_vs_pp2_stream_decode_split_1_session": (("pp2-stream", 1), ("pp2-stream-decode-split", 1)),
    "pp2_vs_pp2_nice0_4_sessions": (("pp2", 4), ("pp2-nice0", 4)),
}
"""Each ratio of the summary: (configuration, sessions) over (configuration, sessions)."""


def main(options: PpBenchOptions, as_json: bool = False, configs=CONFIGS, sized_as=None) -> int:
    """Every configuration once per round, ``options.repeats`` rounds: each
    ratio is the median of its rounds' ratios (configurations side by side in
    one round, minutes apart at most, on a machine whose speed drifts), and
    each configuration's result the fastest of its rounds. Sessions' chunk
    counts follow ``session_chunks`` over ``sized_as`` (default: ``configs``;
    a selection passes ``CONFIGS`` so its runs are as long as in a full one).
    On a terminal, a progress bar counts the configurations run."""
    runs: dict[tuple[str, int], list[dict]] = {}
    payloads: dict[str, list[bytes] | None] = {}
    progress = Progress("bench pp", options.repeats * len(configs), unit="config", quiet=as_json)
    with progress:
        for round_ in range(options.repeats):
            for config in configs:
                progress.describe(f"{config.name}@{config.sessions}")
                chunks = session_chunks(options, config, sized_as or configs)
                result = asyncio.run(run_config(options, config, chunks))
                progress.advance()
                kept = result.pop("_payloads")
                if kept is not None and round_ == 0:
                    payloads[config.name] = kept
                runs.setdefault((config.name, config.sessions), []).append(result)
                if not as_json:
                    ranks = result.get("ranks", [])
                    bubbles = ", ".join(f"rank {r['rank']} bubble {r['bubble']:.0%}" for r in ranks)
                    cpu = result.get("cpu")
                    if cpu:
                        bubbles += f"; {cpu['total_s']:.2f} s of CPU, {cpu['cores_busy']:.2f} cores"
                    line = f"{result['config']:>17} x{result['sessions']}: {result['fps']:7.1f} fps  ({bubbles})"
                    progress.print(f"round {round_ + 1}: {line}" if options.repeats > 1 else line)
    results = []
    for rounds in runs.values():
        best = max(rounds, key=lambda result: result["fps"])
        results.append({**best, "fps_per_round": [result["fps"] for result in rounds]})
    per_round = {name: _round_ratios(runs, a, b) for name, (a, b) in RATIOS.items()}
    summary = {
        "bench": "pp",
        "machine": this_machine(),
        "model": options.model,
        "size": options.size,
        "chunks": options.chunks,
        "rounds": options.repeats,
        "results": results,
        **{name: statistics.median(ratios) if ratios else None for name, ratios in per_round.items()},
        "ratios_per_round": {name: ratios for name, ratios in per_round.items() if ratios},
        "stream_batch_difference": stream_difference(payloads.get("pp1-1t"), payloads.get("pp2-stream")),
    }
    print(json.dumps(summary))
    return 0


def _round_ratios(runs: dict[tuple[str, int], list[dict]], a: tuple[str, int], b: tuple[str, int]) -> list[float]:
    """``a``'s frames per second over ``b``'s, round by round (both ran in each)."""
    pairs = zip(runs.get(a, []), runs.get(b, []), strict=False)  # a configuration left out has no rounds
    return [x["fps"] / y["fps"] for x, y in pairs if y["fps"]]
