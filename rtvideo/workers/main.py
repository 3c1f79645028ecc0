"""Entry point of a worker process (spawned by ``rtvideo.engine.client.engine_client.EngineClient``).

Rank 0 builds its pipeline, warms it up (``rtvideo.workers.warmup``), settles the
device memory its sessions may hold, with ``EngineConfig.pp`` > 1 splits the
transformer's blocks by measured cost and starts the other pipeline ranks
(``rtvideo.workers.parallel``: they live and die with it, as one group), wires the control plane, the
control-receiver thread and the engine loop together, says READY, and runs
the loop until shutdown. On a pipeline that cannot be built it says so
(``WorkerStartupFailed``) and exits 1; on an engine bug it says
``EngineDead`` and exits 2. It ignores SIGINT and SIGTERM, which a terminal or
a process-group kill also delivers to it: the parent decides when to stop (and
drains sessions first), and if the parent dies the receiver notices through
the liveness pipe. Only SIGKILL ends a worker behind its parent's back.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import os
import signal
import sys
import threading
import traceback
from multiprocessing.connection import Connection

import msgspec
import zmq

from rtvideo.engine.chunk_cost import ChunkCostModel
from rtvideo.engine.config import EngineConfig, PipelineSpec
from rtvideo.engine.control import ControlPlane
from rtvideo.engine.loop import EngineLoop
from rtvideo.engine.messages import (
    ChunkReady,
    EngineDead,
    ModelLimits,
    StartSession,
    WorkerExiting,
    WorkerReady,
    WorkerStartupFailed,
)
from rtvideo.engine.receiver import ControlReceiver
from rtvideo.engine.transport import Endpoints, ResultSender
from rtvideo.workers import process_log
from rtvideo.workers.calibrate import Calibration, calibrate
from rtvideo.workers.cpu_threads import oversubscribed, usable_cores
from rtvideo.workers.decode_stage import decode_batch_rows
from rtvideo.workers.device_info import describe_device
from rtvideo.workers.executor import LocalExecutor
from rtvideo.workers.os_threads import decode_nice
from rtvideo.workers.parallel.group import decode_placement
from rtvideo.workers.parallel.ring import RingRunner
from rtvideo.workers.parent_watch import ParentWatch
from rtvideo.workers.pipelines import DEFAULT_START, build_pipeline, known_prompts
from rtvideo.workers.pipelines.capabilities import device_type
from rtvideo.workers.runner import ModelRunner
from rtvideo.workers.warmup import warm_up

log = logging.getLogger("rtvideo.worker")


def run_worker(
    config: EngineConfig, endpoints: Endpoints, parent_alive: Connection | None, rank: int = 0, site=None
) -> None:
    """Serve as worker rank 0 until shutdown; exits the process. ``parent_alive``:
    the liveness pipe from the API process that spawned this worker; None for a
    worker started by a launcher (``rtvideo.workers.launch``), whose group meets at
    ``site`` (``rtvideo.workers.parallel.group.LaunchSite``) and which says
    ``WorkerExiting`` before it exits."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    process_log.configure(f"worker[{rank}]", config.log_level)
    followers = _start_followers(config, site)  # before this process's first thread
    watch = None if parent_alive is None else ParentWatch(parent_alive)  # until the receiver watches the pipe
    context = zmq.Context()
    sender = ResultSender(endpoints.results)
    group = None
    ending = threading.Lock()  # held by whichever path says EngineDead first
    try:
        if config.cpu_threads is not None:
            import torch

            torch.set_num_threads(config.cpu_threads)
        pipeline = build_pipeline(_rank_0_spec(config, site), config.max_batch_rows)
        if config.pp > 1:  # the other ranks build theirs while this one warms up and measures
            group = _spawn_ranks(config, pipeline, sender, ending, site, followers)
        warm_up_s = warm_up(pipeline)
        cpu_threads = _cpu_threads(config, pipeline, warm_up_s)
        calibration = _calibrate(config, pipeline)  # before the budget: its peak is part of the transient
        budget = config.session_memory_bytes
        if budget is None:
            budget = pipeline.session_memory_budget()
        placement, decoder_split = "first", 0  # with one rank, it decodes every chunk
        if group is not None:
            placement = decode_placement(config, pipeline)
            inline = not _overlap_decode(config, pipeline)
            decoder_split = _start_ranks(config, pipeline, group, decode_inline=inline, split=placement == "split")
        limits = _served_limits(config, pipeline, calibration)
        # After the ranks took their blocks: a session's state is then what one rank's device holds of it.
        _check_default_admitted(pipeline, limits, budget)
    except Exception as error:
        # The API process says why in one line (the reason travels in WorkerStartupFailed); the traceback at debug.
        log.debug("could not build or warm up pipeline %r", config.pipeline.name, exc_info=True)
        sender.send(WorkerStartupFailed(rank=rank, error=f"{type(error).__name__}: {error}"))
        if group is not None:
            group.close()
        elif followers is not None:  # started, never told the store (the pipeline failed, or cannot be split)
            followers.close()
        sender.close()
        context.term()
        _exit(1)

    if warm_up_s:
        log.info("pipeline %r warmed up in %.2f s", pipeline.name, warm_up_s)
    runner = ModelRunner(pipeline) if group is None else RingRunner(pipeline, group)
    grouping = config.group_chunk_steps and pipeline.supports_chunk_step_grouping
    if budget is not None:
        log.info("open sessions may hold %.2f GiB of memory", budget / 2**30)
    costs = ChunkCostModel(calibration.samples)
    control = ControlPlane(
        config,
        runner.describe,
        sender.send,
        memory_budget=budget,
        costs=costs,
        max_pixels=limits.max_pixels,
        pixels_derived=limits.max_pixels_derived,
    )

    def send(message) -> None:  # the loop's results: every chunk made refines the cost model
        if isinstance(message, ChunkReady):
            costs.observe(message)
        sender.send(message)

    overlap = _overlap_decode(config, pipeline)
    nice = decode_nice(config.decode_nice, device_type(pipeline) or "cpu", config.pp)
    # With pipeline ranks, rank 0's decode stage gets a lane per rank (its own thread mostly waits on the ring),
    # or the sessions' decodes are shared out over the ranks.
    lanes = config.pp if group is not None else 1
    stage = None
    if placement != "first":
        from rtvideo.workers.parallel.rank_decode import RankDecodeStage

        stage = functools.partial(RankDecodeStage, group=group, split=decoder_split, nice=nice)
        if decoder_split:
            log.info("sessions' decoders split over two ranks, %d stages on rank 0", decoder_split)
        else:
            log.info("sessions decode on the rank given each (pp_decode %s)", config.pp_decode)
    executor = LocalExecutor(
        runner,
        control.is_stopping,
        control.wake,
        overlap_decode=overlap,
        decode_lanes=lanes,
        batch_decodes=decode_batch_rows(pipeline),
        decode_stage=stage,
        decode_nice=nice,
    )
    loop = EngineLoop(
        config,
        control,
        executor,
        send,
        grouping=grouping,
        max_rows=pipeline.max_batch_rows,
        align_chunks=_align_chunks(config, pipeline),
    )
    launched = parent_alive is None

    def terminated(reason: str) -> None:  # a Terminate from the API process: its last word, then exit 4
        sender.send(WorkerExiting(code=4, reason=f"terminated by the API process: {reason}"))
        sender.close(timeout=2.0)

    if watch is not None:
        watch.stop()
    receiver = ControlReceiver(
        context,
        endpoints.control,
        control,
        None if launched else parent_alive.fileno(),
        silent_after_s=config.orphan_after_s if launched else None,
        on_terminate=terminated,
    )
    receiver.start()
    if launched:  # the launcher tears a group down with SIGTERM (a rank died, or it was stopped): say so, exit
        signal.signal(signal.SIGTERM, lambda *_: _ended_by_launcher(sender))
    sender.send(
        WorkerReady(
            rank=rank,
            pid=os.getpid(),
            pipeline=pipeline.name,
            supports_chunk_step_grouping=pipeline.supports_chunk_step_grouping,
            grouping=grouping,
            max_sessions=config.max_sessions,
            defaults=pipeline.describe(DEFAULT_START),  # its state_bytes as the ranks' split makes it
            session_memory_bytes=budget,
            max_batch_rows=pipeline.max_batch_rows,
            overlap_decode=overlap,
            limits=limits,
            pipeline_ranks=() if group is None else tuple(group.pids()),
            blocks_per_rank=() if group is None else tuple(len(blocks) for blocks in group.splits),
            chunk_costs=calibration.samples,
            max_realtime_load=config.max_realtime_load,
            prompts=known_prompts(config.pipeline),
            cpu_threads=cpu_threads,
            device=describe_device(pipeline.device),
        )
    )
    exit_code, why = 0, "shut down"
    try:
        loop.run()
    except Exception as error:
        log.exception("engine loop failed")
        detail = "".join(traceback.format_exception_only(error)).strip()
        ending.acquire()  # a rank's death may be saying why already (and exiting): it is the reason then
        reason = group.dead_reason(wait_s=1.0) if group is not None else None
        why = reason or f"engine loop failed: {detail}"
        sender.send(EngineDead(reason=why))
        exit_code = 2
    finally:
        receiver.stop()
        if group is not None:
            group.close(broken=exit_code != 0)
        if launched:
            sender.send(WorkerExiting(code=exit_code, reason=why))
        sender.close()
        context.term()
    _exit(exit_code)


