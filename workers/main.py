"""Entry point of a worker process (spawned by ``engine.client.EngineClient``).

Rank 0 builds its pipeline, warms it up (``workers.warmup``), settles the
device memory its sessions may hold, wires the control plane, the
control-receiver thread and the engine loop together, says READY, and runs
the loop until shutdown. On a pipeline that cannot be built it says so
(``WorkerStartupFailed``) and exits 1; on an engine bug it says
``EngineDead`` and exits 2. It ignores SIGINT and SIGTERM, which a terminal or
a process-group kill also delivers to it: the parent decides when to stop (and
drains sessions first), and if the parent dies the receiver notices through
the liveness pipe. Only SIGKILL ends a worker behind its parent's back.
"""

from __future__ import annotations

import logging
import os
import signal
import traceback
from multiprocessing.connection import Connection

import zmq

from engine.config import EngineConfig
from engine.control import ControlPlane
from engine.loop import EngineLoop
from engine.messages import EngineDead, StartSession, WorkerReady, WorkerStartupFailed
from engine.receiver import ControlReceiver
from engine.transport import Endpoints, ResultSender
from workers.executor import LocalExecutor
from workers.pipelines import build_pipeline
from workers.runner import ModelRunner
from workers.warmup import warm_up

log = logging.getLogger("rtvideo.worker")


def run_worker(config: EngineConfig, endpoints: Endpoints, parent_alive: Connection, rank: int = 0) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s worker[{rank}] %(levelname)s %(message)s")
    context = zmq.Context()
    sender = ResultSender(context, endpoints.results)
    try:
        pipeline = build_pipeline(config.pipeline, config.max_batch_rows)
        warm_up_s = warm_up(pipeline)
        budget = config.session_memory_bytes
        if budget is None:
            budget = pipeline.session_memory_budget()
    except Exception as error:
        log.exception("could not build or warm up pipeline %r", config.pipeline.name)
        sender.send(WorkerStartupFailed(rank=rank, error=f"{type(error).__name__}: {error}"))
        sender.close()
        context.term()
        raise SystemExit(1) from None

    if warm_up_s:
        log.info("pipeline %r warmed up in %.2f s", pipeline.name, warm_up_s)
    runner = ModelRunner(pipeline)
    grouping = config.group_chunk_steps and pipeline.supports_chunk_step_grouping
    if budget is not None:
        log.info("open sessions may hold %.2f GiB of device memory", budget / 2**30)
    control = ControlPlane(config, runner.describe, sender.send, memory_budget=budget)
    overlap = pipeline.decode_overlap_pays if config.overlap_decode is None else config.overlap_decode
    executor = LocalExecutor(runner, control.is_stopping, control.wake, overlap_decode=overlap)
    loop = EngineLoop(config, control, executor, sender.send, grouping=grouping, max_rows=pipeline.max_batch_rows)
    receiver = ControlReceiver(context, endpoints.control, control, parent_alive.fileno())
    receiver.start()
    sender.send(
        WorkerReady(
            rank=rank,
            pid=os.getpid(),
            pipeline=pipeline.name,
            supports_chunk_step_grouping=pipeline.supports_chunk_step_grouping,
            grouping=grouping,
            max_sessions=config.max_sessions,
            defaults=pipeline.describe(StartSession(session_id="defaults", prompt="defaults")),
            session_memory_bytes=budget,
            max_batch_rows=pipeline.max_batch_rows,
            overlap_decode=overlap,
        )
    )
    exit_code = 0
    try:
        loop.run()
    except Exception as error:
        log.exception("engine loop failed")
        detail = "".join(traceback.format_exception_only(error)).strip()
        sender.send(EngineDead(reason=f"engine loop failed: {detail}"))
        exit_code = 2
    finally:
        receiver.stop()
        sender.close()
        context.term()
    raise SystemExit(exit_code)
