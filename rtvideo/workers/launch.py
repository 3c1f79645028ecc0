"""Entry point of a worker group started by a launcher, one process per rank:

    torchrun --nproc-per-node N [--nnodes M --rdzv-endpoint ...] -m rtvideo.workers.launch --api HOST:PORT

for an API process started with ``rtvideo serve --worker-listen HOST:PORT``
(``EngineConfig.worker_listen``), on this machine or another. The launcher
gives each process its rank and the group's size (``RANK``, ``WORLD_SIZE``)
and a rendezvous store (``MASTER_ADDR``, ``MASTER_PORT``); a single process
without a launcher is rank 0 of a group of one.

Rank 0 connects to the API process over TCP (control on PORT, results on
PORT + 1), says ``WorkerHello`` and takes the configuration it is answered
with (``AttachWorker``: the server's own, its ``pp`` set to the group's size),
leaves it in the store for the other ranks, then serves as a spawned worker
does (``rtvideo.workers.main.run_worker``), its pipeline ranks being the launcher's
other processes (``rtvideo.workers.parallel.group.LaunchSite``). The others build
their pipelines from that configuration and follow (``group.follow``).

Worker side; torch is imported here. Exit codes: those of ``run_worker``
(0 shut down, 1 could not start, 2 engine failure, 3 a rank died, 4
terminated by the API process), and 5 when no API process answered.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import logging
import os
import socket
import sys
import time

import msgspec
import zmq

from rtvideo.engine.config import EngineConfig, config_from_wire, config_to_wire
from rtvideo.engine.messages import AttachWorker, WorkerHello
from rtvideo.engine.transport import Endpoints, ResultSender, decode_control
from rtvideo.workers import process_log

log = logging.getLogger("rtvideo.launch")


def attach(endpoints: Endpoints, world: int, timeout_s: float) -> EngineConfig:
    """Say hello to the API process and return the configuration it answers with;
    ``TimeoutError`` when it does not answer within ``timeout_s`` (it may start
    after this process: the hello waits for it)."""
    sender = ResultSender(endpoints.results)
    context = zmq.Context()
    control = context.socket(zmq.PULL)
    control.setsockopt(zmq.LINGER, 0)
    control.connect(endpoints.control)
    try:
        sender.send(WorkerHello(host=socket.gethostname(), pid=os.getpid(), world_size=world))
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            if not control.poll(timeout=int(min(left, 1.0) * 1000)):
                continue
            message = decode_control(control.recv())
            if isinstance(message, AttachWorker):
                config = config_from_wire(message.config)
                return dataclasses.replace(config, pp=world, worker_listen=None)
            log.warning("ignoring %s before the configuration", type(message).__name__)
        raise TimeoutError(f"no API process answered at {endpoints.control} within {timeout_s:g} s")
    finally:
        control.close()
        context.term()
        sender.close()


def rendezvous_store(rank: int, world: int, timeout_s: float):
    """The launcher's rendezvous store, under a prefix of this run of the group (a
    restarted group does not read what the one before it left)."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world, timeout=timeout))
    run = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"rtvideo/{run}/", store)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rtvideo.workers.launch", description=__doc__.split("\n\n")[0])
    parser.add_argument("--api", required=True, help="HOST:PORT of the API process (rtvideo serve --worker-listen)")
    parser.add_argument(
        "--advertise-host",
        default=os.environ.get("RTVIDEO_ADVERTISE_HOST") or os.environ.get("MASTER_ADDR") or "127.0.0.1",
        help="the address the other ranks reach rank 0 at (default: MASTER_ADDR)",
    )
    parser.add_argument("--attach-timeout-s", type=float, default=600.0, help="how long to wait for the API process")
    args = parser.parse_args(argv)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    process_log.configure(f"launch[{rank}]")  # at info until the API process says (run_worker, follow)
    store = rendezvous_store(rank, world, args.attach_timeout_s) if world > 1 else None
    if rank != 0:
        from rtvideo.workers.parallel.group import follow

        store.wait(["config"], datetime.timedelta(seconds=args.attach_timeout_s))
        config = config_from_wire(msgspec.msgpack.decode(store.get("config")))
        follow(config, rank, world, store)  # exits the process
        return 0
    endpoints = Endpoints.tcp(args.api)
    try:
        config = attach(endpoints, world, args.attach_timeout_s)
    except (TimeoutError, ValueError) as error:
        log.error("%s", error)
        return 5
    log.info("attached to the API process at %s: %d pipeline rank(s)", args.api, world)
    site = None
    if store is not None:
        from rtvideo.workers.parallel.group import LaunchSite

        store.set("config", msgspec.msgpack.encode(config_to_wire(config)))
        site = LaunchSite(store, args.advertise_host)
    from rtvideo.workers.main import run_worker

    run_worker(config, endpoints, None, 0, site)  # exits the process with its code
    return 0


if __name__ == "__main__":
    sys.exit(main())