def _exit(code: int) -> None:
    """End the worker process now, its sockets closed and its logs flushed.
    Skips the interpreter's finalisation, which with torch and diffusers loaded
    takes most of a second and holds nothing the worker still needs: every
    thread and socket of its own has ended by now."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def _ended_by_launcher(sender: ResultSender) -> None:
    """SIGTERM to a launched worker: its launcher is ending the group (a rank died,
    or the launcher itself was stopped). The API process hears why (its sessions
    fail, and it waits for the group the launcher starts next); exit 143."""

    def end() -> None:
        sender.send(WorkerExiting(code=143, reason="its launcher ended the group (SIGTERM)"))
        sender.close(timeout=2.0)
        os._exit(143)

    threading.Thread(target=end, name="launcher-ended", daemon=True).start()


def _rank_0_spec(config: EngineConfig, site) -> PipelineSpec:
    """The pipeline rank 0 builds: the configured one, on rank 0's device where
    the blocks are split over ranks (``rtvideo.workers.parallel.placement``: ranks
    spawned on this host are checked to have a device each first)."""
    if config.pp == 1:
        return config.pipeline
    from rtvideo.workers.parallel.placement import check_host, rank_device, rank_spec

    if site is None:
        check_host(config)
    device = rank_device(config, 0)
    if device.type == "cuda":
        import torch

        torch.cuda.set_device(device)  # NCCL's communicator follows the current device
    return rank_spec(config, 0)


def _calibrate(config: EngineConfig, pipeline) -> Calibration:
    """Measure what a chunk costs (``rtvideo.workers.calibrate``), unless nothing would use
    it: the frame bound configured and admission by chunk cost off. With the
    frame bound configured (``max_pixels``), only what admission needs: the
    frame bound is never derived then."""
    if config.max_pixels is not None and config.max_realtime_load is None:
        return Calibration((), None, 0.0)
    calibration = calibrate(pipeline, config.max_realtime_load or 1.0, derive_bound=config.max_pixels is None)
    for sample in calibration.samples:
        log.info(
            "a %dx%d chunk: %.1f ms a denoise step, %.1f ms the rest (medians of up to %d measurements)",
            sample.width,
            sample.height,
            1000 * sample.step_s,
            1000 * sample.chunk_s,
            calibration.repeats,
        )
    if calibration.spread is not None:
        least, median, most = calibration.spread
        log.info(
            "calibrated in %.2f s: one session runs in real time up to %d pixels a frame "
            "(min/median/max over %d measurements of each frame: %d/%d/%d)",
            calibration.seconds,
            calibration.realtime_pixels,
            calibration.repeats,
            least,
            median,
            most,
        )
    elif calibration.samples and config.max_pixels is not None:
        log.info(
            "calibrated in %.2f s: chunk costs for admission only; the frame bound is max_pixels, %d pixels",
            calibration.seconds,
            config.max_pixels,
        )
    return calibration


def _served_limits(config: EngineConfig, pipeline, calibration: Calibration) -> ModelLimits:
    """The pipeline's limits with the worker's frame bound: ``max_pixels`` as
    configured, else the calibrated real-time area (``max_pixels_derived``)."""
    limits = pipeline.limits()
    if config.max_pixels is not None:
        return msgspec.structs.replace(limits, max_pixels=config.max_pixels, max_pixels_derived=False)
    derived = calibration.realtime_pixels
    return msgspec.structs.replace(limits, max_pixels=derived, max_pixels_derived=derived is not None)


def _check_default_admitted(pipeline, limits: ModelLimits, budget: int | None) -> None:
    """This worker's own admission (a configured ``max_pixels``, the memory for
    sessions) against the sessions the model makes: ``ValueError`` naming the
    setting when it would admit none (not even the smallest frame), a warning
    when it would refuse the default (every request that gives no size is then
    refused: a server may mean that, its sessions asking for smaller frames).
    A measured ``max_pixels`` is never below the default."""
    defaults = pipeline.describe(DEFAULT_START)
    side = limits.size_multiple
    smallest = pipeline.describe(StartSession(session_id="smallest", prompt="smallest", width=side, height=side))
    w, h = defaults.width, defaults.height
    if limits.max_pixels is not None and not limits.max_pixels_derived:
        if side * side > limits.max_pixels:
            raise ValueError(
                f"max_pixels {limits.max_pixels} is below the smallest frame the model makes, {side}x{side}: "
                "no session could be admitted"
            )
        if w * h > limits.max_pixels:
            log.warning(
                "max_pixels %d is below the model's default session, %dx%d: sessions must ask for a smaller size",
                limits.max_pixels,
                w,
                h,
            )
    if budget is not None:
        if smallest.state_bytes > budget:
            raise ValueError(
                f"session_memory_gib: sessions may hold {budget / 2**20:.2f} MiB of memory, and the smallest "
                f"session, {side}x{side}, needs {smallest.state_bytes / 2**20:.2f} MiB: no session could be admitted"
            )
        if defaults.state_bytes > budget:
            log.warning(
                "session memory: the model's default %dx%d session needs %.2f MiB and sessions may hold %.2f MiB: "
                "sessions must ask for a smaller size",
                w,
                h,
                defaults.state_bytes / 2**20,
                budget / 2**20,
            )


def _cpu_threads(config: EngineConfig, pipeline, warm_up_s: float) -> int | None:
    """The CPU threads rank 0's kernels run on: with pipeline ranks, the cores
    shared out (``_start_ranks`` sets them); else as configured (set before
    the pipeline was built), or, unset, measured on a thread as the
    executor's (``rtvideo.workers.cpu_threads``) and applied here, before the
    executor and decode threads start; torch's count where ``OMP_NUM_THREADS``
    set it (the operator's), or where the pipeline runs no warm-up (a chunk
    would take minutes: a model directory on a CPU). None on a GPU."""
    import torch

    if device_type(pipeline) != "cpu":
        return None
    if config.pp > 1:
        from rtvideo.workers.parallel.group import rank_threads

        return rank_threads(config.pp)
    if config.cpu_threads is not None:
        if (warning := oversubscribed(config.cpu_threads, usable_cores())) is not None:
            log.warning("%s", warning)
        return config.cpu_threads
    chunks = pipeline.warm_up_chunks
    if chunks <= 0 or os.environ.get("OMP_NUM_THREADS"):
        return torch.get_num_threads()
    from rtvideo.workers.cpu_threads import measure_cpu_threads

    shapes = 2 if pipeline.max_batch_rows > 1 else 1  # the warm-up's chunks: alone, then batched (workers.warmup)
    chosen, _ = measure_cpu_threads(pipeline, warm_up_s / (shapes * chunks))
    if chosen is None:
        return torch.get_num_threads()
    torch.set_num_threads(chosen)
    return chosen


def _overlap_decode(config: EngineConfig, pipeline) -> bool:
    """Whether chunks decode on a stage of their own (a thread; a CUDA stream on a
    GPU) while the next chunk denoises: as configured, else where the pipeline
    says it pays, and always with pipeline ranks: rank 0's own thread is then
    mostly waiting on the ring, so the decode stage has a core to itself."""
    if config.overlap_decode is not None:
        return config.overlap_decode
    return config.pp > 1 or pipeline.decode_overlap_pays


def _align_chunks(config: EngineConfig, pipeline) -> bool:
    """Whether the scheduler lines sessions up so that their chunks end together
    (``ChunkScheduler`` ``align_chunks``): on one rank whose chunks that end
    together commit and decode as one batch, in line or on the decode stage:
    it takes batched forwards and decodes batches (``decode_batch``)."""
    return config.pp == 1 and pipeline.max_batch_rows > 1 and pipeline.capabilities.decode_batch


def _start_followers(config: EngineConfig, site):
    """Ranks 1..``config.pp``-1 of a group this worker starts (not launched:
    ``site`` None), started now, while this process is what the fork server
    made of it (``rtvideo.workers.parallel.group.FollowerProcesses``): the
    worker's modules are imported first, so that they begin with them. None
    with one rank, or launched, and where they could not be started here:
    ``RankGroup.spawn`` then starts them once the pipeline is built, where a
    failure is the start's, said as every other one is."""
    if config.pp == 1 or site is not None:
        return None
    try:
        for module in config.worker_modules:  # a fork server started for another configuration may lack them
            importlib.import_module(module)
        from rtvideo.workers.parallel.group import FollowerProcesses

        return FollowerProcesses(config)
    except Exception as error:
        log.warning(
            "pipeline ranks not started first (%s: %s): started once the pipeline is built", type(error).__name__, error
        )
        return None


