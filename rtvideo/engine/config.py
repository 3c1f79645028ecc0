"""Engine configuration: one object, bounds checked at construction.

Owned by the API process (``EngineClient``) and handed, pickled once at spawn,
to the worker (or, to a worker group started by a launcher, as plain data:
``config_to_wire``). Environment variables are not read here; the CLI reads them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

PP_TRANSPORTS = ("auto", "torch")  # EngineConfig.pp_transport
PP_DECODES = ("auto", "first", "spread", "split")  # EngineConfig.pp_decode
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")  # EngineConfig.log_level
MODEL_PRESETS = ("demo", "tiny", "stub")  # models a worker builds by name (workers.pipelines.REGISTRY)
MODEL_DIR_PARTS = ("transformer", "vae", "text_encoder", "tokenizer")  # a model directory's folders (Wan2.1 diffusers)


@dataclass(frozen=True)
class PipelineSpec:
    """Which pipeline a worker builds, by registry name, with its options.

    ``options`` travel to the worker once, at spawn (they may hold
    ``multiprocessing`` synchronisation objects made from the spawn context).
    """

    name: str = "stub"
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class EngineConfig:
    """How the engine schedules and admits work."""

    pipeline: PipelineSpec = field(default_factory=PipelineSpec)
    max_sessions: int = 4
    """Sessions admitted at once per worker; a start beyond it is refused (server_full)."""
    group_chunk_steps: bool = True
    """Run all denoise steps of a chunk in one runner invocation when the pipeline
    supports it. The chunk boundary is never grouped (see docs/ENGINE.md)."""
    max_batch_rows: int = 1
    """Session rows one forward may carry; the worker builds its pipeline for this many."""
    max_undelivered_seconds: float = 4.0
    """Media a realtime session may have made beyond what was written to its
    client's socket; past it the session waits (transport backpressure)."""
    overlap_decode: bool | None = None
    """Decode a committed chunk on a stage of its own (a thread; a CUDA stream on a
    GPU) while the session's next chunk denoises (True), or in the micro-step that
    committed it (False). None: where the pipeline says it pays
    (``decode_overlap_pays``: causal Wan on a GPU)."""
    pp: int = 1
    """Pipeline ranks the transformer's blocks are split over (temporal pipeline
    parallelism): worker rank 0 starts ranks 1..pp-1 on this machine, one GPU
    each (gloo ranks sharing the cores on a CPU)."""
    pp_timeout_s: float = 30.0
    """How long a pipeline rank waits on another's message before it gives up
    (the group is then restarted): no rank ever hangs in a receive."""
    pp_transport: str = "auto"
    """What the pipeline ranks' activations travel on: ``auto``, the ranks' own
    TCP sockets on a CPU and NCCL point-to-point on GPUs; ``torch``,
    ``torch.distributed`` point-to-point either way (gloo on a CPU: measured
    1.2x slower where the transformer blocks dominate, docs/ENGINE.md). The plans always travel on the sockets."""
    pp_port: int | None = None
    """The TCP port pipeline rank 0's sockets listen on, rank r's on ``pp_port`` +
    r; None: any free port. On CPUs (``pp_transport`` ``auto``) the ranks join no
    ``torch.distributed`` process group, so ranks on several machines then need
    only these ports and the launcher's rendezvous port open between them."""
    pp_decode: str = "auto"
    """Which pipeline ranks decode a session's chunks
    (``rtvideo.workers.parallel.rank_decode``): ``split``, every session's VAE decoder
    split over two ranks, its first stages on rank 0 and the rest on a
    follower (the sessions shared out over the followers), a latent frame at
    a time; ``spread``, each session on one rank, the sessions shared out;
    ``first``, rank 0 decodes every session, on a lane per rank; ``auto``, on
    a CPU (the ranks are processes sharing the cores) ``spread``, and
    ``first`` on GPUs (measured in docs/ENGINE.md). With ``split`` a round of
    the sessions' chunks is decoded as one batch."""
    stream_batch: bool = False
    """Split over ranks: let a session's next chunk enter the pipeline while its
    chunk before is still being denoised (more throughput for few sessions; the
    output differs from the exact one by design: a chunk attends to the chunks
    before it as far as they are denoised). Off: exact. Sessions whose
    ``prompt_change`` is not ``soft`` always run exact."""
    max_chunks_in_flight: int | None = None
    """With stream batch, the chunks a session may have in flight at once, which
    is also the most chunks an interaction may wait behind (None: ``pp``, enough
    for one session to fill every rank)."""
    slo_first_chunk_s: float | None = None
    """The SLO controller's time-to-first-chunk target per session (None: only the
    playback rate, the session's fps, is a target)."""
    session_memory_bytes: int | None = None
    """Device memory (host memory on a CPU) the open sessions' state may hold
    together; a start that would pass it is refused (server_full). None: what the
    pipeline finds free after its warm-up (``session_memory_budget``: on a GPU the
    device's free memory, on a CPU the host's available memory and cgroup limit,
    each less the warm-up's transient peak and a margin)."""
    max_pixels: int | None = None
    """Largest frame (width x height) a session may ask for; a larger one is refused
    (invalid_request). None: derived at start, where the pipeline measures its
    chunks (``rtvideo.workers.calibrate``): the largest frame whose chunk costs at most
    ``max_realtime_load`` of its media time (never below the default size); not
    limited where nothing is measured. Set, it is the bound whatever the machine
    measures, and calibration measures no frame larger than the default."""
    max_realtime_load: float | None = 0.9
    """Admission by chunk cost: a start is refused (server_full) when, with it, the
    open sessions would need more than this fraction of the worker's time for
    every paced (realtime) session to keep real time (``rtvideo.engine.chunk_cost``:
    ``realtime_load``; unpaced jobs count as a turn in every round). A session
    alone is always admitted. None: not checked."""
    input_timeout_s: float = 5.0
    """Video to video: how long a session opened with an ``input`` may keep its
    next chunk waiting for that chunk's frames (``SubmitInput``), counted from
    when nothing else holds the chunk back; past it the session fails with
    ``input_timeout`` (other sessions go on)."""
    startup_timeout_s: float = 120.0
    """How long the client waits for a worker's READY before giving up."""
    shutdown_timeout_s: float = 10.0
    """How long shutdown waits for a worker to exit before killing it."""
    max_worker_restarts: int = 3
    """Fresh workers started after deaths within ``worker_restart_window_s``; 0: never."""
    worker_restart_window_s: float = 300.0
    worker_listen: str | None = None
    """``HOST:PORT`` where the API process waits for a worker group started by a
    launcher (``torchrun ... -m rtvideo.workers.launch --api HOST:PORT``, on this machine
    or others): its rank 0 connects over TCP (control on PORT, results on
    PORT + 1), takes this configuration and says READY; a group that exits or is
    found wedged is replaced by the one the launcher starts next, under the same
    restart budget. None: the API process spawns its worker itself."""
    orphan_after_s: float = 30.0
    """A launched worker that has heard nothing from the API process for this long
    (it probes every second) shuts down: the API process is gone."""
    worker_entry: str = "rtvideo.workers.main:run_worker"
    """Import path of the worker entry point; resolved in the child process only,
    so the API process never imports ``workers``."""
    cpu_threads: int | None = None
    """CPU threads for the worker's kernels (``torch.set_num_threads``) with one
    rank; None: on a CPU, the count that ran a chunk fastest on a thread as the
    executor's, measured at start (``rtvideo.workers.cpu_threads``), elsewhere torch's
    default. Pipeline ranks on CPUs each take the cores shared out instead."""
    decode_nice: int | None = None
    """How many steps of ``nice`` below the worker's own priority its decode
    threads run (Linux; 0 to 19): where the decode is a stage of its own, the
    thread that runs the micro-steps (with pipeline ranks, the ring) then keeps
    its core and the decodes take the cores' spare time. None: 10 for
    pipeline ranks on CPUs (measured in docs/ENGINE.md), 0 on one rank (no
    ring to yield to) and on GPUs, whose decode threads mostly launch kernels."""
    log_level: str = "info"
    """How much the worker processes log, by Python logging level name (one of
    ``LOG_LEVELS``); ``debug`` adds the traceback to the line that says where a
    pipeline call that failed a session raised (``rtvideo.workers.runner``)."""
    wedged_after_s: float = 10.0
    """The heartbeat's floor (``rtvideo.engine.client.heartbeat``): a worker whose loop has answered
    no probe for this long, or whose one forward has run past
    max(this, 10 x the slowest chunk measured at its size), is killed, its sessions
    fail with ``worker_wedged`` and a fresh one starts (``max_worker_restarts``)."""

    def __post_init__(self) -> None:
        _check(self.max_sessions >= 1, "max_sessions", "must be >= 1")
        _check(self.max_batch_rows >= 1, "max_batch_rows", "must be >= 1")
        _check(self.pp >= 1, "pp", "must be >= 1")
        _check(self.pp_timeout_s > 0, "pp_timeout_s", "must be > 0")
        _check(self.pp_transport in PP_TRANSPORTS, "pp_transport", f"must be one of {', '.join(PP_TRANSPORTS)}")
        _check(
            self.pp_port is None or 1 <= self.pp_port <= 65536 - self.pp,
            "pp_port",
            f"must leave room for {self.pp} ports: 1 to {65536 - self.pp}",
        )
        _check(self.pp_decode in PP_DECODES, "pp_decode", f"must be one of {', '.join(PP_DECODES)}")
        _check(self.log_level in LOG_LEVELS, "log_level", f"must be one of {', '.join(LOG_LEVELS)}")
        _check(not self.stream_batch or self.pp >= 2, "stream_batch", "needs pp >= 2 (pipeline ranks to fill)")
        in_flight = self.max_chunks_in_flight
        _check(in_flight is None or in_flight >= 1, "max_chunks_in_flight", "must be >= 1")
        first = self.slo_first_chunk_s
        _check(first is None or first > 0, "slo_first_chunk_s", "must be > 0")
        _check(self.max_undelivered_seconds > 0, "max_undelivered_seconds", "must be > 0")
        budget = self.session_memory_bytes
        _check(budget is None or budget > 0, "session_memory_bytes", "must be > 0")
        _check(self.max_pixels is None or self.max_pixels > 0, "max_pixels", "must be > 0")
        load = self.max_realtime_load
        _check(load is None or load > 0, "max_realtime_load", "must be > 0")
        _check(self.input_timeout_s > 0, "input_timeout_s", "must be > 0")
        _check(self.startup_timeout_s > 0, "startup_timeout_s", "must be > 0")
        _check(self.shutdown_timeout_s > 0, "shutdown_timeout_s", "must be > 0")
        _check(self.max_worker_restarts >= 0, "max_worker_restarts", "must be >= 0")
        _check(self.worker_restart_window_s > 0, "worker_restart_window_s", "must be > 0")
        _check(self.wedged_after_s > 0, "wedged_after_s", "must be > 0")
        _check(":" in self.worker_entry, "worker_entry", "must look like 'module:function'")
        _check(self.cpu_threads is None or self.cpu_threads >= 1, "cpu_threads", "must be >= 1")
        nice = self.decode_nice
        _check(nice is None or 0 <= nice <= 19, "decode_nice", "must be 0 to 19")
        _check(self.orphan_after_s > 0, "orphan_after_s", "must be > 0")
        if self.worker_listen is not None and (why := worker_listen_fault(self.worker_listen)) is not None:
            _check(False, "worker_listen", why)

    @property
    def worker_modules(self) -> tuple[str, ...]:
        """What a worker of this configuration imports before it can build its
        pipeline: the entry point's module and, for a model (not the stub), the
        causal Wan pipeline with diffusers, and with pipeline ranks their group's
        module. Preloaded once by the server that forks
        workers (``rtvideo.engine.client.engine_client``), so a (re)started worker imports nothing of it."""
        entry = self.worker_entry.partition(":")[0]
        if self.pipeline.name == "stub":
            return (entry,)
        ranks = ("rtvideo.workers.parallel.group",) if self.pp > 1 else ()  # the ranks' own, forked from rank 0
        return (entry, "rtvideo.workers.pipelines.causal_wan", *ranks)

    def lookahead(self, prompt_change: str) -> int:
        """The chunks a session started with ``prompt_change`` may have in flight:
        1 (exact) unless stream batch is on and a prompt change keeps the cache
        (``soft``: a ``reset`` must empty it between two chunks)."""
        if not self.stream_batch or prompt_change != "soft":
            return 1
        return self.max_chunks_in_flight or self.pp


def config_to_wire(config: EngineConfig) -> dict:
    """``config`` as plain data (``AttachWorker``): its pipeline options must be
    plain data too, which they are wherever they came from a command line."""
    return asdict(config)


def config_from_wire(data: dict) -> EngineConfig:
    """The ``EngineConfig`` ``config_to_wire`` described; ``ValueError`` naming a
    bad field (the same checks as a config made here)."""
    fields = dict(data)
    pipeline = fields.pop("pipeline", {})
    try:
        return EngineConfig(pipeline=PipelineSpec(**pipeline), **fields)
    except TypeError as error:
        raise ValueError(f"EngineConfig from the API process: {error}") from None


def worker_listen_fault(value: str) -> str | None:
    """What is wrong with a ``worker_listen`` address (None: nothing)."""
    host, _, port = value.rpartition(":")
    if host and port.isdigit() and 0 < int(port) < 65535:
        return None
    return f"must look like HOST:PORT with PORT below 65535, got {value!r}"


def _check(ok: bool, name: str, rule: str) -> None:
    if not ok:
        raise ValueError(f"EngineConfig.{name} {rule}")
