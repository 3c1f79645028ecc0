"""Server settings: one object, bounds checked at construction.

Built by the CLI from flags and ``RTVIDEO_*`` environment variables (the CLI is
the one place that reads the environment) and handed to ``create_app``. Every
field is declared with ``setting(group, default)``: the group is the section of
``rtvideo serve --help`` it is listed in (``GROUPS``), so a new field must name one.
"""

from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from rtvideo.engine.config import LOG_LEVELS, PP_DECODES, PP_TRANSPORTS, worker_listen_fault
from rtvideo.engine.limits import DECODERS

GROUPS = {
    "network": "where the server listens, who may call it, and how much a request may carry",
    "model": "what is served, and how the worker runs it",
    "capacity": "how many sessions at once, how large, and how long a video",
    "sessions": "realtime sessions: start, stalls, slow clients, spectators, interactions, resumes",
    "jobs": "/v1/videos jobs: how many, where they are kept, and for how long",
    "prompts": "which prompts this server refuses (a policy of the operator's)",
    "parallel ranks": "pipeline parallelism (--pp): the ranks, their transport, and stream batch",
    "workers": "the worker processes: start, restarts, wedged workers, and the drain at shutdown",
    "observability": "what the server logs",
}
"""The sections of ``rtvideo serve --help``, in order: name -> what its options are about."""


def setting(group: str, default: Any = MISSING, *, factory: Any = MISSING) -> Any:
    """A ``ServerSettings`` field listed under ``group`` (a name of ``GROUPS``) in
    ``rtvideo serve --help``, with its ``default`` (or ``factory`` for a mutable one).
    ``ValueError`` for a group that is not one: it is checked as the class is defined."""
    if group not in GROUPS:
        raise ValueError(f"setting group must be one of {', '.join(GROUPS)}, got {group!r}")
    return field(default=default, default_factory=factory, metadata={"group": group})