def _spawn_ranks(
    config: EngineConfig, pipeline, sender: ResultSender, ending: threading.Lock, site=None, followers=None
):
    """Form the group of ranks 1..``config.pp``-1 (``followers``, started at this
    worker's start; they build their pipelines meanwhile); a rank that dies
    later ends this worker (``EngineDead``, then exit 3), so the API process
    restarts the group as one. A launched group (``site``) is started
    already: only its sockets listen here."""
    from rtvideo.workers.parallel.group import RankGroup

    if not pipeline.capabilities.pipeline_ranks:
        raise ValueError(f"pp: the {pipeline.name!r} pipeline cannot be split over pipeline ranks")
    if pipeline.num_blocks < config.pp:
        raise ValueError(
            f"pp: the model has {pipeline.num_blocks} transformer blocks: "
            f"it cannot be split over {config.pp} pipeline ranks"
        )

    def on_death(reason: str) -> None:
        if not ending.acquire(blocking=False):
            return  # the loop failed first and is ending the worker, naming this death
        log.error("%s: ending this worker, so the group restarts as one", reason)
        sender.send(EngineDead(reason=reason))
        if site is not None:  # launched: the API process learns of the exit by its last word
            sender.send(WorkerExiting(code=3, reason=reason))
        sender.close(timeout=2.0)  # waits until the messages have left the process
        os._exit(3)

    group = RankGroup(config, on_death, site)
    group.spawn(followers)
    return group


