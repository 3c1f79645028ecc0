"""Starting, joining, feeding and watching the pipeline ranks of one worker.

Worker processes. Rank 0 (the worker the API process spawned) starts ranks
1..N-1 first thing (``FollowerProcesses``: forks of it, which begin with
its imported modules), and makes a ``RankGroup`` as soon as its own pipeline
is built: ``spawn`` tells them the group's store, and they build theirs
(``run_follower``; load the weights) while rank 0 warms up; rank 0
measures the blocks' costs (on a CPU once every rank has loaded,
``wait_loaded``: a rank still loading shares the cores and made the costs,
and so the split, vary from start to start); ``start`` then hands each its block
range through a ``torch.distributed`` TCP store, joins them in one process
group where the ring travels on one (NCCL on GPUs, gloo with ``pp_transport``
``torch``; ``uses_process_group``), and connects the ranks' sockets
(``rtvideo.workers.parallel.sockets``, on ``pp_port`` + rank where that is set): the
plans (``rtvideo.engine.messages.RankPlan``, made from each ``rtvideo.engine.plan.MicroStep``
by ``rank_plan``) travel on them, and so does the ring on a CPU
(``ring_link``: on GPUs, NCCL point-to-point).

One group lives and dies as one: a thread of rank 0 waits on the followers'
process sentinels and, the moment one dies, calls ``on_death`` (the worker
says ``EngineDead`` and exits, so the API process's restart budget starts a
fresh group); every follower holds the read end of a pipe whose write end
only rank 0 has, and exits when it sees EOF, so a dead rank 0 never leaves a
follower behind, blocked or not. Every point-to-point wait has the link's
timeout (``EngineConfig.pp_timeout_s``).

A group started by a launcher (``rtvideo.workers.launch``: ``torchrun``, one process
per rank, on one machine or several) is the same group without the spawning:
the ranks meet in the launcher's rendezvous store (``LaunchSite``), where
rank 0 leaves the configuration, each follower's blocks and every rank the
address of its sockets; there are no sentinels to watch, so a rank that dies is
found by the link (a peer's closed connection, or the timeout), and the
launcher tears down and restarts the group.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait

import torch
import torch.distributed as dist

from rtvideo.engine.config import EngineConfig
from rtvideo.engine.messages import RankBoundary, RankFigures, RankPlan, RankRow, RingHeader
from rtvideo.engine.plan import MicroStep, StepRow
from rtvideo.engine.transport import decode_rank, encode_rank
from rtvideo.workers import process_log
from rtvideo.workers.os_threads import decode_nice
from rtvideo.workers.parallel.link import Message, RingLink
from rtvideo.workers.parallel.placement import backend, link_device, rank_device, rank_spec, uses_process_group
from rtvideo.workers.parallel.sockets import PeerClosed, RankSockets, advertised_host

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LaunchSite:
    """Where a launched group meets: the launcher's rendezvous store (prefixed for
    this run of the group) and the address the other ranks reach rank 0 at."""

    store: dist.Store
    advertise_host: str


def rank_threads(world: int) -> int:
    """CPU threads for each rank's kernels: the cores shared out, at least one."""
    return max(1, (os.cpu_count() or 1) // world)


def decode_placement(config: EngineConfig, pipeline) -> str:
    """Where sessions' chunks decode (``rtvideo.workers.parallel.rank_decode``):
    ``split`` (``pp_decode`` ``split``: every session's decoder split over two
    ranks) where the pipeline's decoder can be split, else ``spread``
    (``spread``, ``auto`` on a CPU, or that) where the pipeline can decode on
    another rank, else ``first``: rank 0 decodes them all (also with one rank, or
    decodes inside micro-steps; ``auto`` on GPUs). Why ``auto`` chooses so:
    ``rtvideo.workers.parallel.rank_decode``."""
    from rtvideo.workers.parallel.rank_decode import can_split, can_spread

    wanted = config.pp_decode
    if wanted == "auto":
        wanted = "spread" if rank_device(config, 0).type == "cpu" else "first"
    deferred = config.overlap_decode is not False  # else rank 0 decodes inside its micro-steps
    if config.pp == 1 or not deferred or wanted == "first" or not can_spread(pipeline):
        return "first"
    return "split" if wanted == "split" and can_split(pipeline) else "spread"


def ring_link(config: EngineConfig, rank: int, sockets: RankSockets) -> RankSockets | RingLink:
    """What the ring's messages travel on: the ranks' sockets on a CPU (and
    between ranks sharing a GPU), NCCL point-to-point between GPUs
    (``pp_transport`` ``auto``), or ``torch.distributed`` point-to-point either
    way (``torch``: gloo on a CPU). ``rtvideo.workers.parallel.placement`` decides."""
    if not uses_process_group(config, rank):
        return sockets
    return RingLink(rank, config.pp, config.pp_timeout_s, link_device(config, rank))


def join_process_group(config: EngineConfig, rank: int, store: dist.Store) -> None:
    """Join the group's ``torch.distributed`` process group, where the ring travels
    on one. NCCL's communicator is made now, on the rank's GPU (``device_id``),
    not lazily at the first send, when the peer may be waiting on something else."""
    timeout = datetime.timedelta(seconds=config.startup_timeout_s)
    kind = backend(config, rank)
    device = rank_device(config, rank) if kind == "nccl" else None
    dist.init_process_group(kind, store=store, rank=rank, world_size=config.pp, timeout=timeout, device_id=device)


WARM_UP_TAG = 0  # the ring's first message; micro-steps' messages are tagged from 2 on


def warm_up_ring(link: RankSockets | RingLink, rank: int, world: int) -> None:
    """Send one small message once round the ring, 0 -> 1 -> ... -> N-1 -> 0,
    before rank 0 says READY: every pair of neighbours opens its connection (on
    GPUs, NCCL's point-to-point communicator) now, in an order every rank
    agrees on, so no rank's first operation is a lone send while its peer
    waits on a plan, and a ring that cannot go round fails the start (within
    the link's timeout, ``LinkTimeout`` naming the rank) instead of the first
    session."""
    token = Message(RingHeader(), [torch.zeros(1, device=link.device)])
    if rank == 0:
        link.send(1, WARM_UP_TAG, token)
        link.recv(world - 1, WARM_UP_TAG)
    else:
        link.send((rank + 1) % world, WARM_UP_TAG, link.recv(rank - 1, WARM_UP_TAG))
    link.wait_sent()


def rank_plan(step: MicroStep) -> RankPlan:
    """What the later ranks need of micro-step ``step``: its releases, opens and
    boundaries, and each rank's rows."""

    def rows(planned: list[StepRow]) -> tuple[RankRow, ...]:
        return tuple(RankRow(session_id=r.session_id, chunk_index=r.chunk_index, step=r.step) for r in planned)

    return RankPlan(
        number=step.number,
        release=tuple(step.release),
        open=tuple(step.open),
        boundaries=tuple(
            RankBoundary(session_id=t.session_id, chunk_index=t.chunk_index, prompt_changed=t.prompt is not None)
            for t in step.boundaries
        ),
        ranks=tuple(rows(planned) for planned in step.ranks),
    )


def rank_port(config: EngineConfig, rank: int) -> int:
    """The TCP port rank ``rank``'s sockets listen on: ``pp_port`` + rank, or 0
    (any free port) without ``pp_port``."""
    return 0 if config.pp_port is None else config.pp_port + rank


class RankGroup:
    """Rank 0's handle on ranks 1..N-1."""

    def __init__(self, config: EngineConfig, on_death: Callable[[str], None], site: LaunchSite | None = None) -> None:
        """``site``: the group was started by a launcher (its ranks are not spawned
        here); None: ``spawn`` starts them on this machine."""
        self.config = config
        self.site = site
        self.world = config.pp
        self.splits: list[range] = []
        self.blocks = range(0)  # rank 0's, once ``start`` was given the split
        self.on_death = on_death
        self._store: dist.TCPStore | None = None
        self.sockets = RankSockets(0, config.pp, config.pp_timeout_s)
        self.link: RankSockets | RingLink | None = None
        self.figures: dict[int, RankFigures] = {}  # rank -> its figures, cumulative, as the ring last carried them
        self._processes: list[multiprocessing.Process] = []
        self._closing = threading.Event()
        self._keep_alive: Connection | None = None

    def spawn(self, started: FollowerProcesses | None = None) -> None:
        """Start ranks 1..N-1 (``started``: they were, at this process's start),
        then open the group's store and tell them where it is; each builds its
        pipeline, then waits for its blocks. Launched: they run already;
        listen where they will reach rank 0."""
        if self.site is not None:
            self._store = self.site.store
            host, port = self.site.advertise_host, rank_port(self.config, 0)
            self.sockets.listen(self._store, host, bind_host="0.0.0.0", port=port)
            return
        started = started or FollowerProcesses(self.config)
        self._processes, self._keep_alive = started.processes, started.keep_alive
        timeout = datetime.timedelta(seconds=self.config.startup_timeout_s)
        store = self._store = dist.TCPStore("127.0.0.1", 0, self.world, True, timeout=timeout, wait_for_workers=False)
        self.sockets.listen(store, "127.0.0.1", port=rank_port(self.config, 0))
        started.tell_store(store.port)

    def wait_loaded(self) -> None:
        """Wait until every follower has built its pipeline (on a CPU the ranks'
        costs are measured after it: a rank still loading shares the cores and
        made the measured costs, and so the split, vary from start to start)."""
        self._wait_for("loaded", "loaded its model")

    def start(self, splits: list[range]) -> None:
        """Give each follower its blocks, wait until each kept them, join the
        process group. ``RuntimeError`` naming the rank when one fails."""
        self.splits, self.blocks = splits, splits[0]
        store = self._store
        for rank in range(1, self.world):
            store.set(f"blocks/{rank}", f"{splits[rank].start},{splits[rank].stop}")
        self._wait_for("built", "kept its blocks")
        self._check_devices()
        if uses_process_group(self.config, 0):
            join_process_group(self.config, 0, store)
        self._wait_for("sockets", "listening on their sockets")
        self.sockets.connect(store, self.config.startup_timeout_s)
        self.link = ring_link(self.config, 0, self.sockets)
        warm_up_ring(self.link, 0, self.world)
        if self._processes:
            threading.Thread(target=self._watch, name="rank-watch", daemon=True).start()

    def _check_devices(self) -> None:
        """Every rank runs on the same kind of device as rank 0 (each said where,
        ``device/<rank>``); ``RuntimeError`` naming them where not."""
        devices = [str(rank_device(self.config, 0))]
        devices += [self._store.get(f"device/{rank}").decode() for rank in range(1, self.world)]
        if len({torch.device(device).type for device in devices}) > 1:
            where = ", ".join(f"rank {rank} on {device}" for rank, device in enumerate(devices))
            raise RuntimeError(
                f"pipeline ranks on different kinds of device ({where}): every rank needs a GPU, "
                "or every rank runs on the CPU (pipeline option device cpu)"
            )

    def _wait_for(self, key: str, what: str) -> None:
        """Until every follower has set ``key/<rank>`` in the store; ``RuntimeError``
        naming the rank when one exits first, or past the start-up timeout."""
        deadline = time.monotonic() + self.config.startup_timeout_s
        keys = [f"{key}/{rank}" for rank in range(1, self.world)]
        while not self._store.check(keys):
            for rank in range(1, self.world):
                if self._store.check([f"failed/{rank}"]):  # it said why it could not start
                    raise RuntimeError(self._store.get(f"failed/{rank}").decode())
            for rank, process in enumerate(self._processes, start=1):
                if not process.is_alive():
                    raise RuntimeError(f"pipeline rank {rank} exited with code {process.exitcode} while starting")
            if time.monotonic() > deadline:
                raise RuntimeError(f"pipeline ranks not {what} within {self.config.startup_timeout_s:g} s")
            time.sleep(0.02)

    @property
    def closing(self) -> bool:
        """``close`` has begun: followers going away is expected."""
        return self._closing.is_set()

    def send_plan(self, step: MicroStep, ring: tuple[int, Message] | None = None) -> None:
        """Every follower gets every micro-step's plan, in order; ``ring`` (tag,
        message): rank 1's ring message, carried in the same frame."""
        self.sockets.send_plan(step.number, encode_rank(rank_plan(step)), ring)

    @property
    def plans_carry_the_ring(self) -> bool:
        """The ring runs on the plans' connections (``RankSockets``), so rank 1's
        ring message can ride with the next plan."""
        return self.link is self.sockets

    def note_figures(self, figures: tuple[RankFigures, ...]) -> None:
        """The later ranks' figures a ring message brought back."""
        for figure in figures:
            self.figures[figure.rank] = figure

    def dead_reason(self, wait_s: float = 0.0) -> str | None:
        """Why the group is broken, when a follower has died (None: all alive).
        ``wait_s``: how long to wait for a death to show (a killed rank's sockets
        close, and its peers' links fail, a moment before its exit can be seen)."""
        if wait_s > 0 and self._processes:
            wait([process.sentinel for process in self._processes], timeout=wait_s)
        for rank, process in enumerate(self._processes, start=1):
            # its sentinel says it exited even while the watch thread reaps it (is_alive, polling then, would
            # not: only one thread's wait gets the exit status)
            if wait([process.sentinel], timeout=0) or not process.is_alive():
                process.join(1.0)
                code = "" if process.exitcode is None else f" with exit code {process.exitcode}"
                return f"pipeline rank {rank} (pid {process.pid}) died{code}"
        return None

    def pids(self) -> list[int]:
        """Ranks 1..N-1's pids (launched: on their own machines, as they said)."""
        if self.site is not None:
            return [int(self._store.get(f"pid/{rank}")) for rank in range(1, self.world)]
        return [process.pid for process in self._processes]

    def close(self, broken: bool = False) -> None:
        """Stop the followers (they finish the plan in hand), then leave the group.
        ``broken``: the ring failed (a rank died, or a link timed out): a follower
        may be stopped or wedged, and nothing of theirs is needed any more, so
        they are killed at once rather than waited for (the restart waits on it)."""
        self._closing.set()
        if self.link is not None:
            self.sockets.send_stop()
        for process in self._processes:
            if self.link is not None and not broken:  # joined: it stops at the plans' stop; else it waits for blocks
                process.join(self.config.shutdown_timeout_s)
            if process.is_alive():
                process.kill()
                process.join()
        if self.link is not None:
            try:
                self.link.wait_sent()
            except Exception:
                pass
        if dist.is_initialized():
            dist.destroy_process_group()
        self.sockets.close()

    def _watch(self) -> None:
        sentinels = {process.sentinel: (rank, process) for rank, process in enumerate(self._processes, start=1)}
        ready = wait(list(sentinels))
        if self._closing.is_set():
            return
        rank, process = sentinels[ready[0]]
        process.join(1.0)
        self.on_death(self.dead_reason() or f"pipeline rank {rank} (pid {process.pid}) died")


class FollowerProcesses:
    """Ranks 1..N-1 of a group rank 0 starts itself (not launched), started
    before rank 0 builds anything or runs a thread. Each waits for the
    group's store, whose port ``tell_store`` sends it on a pipe of its own
    once rank 0's pipeline is built, then builds its own while rank 0 warms
    up. A follower exits the moment rank 0 is gone (EOF on the keep-alive
    pipe, whose write end only rank 0 holds).

    They are forks of rank 0 where rank 0 has no thread yet (``forks_safely``):
    rank 0 is a fork of the API process's fork server, so it begins with the
    worker's modules imported, no thread running and no device touched, and a
    fork of it begins the same way, at once, where a spawned interpreter
    imports them again (5 CPU seconds on the 2-core development machine,
    ``diffusers`` most of them) before it builds anything. Elsewhere they are
    spawned: a fork would copy another thread's locks as they were."""

    def __init__(self, config: EngineConfig) -> None:
        self.method = "fork" if forks_safely() else "spawn"
        context = multiprocessing.get_context(self.method)
        reader, self.keep_alive = multiprocessing.Pipe(duplex=False)
        self.processes: list[multiprocessing.Process] = []
        self._ports: list[Connection] = []
        try:
            for rank in range(1, config.pp):
                port_reader, port_writer = multiprocessing.Pipe(duplex=False)
                self._ports.append(port_writer)
                # a fork holds copies of every pipe end this process has: it closes the write ends of the
                # keep-alive and of its own and earlier siblings' ports, or rank 0's exit would not be its EOF
                inherited = (self.keep_alive, *self._ports) if self.method == "fork" else ()
                process = context.Process(
                    target=run_follower,
                    args=(config, rank, config.pp, port_reader, reader, inherited),
                    name=f"rtvideo-rank-{rank}",
                    daemon=True,
                )
                try:
                    process.start()
                finally:
                    port_reader.close()
                self.processes.append(process)
        except BaseException:  # none is left behind: those started are killed and reaped
            self.close()
            raise
        finally:
            reader.close()
        log.info("pipeline ranks 1..%d started (%s)", config.pp - 1, self.method)

    def close(self) -> None:
        """End the followers before they were told the store (a start given up)."""
        self.keep_alive.close()
        for pipe in self._ports:
            pipe.close()
        self._ports = []
        for process in self.processes:
            process.kill()
            process.join()

    def tell_store(self, port: int) -> None:
        """Each follower's store port: the group's store listens there."""
        for pipe in self._ports:
            with contextlib.suppress(OSError):  # a follower already gone: the start fails, naming it
                pipe.send(port)
            pipe.close()
        self._ports = []


def forks_safely() -> bool:
    """Whether this process may fork a follower: it runs one thread (Linux's
    ``/proc/self/task`` counts native threads too; without it, spawn)."""
    try:
        return len(os.listdir("/proc/self/task")) == 1
    except OSError:
        return False


def run_follower(
    config: EngineConfig,
    rank: int,
    world: int,
    store_port: Connection,
    parent_alive: Connection,
    inherited: tuple[Connection, ...] = (),
) -> None:
    """Entry point of pipeline rank ``rank`` (started by ``FollowerProcesses``):
    ``inherited``, the pipe ends a fork holds copies of and must not, closed
    first; the group's store port read from ``store_port``."""
    for pipe in inherited:
        pipe.close()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    threading.Thread(target=_exit_with_parent, args=(parent_alive,), name="parent-watch", daemon=True).start()
    try:
        port = store_port.recv()  # rank 0 opens the store once its pipeline is built
    except EOFError:  # rank 0 is gone before it did (its start failed, or it was killed)
        os._exit(0)
    store_port.close()
    timeout = datetime.timedelta(seconds=config.startup_timeout_s)
    store = dist.TCPStore("127.0.0.1", port, world, False, timeout=timeout)
    follow(config, rank, world, store, launched=False)


def follow(config: EngineConfig, rank: int, world: int, store: dist.Store, launched: bool = True) -> None:
    """Be pipeline rank ``rank``: build the pipeline, keep the blocks rank 0 gives
    through ``store``, join the process group and the ranks' sockets (reachable
    at ``advertised_host`` when ``launched`` on any machine, else on loopback),
    then run each micro-step's plan until rank 0 says stop. Exits the process."""
    from rtvideo.workers.parallel.follower import Follower
    from rtvideo.workers.pipelines import build_pipeline

    process_log.configure(f"worker[{rank}]", config.log_level)
    sockets = RankSockets(rank, world, config.pp_timeout_s)
    try:
        device = rank_device(config, rank)
        if device.type == "cpu":
            torch.set_num_threads(rank_threads(world))
        else:
            torch.cuda.set_device(device)  # NCCL's communicators follow the current device
        pipeline = build_pipeline(rank_spec(config, rank), config.max_batch_rows)
        store.set(f"device/{rank}", str(device))
        store.set(f"loaded/{rank}", "1")
        timeout = datetime.timedelta(seconds=config.startup_timeout_s)
        store.wait([f"blocks/{rank}"], timeout)  # rank 0 measures the blocks (on a CPU once all have loaded)
        blocks = tuple(int(part) for part in store.get(f"blocks/{rank}").decode().split(","))
        pipeline.own_blocks(range(*blocks))
        pipeline.chunks_in_flight = config.lookahead
        store.set(f"pid/{rank}", str(os.getpid()))
        store.set(f"built/{rank}", "1")
        if uses_process_group(config, rank):
            join_process_group(config, rank, store)
        port = rank_port(config, rank)
        if launched:
            sockets.listen(store, advertised_host(os.environ.get("MASTER_ADDR")), bind_host="0.0.0.0", port=port)
        else:
            sockets.listen(store, "127.0.0.1", port=port)
    except Exception as error:  # rank 0 reads this while it waits for the ranks, and fails the start with it
        log.exception("pipeline rank %d could not start", rank)
        store.set(f"failed/{rank}", f"pipeline rank {rank} could not start: {type(error).__name__}: {error}")
        os._exit(1)
    sockets.connect(store, config.startup_timeout_s)
    link = ring_link(config, rank, sockets)
    warm_up_ring(link, rank, world)
    follower = Follower(pipeline, link, range(*blocks))
    if decode_placement(config, pipeline) != "first":
        from rtvideo.workers.parallel.decode_server import DecodeServer

        nice = decode_nice(config.decode_nice, device.type, config.pp)
        follower.decoder = DecodeServer(pipeline, follower.states, sockets, nice=nice)
    log.info("rank %d of %d: blocks %d..%d", rank, world, blocks[0], blocks[1] - 1)
    try:
        while (raw := sockets.recv_plan()) is not None:
            follower.run(decode_rank(raw, RankPlan))
        link.wait_sent()
        if follower.decoder is not None:
            follower.decoder.close()
    except PeerClosed as gone:  # another rank died: the group ends, and rank 0's side says why
        log.warning("pipeline rank %d ends with its group: %s", rank, gone)
        os._exit(2)
    except Exception:
        log.exception("pipeline rank %d failed", rank)
        os._exit(2)
    finally:
        sockets.close()
    if dist.is_initialized():
        dist.destroy_process_group()
    os._exit(0)


def _exit_with_parent(parent_alive: Connection) -> None:
    """Exit the moment rank 0 is gone (EOF on the pipe only it can write)."""
    try:
        while True:
            parent_alive.recv()
    except (EOFError, OSError):
        os._exit(0)