@dataclass(frozen=True)
class ServerSettings:
    host: str = setting("network", "127.0.0.1")
    """Address to listen on (0.0.0.0: every interface)."""
    port: int = setting("network", 8000)
    """Port to listen on (0: any free port, printed at start)."""
    model: str = setting("model", "demo")
    """What to serve: ``demo`` (the built-in demo model: coloured shapes that follow
    their prompt), ``tiny`` (the built-in random-weight causal Wan, for fast tests),
    ``stub`` (arithmetic, for tests), or a model directory (Wan2.1 diffusers layout)."""
    pipeline_options: dict = setting("model", factory=dict)
    """The pipeline's options as a JSON object, e.g. '{"dtype": "bfloat16", "compile": true}' for causal Wan
    (dtype, vae_dtype, sink_frames, window_frames, warm_up_chunks, compile: docs/MODEL.md)."""
    decoder: str = setting("model", "full")
    """What makes sessions' frames unless a request says otherwise: full (the model's
    VAE decoder) or tiny (the tiny streaming decoder: several times faster, less
    detail; its weights in the model directory, rtvideo convert --tiny-decoder)."""
    quantize: str | None = setting("model", None)
    """fp8: the transformer blocks' linears in FP8 with per-row scales (a GPU of compute
    capability 8.9 or newer: Ada, Hopper, Blackwell; refused elsewhere at start). Null: off."""
    max_sessions: int = setting("capacity", 4)
    """Realtime sessions and running jobs at once (the worker's admission limit).
    Beyond it a new realtime session gets ``error{code: "server_full"}`` and close
    1013; a new job is accepted and waits ``queued`` until a session ends."""
    group_chunk_steps: bool = setting("model", True)
    """Run a begun chunk's denoise steps back to back before another session's chunk begins
    (true), or give every step its own turn among the sessions (false). Frames are the same."""
    session_memory_gib: float | None = setting("capacity", None)
    """Memory the open sessions' state may hold together (the device's on a GPU, the
    host's on a CPU); a session that would pass it is refused like a full server.
    Default: what the worker finds free after its warm-up, less the warm-up's
    transient peak and a margin (on a CPU: the host's MemAvailable, within its
    cgroup's limit)."""
    max_batch_rows: int = setting("capacity", 1)
    """Sessions whose denoise steps may share one forward (sessions of one size).
    The one knob for it: the worker builds its pipeline for this many rows, so the
    attention buffers and the memory reserved for a forward follow. Batching raises
    throughput but steps sessions in lockstep, so their chunks arrive in bursts
    and a new prompt waits up to a whole round longer: 1 favours latency."""
    pp: int = setting("parallel ranks", 1)
    """Pipeline ranks the model's transformer blocks are split over (temporal
    pipeline parallelism): the worker starts this many processes on this machine,
    one GPU each (on a CPU they share the cores), splits the blocks by measured
    cost, and different sessions' chunks fill the ranks at once. Frames are the
    same as with 1; it pays with at least as many sessions as ranks, and most
    with --max-batch-rows 2 or more when the sessions outnumber the ranks."""
    pp_timeout_s: float = setting("parallel ranks", 30.0)
    """With --pp: how long one rank waits for another's activations before the
    group is declared broken and restarted (no rank ever hangs)."""
    pp_transport: str = setting("parallel ranks", "auto")
    """With --pp: what the ranks' activations travel on: auto (the ranks' own TCP
    sockets on a CPU, NCCL on GPUs) or torch (torch.distributed point-to-point:
    gloo on a CPU, measured 1.2x slower where the transformer blocks dominate)."""
    pp_port: int | None = setting("parallel ranks", None)
    """With --pp: the TCP port rank 0's sockets listen on, rank r's on this + r
    (default: any free port). On CPUs the ranks then need no other ports: with
    ranks on several machines, open these and the launcher's rendezvous port."""
    pp_decode: str = setting("parallel ranks", "auto")
    """With --pp: which ranks decode a session's chunks: split (its VAE decoder
    split over rank 0 and a follower), spread (each session on one rank, the
    sessions shared out over the ranks), first (rank 0 decodes them all) or
    auto (spread on a CPU, first on GPUs)."""
    worker_listen: str | None = setting("parallel ranks", None)
    """HOST:PORT where the server waits for a worker group started by a launcher
    instead of starting its worker itself: `torchrun --nproc-per-node N
    [--nnodes M ...] -m rtvideo.workers.launch --api HOST:PORT` on this machine or others
    (the group's size is the pipeline ranks; control on PORT, results on PORT+1).
    The group takes this server's configuration; one that exits is replaced by
    the next the launcher starts (torchrun --max-restarts)."""
    stream_batch: bool = setting("parallel ranks", False)
    """With --pp: a session's next chunk may begin while the chunk before it is
    still being denoised, so a single session fills every rank (more frames per
    second for few sessions). The frames differ from the exact ones by design: a
    chunk attends to the chunks before it as far as they are denoised (measured
    in docs/PP_MEASUREMENTS.md). Sessions with prompt_change "reset" or "recache" run exact."""
    max_chunks_in_flight: int | None = setting("parallel ranks", None)
    """With --stream-batch: the chunks a session may have under way at once, and so
    the most chunks a new prompt may wait behind (default: --pp)."""
    slo_first_chunk_s: float | None = setting("parallel ranks", None)
    """With --pp: a time-to-first-chunk target the SLO controller holds each new
    session to, beside its playback rate, when it picks the rows per micro-step."""
    max_undelivered_seconds: float = setting("sessions", 4.0)
    """Media a realtime session may have made beyond what was written to its client's
    socket; past it generation waits for the client (a slow or stalled reader holds
    its own session, and the server buffers a bounded amount for it)."""
    max_outbox_bytes: int = setting("sessions", 64 << 20)
    """Bytes a realtime connection may hold for its client, queued and not yet written
    to its socket (events and encoded chunks); past it the client is closed (1008
    ``slow_client``) and its session ends. A chunk reaching an empty outbox is always
    taken, however large; pacing (max_undelivered_seconds) holds generation first."""
    send_timeout_s: float = setting("sessions", 30.0)
    """How long one write to a realtime client's socket may wait for the client to
    read; past it the client is closed (1008 ``slow_client``) and its session ends."""
    max_spectators: int = setting("sessions", 16)
    """Spectators (``?watch=``) one realtime session takes at once; one more is refused
    (``too_many_spectators``, close 1013). A spectator never holds the session: one with
    more than max_undelivered_seconds of media queued for it and not yet written to its
    socket is closed (1008 ``slow_client``), its controllers unaffected."""
    max_interactions_per_s: float = setting("sessions", 20.0)
    """Interactions a realtime session takes per second, from all its controllers
    together (a token bucket refilled at this rate, holding interaction_burst); one more
    gets ``error{code: "rate_limited"}`` and is not queued, and the session goes on."""
    interaction_burst: int = setting("sessions", 40)
    """Interactions a realtime session may send back to back before max_interactions_per_s
    applies (the token bucket's size)."""
    overlap_decode: bool | None = setting("model", None)
    """Decode each chunk on a stage of its own while the session's next chunk denoises
    (true), or in line after its commit (false); unset: where the model says it pays
    (causal Wan: on a GPU, not on a CPU). Frames are the same either way."""
    decode_nice: int | None = setting("model", None)
    """Steps of nice (0 to 19, Linux) the worker's decode threads run below it, so
    the thread that runs the denoise steps (with --pp, the ranks' ring) keeps its
    core and the decodes take the spare time; unset: 10 with --pp 2 or more on
    CPUs, else 0.
    Frames are the same either way."""
    cpu_threads: int | None = setting("model", None)
    """CPU threads the worker's kernels run on (torch's intra-op threads), with one
    rank on a CPU; unset: the worker measures a chunk at 1, 2, 4 ... threads up to
    the core count at start and keeps the fastest (fewer within 10%; a model
    whose chunks are too slow to warm up keeps torch's default, as does
    OMP_NUM_THREADS set): the count is on /health. With --pp each rank takes the cores shared out."""
    api_key: str | None = setting("network", None)
    """When set, the realtime WebSocket and every ``/v1/`` route need it (Bearer
    header, ``api_key`` query parameter, or the WebSocket subprotocol
    ``rtvideo.key.<key>``); ``/``, ``/health``, ``/health/ready``, ``/health/live``,
    ``/metrics`` and the OpenAPI pages stay open."""
    max_message_bytes: int = setting("network", 1 << 20)
    """Largest client WebSocket message; a larger one closes the socket with 1009
    (enforced by uvicorn, so under ``rtvideo serve``)."""
    max_request_bytes: int = setting("network", 8 << 20)
    """Largest HTTP request body; a larger one is answered 413 before it is read whole."""
    start_timeout_s: float = setting("sessions", 10.0)
    """Time a new WebSocket has to send ``session.start``."""
    header_timeout_s: float = setting("network", 10.0)
    """Time a client has to send a request's head (request line and headers, a
    WebSocket's handshake included), from its connection or from the first byte of
    a later request on the connection; past it: 408 and the connection is closed.
    A request body that sends nothing for as long is answered the same."""
    stall_timeout_s: float = setting("sessions", 60.0)
    """A realtime session whose client sends nothing (not even a ping) for this long is ended."""
    input_timeout_s: float = setting("sessions", 5.0)
    """Video to video: how long a session's next chunk may wait for its input
    frames once nothing else holds it back; past it the session fails with
    ``input_timeout`` (other sessions go on)."""
    max_session_seconds: float = setting("sessions", 3600.0)
    """Wall-clock limit of one realtime session or job."""
    max_frames: int = setting("capacity", 4800)
    """Largest ``num_frames`` (or equivalent) one request may ask for. 4800: five
    minutes at 16 fps, the served models' rate. A job keeps its whole video on
    disk (``data_dir``) until it expires (``job_ttl_s``): five minutes at the tiny model's
    64x64 are 59 MB raw (the ``max_jobs_kept`` 64 jobs: 3.8 GB), 9 MB fmp4, made
    in about 20 s on 2 CPU cores. Longer videos: raise it, or stream a realtime
    session without a length (nothing is held; it runs until stopped)."""
    max_width: int = setting("capacity", 1280)
    """Widest frame a request may ask for (the model may allow less)."""
    max_height: int = setting("capacity", 1280)
    """Tallest frame a request may ask for (the model may allow less)."""
    max_pixels: int | None = setting("capacity", None)
    """Largest frame area (width x height) a session may ask for. Default: what the
    worker measures at start it can run in real time, one session alone, within
    max_realtime_load of each chunk's media time (never below the model's default
    size; not limited where the model cannot be measured at start: a model
    directory on a CPU)."""
    max_realtime_load: float | None = setting("capacity", 0.9)
    """Admission by chunk cost: a new session is refused like a full server when,
    with it, the realtime (paced) sessions would need more than this fraction of
    the worker's time to keep real time (each job counts as one chunk per round).
    A session alone is always admitted. "none" turns the check off."""
    max_jobs_kept: int = setting("jobs", 64)
    """Jobs kept at once: queued, running, or finished less than ``job_ttl_s`` ago. A
    new job beyond it is refused with 429 (too_many_jobs); none is pushed out early."""
    max_queued_jobs: int = setting("jobs", 16)
    """Jobs that may wait for the engine at once; a new one that would wait beyond
    it is refused with 429 (queue_full)."""
    job_ttl_s: float = setting("jobs", 3600.0)
    """How long a finished job (and its video) is kept for download; measured in
    wall-clock time from when it finished, so it holds across restarts."""
    data_dir: str = setting("jobs", "rtvideo-data")
    """Directory where /v1/videos jobs live (relative: to the working directory):
    their records (SQLite, jobs.sqlite3) and videos (media/), so finished jobs
    outlast a restart. Created if missing; one server per directory (a second one
    refused at start)."""
    worker_startup_timeout_s: float = setting("workers", 300.0)
    """How long a worker may take to load its model and say READY."""
    max_worker_restarts: int = setting("workers", 3)
    """Workers restarted after a death within five minutes; past that the replica
    stays down (liveness fails) until it is restarted."""
    worker_wedged_after_s: float = setting("workers", 10.0)
    """The worker heartbeat's one knob: a worker whose loop has answered no probe for
    this long (stopped, deadlocked), or whose one forward has run past max(this,
    10 x the slowest chunk measured at that size; until one is measured, the
    worker startup timeout), is killed: its sessions fail with ``worker_wedged``,
    a fresh worker starts under ``max_worker_restarts``."""
    log_level: str = setting("observability", "info")
    """How much the server logs, the API process and its workers alike: critical,
    error, warning, info or debug. Every line is timestamped and says which
    process wrote it (api, worker[rank]); debug adds, to the line that says where
    a model call that failed a session raised, its whole traceback."""
    shutdown_grace_s: float = setting("workers", 30.0)
    """On SIGTERM: how long running sessions and jobs may go on before they are ended."""
    prompt_policy: str | None = setting("prompts", None)
    """Prompts to refuse, checked before anything starts: a JSON file ('{"deny": ["regex", ...],
    "reason": "..."}': refused when a pattern matches, case ignored) or module:function (called with
    each prompt, returns None or the reason to refuse it; may be async). Refused: prompt_refused,
    naming the field and the reason. A check that fails or takes longer than prompt_policy_timeout_s
    refuses. Null: every prompt is taken (docs/SERVER.md, Prompt policy)."""
    prompt_policy_timeout_s: float = setting("prompts", 5.0)
    """How long the prompt policy may take over one prompt before that prompt is refused."""
    resume_grace_s: float = setting("sessions", 30.0)
    """How long a realtime session whose controlling socket dropped (not closed with
    1000, not stopped) is kept for a ``session.resume``; generation waits meanwhile
    (max_undelivered_seconds). Past it the session ends (reason ``abandoned``)."""
    resume_buffer_seconds: float = setting("sessions", 8.0)
    """Media a realtime session keeps of its newest chunks, for a ``session.resume``
    to send again what a dropped socket lost; a resume from an older chunk is
    refused (``resume_gap``). Memory: this much media per session, encoded."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int | float) or isinstance(value, bool):
                continue
            if not math.isfinite(value):  # NaN passes every comparison, infinity every bound
                raise ValueError(f"{f.name} must be a finite number, got {value}")
            may_be_zero = f.name in ("port", "max_worker_restarts", "decode_nice")
            if value <= 0 and not may_be_zero:
                raise ValueError(f"{f.name} must be > 0, got {value}")
        if self.max_worker_restarts < 0:
            raise ValueError(f"max_worker_restarts must be >= 0, got {self.max_worker_restarts}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be between 0 and 65535, got {self.port}")
        if not self.host:  # an empty host binds every interface: never what an empty variable meant
            raise ValueError("host must not be empty (127.0.0.1: this machine only; 0.0.0.0: every interface)")
        if not self.data_dir:
            raise ValueError("data_dir must not be empty")
        if self.worker_listen is not None and (why := worker_listen_fault(self.worker_listen)) is not None:
            raise ValueError(f"worker_listen {why}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty")
        if self.pp_transport not in PP_TRANSPORTS:
            raise ValueError(f"pp_transport must be {' or '.join(PP_TRANSPORTS)}, got {self.pp_transport!r}")
        if self.pp_port is not None and not 1 <= self.pp_port <= 65536 - self.pp:
            raise ValueError(f"pp_port must leave room for {self.pp} ports: 1 to {65536 - self.pp}, got {self.pp_port}")
        if self.decode_nice is not None and not 0 <= self.decode_nice <= 19:
            raise ValueError(f"decode_nice must be 0 to 19, got {self.decode_nice}")
        if self.decoder not in DECODERS:
            raise ValueError(f"decoder must be one of {', '.join(DECODERS)}, got {self.decoder!r}")
        if self.quantize not in (None, "fp8"):
            raise ValueError(f"quantize must be fp8 or none, got {self.quantize!r}")
        if self.pp_decode not in PP_DECODES:
            raise ValueError(f"pp_decode must be one of {', '.join(PP_DECODES)}, got {self.pp_decode!r}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")
        if self.stream_batch and self.pp < 2:
            raise ValueError(f"stream_batch needs pp >= 2 (pipeline ranks to fill), got pp={self.pp}")