def _start_ranks(config: EngineConfig, pipeline, group, decode_inline: bool, split: bool) -> int:
    """Split the blocks over the ranks by measured cost, keep rank 0's, hand the
    others theirs and join them; with ``split`` (the decoder split over two
    ranks), returns where it changes rank (the stages rank 0 runs; else 0)."""
    import torch

    from rtvideo.workers.parallel.group import rank_threads
    from rtvideo.workers.parallel.partition import measure_costs, rank_seconds, split_blocks, split_decoder
    from rtvideo.workers.parallel.placement import rank_device

    if rank_device(config, 0).type == "cpu":  # the ranks share the cores: measure as they will run, alone
        torch.set_num_threads(rank_threads(config.pp))
        group.wait_loaded()
    costs = measure_costs(pipeline, decode_inline=decode_inline)
    splits = split_blocks(costs, config.pp)
    log.info(
        "blocks split over %d ranks: %s (measured ms per pass: blocks %s, first rank +%.2f, last rank +%.2f)",
        config.pp,
        ", ".join(f"{r.start}..{r.stop - 1}" for r in splits),
        ", ".join(f"{c * 1000:.2f}" for c in costs.blocks),
        costs.first_extra * 1000,
        costs.last_extra * 1000,
    )
    decoder_split = 0
    if split:
        per_chunk = [seconds * costs.passes for seconds in rank_seconds(costs, splits)]
        stages = pipeline.decode_stage_seconds()
        decoder_split = split_decoder(stages, per_chunk[0], min(per_chunk[1:]))
        log.info(
            "decoder split over two ranks: %d of %d stages on rank 0 (measured ms per chunk: stages %s)",
            decoder_split,
            len(stages),
            ", ".join(f"{s * 1000:.1f}" for s in stages),
        )
    pipeline.own_blocks(splits[0], most_per_rank=max(len(split) for split in splits))
    pipeline.chunks_in_flight = config.lookahead
    group.start(splits)
    return decoder_split
