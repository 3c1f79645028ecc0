"""Wire types: the only values that cross a process boundary.

Every struct here is a frozen, tagged ``msgspec.Struct``. Control messages go
from the API process (``EngineClient``) to worker rank 0; result messages come
back. They are encoded with msgpack by ``rtvideo.engine.transport``; media travels as
``bytes`` payloads, never as pickled tensors. Nothing but wire types lives in
this module.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec


class _Wire(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    """Base of every wire struct: frozen, keyword-only, tagged by ``type``."""


# --------------------------------------------------------------------------
# Shared pieces
# --------------------------------------------------------------------------


class Interaction(msgspec.Struct, frozen=True, kw_only=True):
    """What a prompt interaction asks for.

    ``transition_chunks`` None means "the session's default"; 0 or 1 is a hard
    cut; N >= 2 blends the conditioning over N chunks, the j-th chunk after the
    boundary (j = 0 .. N-1) weighing the new prompt by (j + 1) / N.
    """

    prompt: str
    transition_chunks: int | None = None


class ScheduledInteraction(msgspec.Struct, frozen=True, kw_only=True):
    """An interaction fixed in advance to take effect at chunk ``at_chunk``.

    Request mode and replay use these: a live session's applied log, turned
    into scheduled interactions, regenerates the same frames.
    """

    at_chunk: int
    event_id: str
    interaction: Interaction


class AppliedInteraction(msgspec.Struct, frozen=True, kw_only=True):
    """One entry of a session's replay log: what took effect, and where."""

    event_id: str
    at_chunk: int
    prompt: str
    transition_chunks: int


class VideoInput(msgspec.Struct, frozen=True, kw_only=True):
    """A session's input stream (video to video): frames the client sends, which
    the model encodes and restyles under the prompt (docs/MODEL.md, "Video to
    video"). ``strength`` 1 ignores the input's content (the whole denoise
    schedule from pure noise), 0 returns the input as the VAE reconstructs it;
    in between, each chunk starts from the encoded frames noised to the
    schedule's level nearest ``strength``. Its frames come at ``fps``,
    ``width`` x ``height``, as JPEG images or raw RGB (``format``)."""

    kind: str = "video"  # INPUT_KINDS
    strength: float
    format: str = "jpeg"  # INPUT_FORMATS: jpeg / raw (uint8 RGB, row-major)
    width: int
    height: int
    fps: float


class SessionGeometry(msgspec.Struct, frozen=True, kw_only=True):
    """The effective shape of a session, as the pipeline will produce it."""

    width: int
    height: int
    fps: float
    num_inference_steps: int
    first_chunk_frames: int  # frames decoded from chunk 0
    frames_per_chunk: int  # frames decoded from every later chunk
    num_chunks: int | None  # None: runs until stopped
    transition_chunks: int  # default for interactions that name none
    state_bytes: int = 0  # device memory the session's state holds while open (0: not counted)


class ModelLimits(msgspec.Struct, frozen=True, kw_only=True):
    """What a start may ask of the served model (its ``describe`` refuses the rest;
    ``max_pixels``, the worker's own bound, its control plane refuses); the server
    puts them into its OpenAPI document."""

    size_multiple: int  # width and height must be multiples of it
    max_size: int  # largest width or height
    max_inference_steps: int  # num_inference_steps from 1 to this
    max_fps: float
    max_pixels: int | None = None  # largest width x height this worker admits (None: not limited)
    max_pixels_derived: bool = False  # True: max_pixels is what the worker measured it runs in real time


class ChunkCostSample(msgspec.Struct, frozen=True, kw_only=True):
    """One chunk of one session measured at a frame area (``rtvideo.engine.chunk_cost``)."""

    width: int
    height: int
    pixels: int  # width x height
    step_s: float  # one denoise step: the forward and the sampler step
    chunk_s: float  # the rest of a chunk: its boundary, the commit pass and the decode
    encode_s: float = 0.0
    """Video to video: a (later) chunk's input frames through the VAE encoder
    (``take_input``), which a session with an input costs on top; 0 where not
    measured (the pipeline takes no input)."""


class ChunkTiming(msgspec.Struct, frozen=True, kw_only=True):
    """Worker-side cost of one chunk, measured around the pipeline calls."""

    boundary_ms: float  # open (first chunk), prompt encode, the input frames' encode and the boundary stage
    denoise_ms: float  # every forward (its share of a batched one) and sampler step of the chunk
    decode_ms: float  # the commit pass and the decode
    steps: int  # denoise steps the chunk ran
    runner_calls: tuple[int, ...]  # number of the micro-step that ran each step, in order
    batch_rows: int = 1  # the most sessions' rows in one forward that ran a step of the chunk (1: alone)
    batch_exact: bool = True
    """Every forward of the chunk computed what a forward of its row alone
    computes: true when it ran alone, or batched on a pipeline whose batched
    forward is batch-invariant (the causal Wan pipeline on a CPU, the stub);
    false, a replay (which runs it alone) may differ by a level here and there."""
    chunks_in_flight: int = 1
    """The session's chunks in flight when this one began, itself included: more
    than 1 is stream batch, where the chunk attends to its predecessors'
    provisional keys as far as they had got, which depends on scheduling."""
    encode_ms: float = 0.0  # video to video: of ``boundary_ms``, the input frames' encode (``take_input``)


# --------------------------------------------------------------------------
# Control: API process -> worker rank 0
# --------------------------------------------------------------------------


class StartSession(_Wire, tag="start_session"):
    """Open a session. Answered by ``SessionStarted`` or ``SessionRejected``.

    ``num_chunks`` None runs until ``StopSession``. Sizes and steps are checked
    by the worker against what its pipeline supports.
    """

    session_id: str
    prompt: str
    negative_prompt: str = ""
    seed: int = 0
    width: int | None = None  # None: the pipeline's default
    height: int | None = None
    fps: float | None = None
    num_chunks: int | None = None
    num_inference_steps: int | None = None
    transition_chunks: int = 0
    prompt_change: str = "soft"  # soft / recache / reset: what a prompt change does to the model's cache
    decoder: str | None = None  # full / tiny: what turns its latents into frames; None: the server's (--decoder)
    input: VideoInput | None = None  # video to video: the stream its chunks start from; None: text to video
    max_lead_seconds: float | None = None  # pacing: how far generation may run ahead of the playhead
    scheduled: tuple[ScheduledInteraction, ...] = ()
    # The API process reports ``Delivered`` after each chunk it wrote to the client (a live session): until its
    # first report nothing counts as written, so ``max_undelivered_seconds`` holds the session from its start.
    reports_delivery: bool = False


class SubmitInteraction(_Wire, tag="submit_interaction"):
    """Queue an interaction for the session's next chunk boundary.

    ``event_id`` is an idempotency key: the same id with the same body is a
    no-op; with another body it is rejected (``event_id_conflict``).
    """

    session_id: str
    event_id: str
    interaction: Interaction


class SubmitInput(_Wire, tag="submit_input"):
    """One chunk's input frames for a session opened with an ``input`` (video to
    video): ``count`` frames of ``height`` x ``width``, uint8 RGB, row-major
    (``frames`` holds ``count * height * width * 3`` bytes, frame after frame).
    ``count`` is ``geometry.first_chunk_frames`` for chunk 0 and
    ``frames_per_chunk`` for every later one; chunks come once each, in order
    (the API process gathers and drops camera frames, the worker does not). A
    chunk's boundary waits for its frames, at most ``input_timeout_s``. Frames
    the worker refuses (a wrong count, size or length, a chunk out of order, a
    session opened without an input) fail that session (``invalid_input``)."""

    session_id: str
    chunk_index: int
    count: int
    height: int
    width: int
    frames: bytes


class Playback(_Wire, tag="playback"):
    """The client's playhead, in seconds of session media."""

    session_id: str
    position_seconds: float


class Delivered(_Wire, tag="delivered"):
    """The session's media up to ``media_seconds`` was written to its client's
    socket (the API process says so after each chunk it wrote): pacing holds a
    session whose client does not take what was made."""

    session_id: str
    media_seconds: float


class StopSession(_Wire, tag="stop_session"):
    """End a session; idempotent. Answered by ``SessionDone(stopped=True)``."""

    session_id: str
    reason: str = "stopped"


class Probe(_Wire, tag="probe"):
    """Ask the worker for a ``ProbeReply`` (state held, loop counters)."""

    probe_id: int


class Shutdown(_Wire, tag="shutdown"):
    """Finish: every open session ends with ``SessionDone(reason=...)``."""

    reason: str = "shutdown"


class AttachWorker(_Wire, tag="attach_worker"):
    """The answer to a launched worker's ``WorkerHello``: the engine configuration
    to serve with (``dataclasses.asdict`` of ``rtvideo.engine.config.EngineConfig``), the
    API process's own, so a worker group started elsewhere serves exactly what
    the server was started for."""

    config: dict


class Terminate(_Wire, tag="terminate"):
    """Exit now (a launched worker the API process found wedged): its control
    receiver ends the process at once, whatever the loop is doing."""

    reason: str


ControlMessage = (
    StartSession
    | SubmitInteraction
    | SubmitInput
    | Playback
    | Delivered
    | StopSession
    | Probe
    | Shutdown
    | AttachWorker
    | Terminate
)


# --------------------------------------------------------------------------
# Results: worker rank 0 -> API process
# --------------------------------------------------------------------------


class DeviceInfo(msgspec.Struct, frozen=True, kw_only=True):
    """What a worker computes on (``rtvideo.workers.device_info``): ``/health`` and
    the benchmarks' summaries carry it, so a figure says which machine made it."""

    kind: str  # torch's device type: cuda, cpu, ...
    name: str  # the GPU's name (NVIDIA H200), or the CPU's model on a CPU
    memory_bytes: int | None = None  # the GPU's memory, or the host's on a CPU; None: not known
    capability: str | None = None  # a CUDA GPU's compute capability (9.0); None elsewhere
    cpu: str = "unknown"  # the host CPU's model
    cpu_cores: int = 1  # the cores this process may run on
    torch: str | None = None  # the version of torch imported, else installed; None: none installed
    cuda: str | None = None  # the CUDA version torch was built with; None on a CPU build


class WorkerReady(_Wire, tag="worker_ready"):
    """The READY handshake: the pipeline is built and the loop is running."""

    rank: int
    pid: int
    pipeline: str
    supports_chunk_step_grouping: bool
    grouping: bool  # whether this engine groups the steps of a chunk
    max_sessions: int
    defaults: SessionGeometry  # what a start that sets nothing gets (num_chunks None)
    session_memory_bytes: int | None = None  # device memory open sessions may hold; None: not limited
    max_batch_rows: int = 1  # session rows one forward may carry (EngineConfig.max_batch_rows)
    overlap_decode: bool = False  # chunks decode on a stage of their own while the next chunk denoises
    limits: ModelLimits | None = None  # what a start may ask of the model (None: not said)
    pipeline_ranks: tuple[int, ...] = ()  # pids of pipeline ranks 1..pp-1 (EngineConfig.pp); () with one rank
    blocks_per_rank: tuple[int, ...] = ()  # transformer blocks each rank runs, rank 0 first; () with one rank
    chunk_costs: tuple[ChunkCostSample, ...] = ()  # what a chunk cost at start, by frame area; () if not measured
    max_realtime_load: float | None = None  # admission by chunk cost (EngineConfig.max_realtime_load); None: off
    prompts: tuple[str, ...] = ()  # prompts the model knows, for clients to suggest (a demo model's); () if none
    cpu_threads: int | None = None  # CPU threads rank 0's kernels run on (workers.cpu_threads); None: not on a CPU
    device: DeviceInfo | None = None  # what rank 0 computes on; None: not said


class WorkerHello(_Wire, tag="worker_hello"):
    """A worker group started by a launcher (``torchrun``, ``rtvideo.workers.launch``) has
    connected: its rank 0 asks for the configuration (``AttachWorker``), then
    builds and says ``WorkerReady`` as a spawned worker does."""

    host: str
    pid: int
    world_size: int  # the ranks the launcher started: the pipeline ranks (EngineConfig.pp)


class WorkerExiting(_Wire, tag="worker_exiting"):
    """A launched worker's last message before its process exits (a spawned
    worker's exit is seen on its process sentinel instead)."""

    code: int  # the exit code it is about to exit with (0: shut down as asked)
    reason: str


class WorkerStartupFailed(_Wire, tag="worker_startup_failed"):
    """The worker could not build its pipeline; it exits after sending this."""

    rank: int
    error: str


class SessionStarted(_Wire, tag="session_started"):
    """The session was admitted; ``geometry`` is its effective configuration."""

    session_id: str
    geometry: SessionGeometry


class SessionRejected(_Wire, tag="session_rejected"):
    """The start was refused. ``code``: server_full, invalid_request, duplicate_session, shutting_down."""

    session_id: str
    code: str
    message: str


class ChunkReady(_Wire, tag="chunk_ready"):
    """One finished chunk: metadata plus its frames as uint8 RGB bytes.

    ``payload`` holds ``num_frames * height * width * 3`` bytes, frame-major.
    The three event-id lists say which interactions began with this chunk,
    which were in effect during it (a transition in progress, or the cut that
    began here), and which finished with it (including superseded ones).
    """

    session_id: str
    generation_chunk_index: int
    num_frames: int
    first_frame_index: int
    media_start_seconds: float
    width: int
    height: int
    started_event_ids: tuple[str, ...]
    active_event_ids: tuple[str, ...]
    completed_event_ids: tuple[str, ...]
    timing: ChunkTiming
    payload: bytes


class InteractionQueued(_Wire, tag="interaction_queued"):
    """The worker's mailbox accepted the interaction.

    ``in_progress_chunk_index`` is the chunk being generated at acceptance
    (None between chunks). ``expected_chunk_index`` is the chunk it will take
    effect at unless superseded. ``duplicate`` marks a repeat of a known
    event_id with the same body (nothing changed).
    """

    session_id: str
    event_id: str
    in_progress_chunk_index: int | None
    expected_chunk_index: int
    duplicate: bool = False


class InteractionApplied(_Wire, tag="interaction_applied"):
    """The interaction took effect at the first frame of ``generation_chunk_index``."""

    session_id: str
    event_id: str
    generation_chunk_index: int
    first_frame_index: int
    media_start_seconds: float
    queued_to_applied_ms: float
    transition_chunks: int
    chunks_in_flight: int = 1
    """The session's chunks being generated when this one began, itself included:
    1 when exact; with stream batch up to ``EngineConfig.max_chunks_in_flight``
    (the chunks before it were already under way with the prompt before)."""


class InteractionSuperseded(_Wire, tag="interaction_superseded"):
    """A later interaction replaced this one before it reached a boundary."""

    session_id: str
    event_id: str
    by_event_id: str


ENDED_BEFORE_BOUNDARY = "the session ended before this interaction reached a chunk boundary"
"""``session_ended``'s message for an interaction still waiting when its session ended: the
worker's, for those its mailbox held, and the API process's, for one sent as the end arrived."""


class InteractionRejected(_Wire, tag="interaction_rejected"):
    """The interaction was refused. ``code``: unknown_session, invalid_interaction,
    event_id_conflict, interaction_too_late, session_ended (the session is
    stopping, or ended before a boundary took the interaction), session_failed
    (the session failed before the interaction took effect)."""

    session_id: str
    event_id: str
    code: str
    message: str


class SessionDone(_Wire, tag="session_done"):
    """The session ended and the worker holds nothing for it any more.

    ``reason``: completed; else the reason given to ``StopSession`` (stopped by
    default) or to ``Shutdown`` (shutdown by default, parent_exited when the
    worker saw its parent die). ``applied`` is the replay log of the chunks it
    delivered (``chunks``, from 0): the same start with these as scheduled
    interactions and ``num_chunks=chunks`` regenerates them. A prompt applied at
    a chunk that was begun but never delivered (the session stopped while it
    was in the pipeline) is not in it: it changed nothing that was delivered.
    """

    session_id: str
    chunks: int
    frames: int
    stopped: bool
    reason: str
    applied: tuple[AppliedInteraction, ...]


class SessionFailed(_Wire, tag="session_failed"):
    """The session ended on an error; nothing holds it any more. ``code``:
    pipeline_error (sent by the worker's loop when a pipeline call failed);
    invalid_input (video to video: frames the worker refused, ``SubmitInput``);
    input_timeout (video to video: a chunk's frames did not come within
    ``input_timeout_s`` of its boundary being due);
    worker_died and engine_shutdown (made by ``EngineClient`` in the API process
    for every open session, when the worker process died, respectively when the
    client shut down with the session still open)."""

    session_id: str
    code: str
    message: str


class EngineDead(_Wire, tag="engine_dead"):
    """The engine cannot go on; every open session has failed."""

    reason: str


class ProbeReply(_Wire, tag="probe_reply"):
    """Worker state, for health checks and for tests that prove a release.

    ``runner_sessions`` and ``pipeline_sessions`` list every session for which
    the runner, respectively the pipeline, still holds state.
    """

    probe_id: int
    sessions: tuple[str, ...]  # admitted and not yet done
    runner_sessions: tuple[str, ...]
    pipeline_sessions: tuple[str, ...]
    iterations: int  # micro-steps executed
    busy_s: float  # wall time the engine had work planned or in flight
    pipeline_s: float  # of which inside pipeline calls
    steps: int  # denoise steps run
    chunks: int  # chunks finished
    executing_s: float = 0.0  # how long the micro-step running now has run (0: none); a stuck forward grows it


class RankFigures(msgspec.Struct, frozen=True, kw_only=True):
    """One pipeline rank's time since it started, cumulative: computing (busy) and
    inside micro-steps (wall: busy plus waiting on the ranks before it, the bubble),
    and the chunks it decoded (``pp_decode``: where the sessions' decodes went).
    Ring messages carry the later ranks' round to rank 0 (``RingHeader.figures``,
    ``decoded_chunks`` 0 there: rank 0 counts the decodes)."""

    rank: int
    busy_s: float
    wall_s: float
    decoded_chunks: int = 0


class EngineStats(_Wire, tag="engine_stats"):
    """The engine's scheduling figures, cumulative since the worker started; the
    loop sends them about once a second while it has work (metrics)."""

    micro_steps: int
    rows: int  # rows that entered the pipeline, summed over micro-steps (÷ micro_steps: the mean batch)
    rows_per_micro_step: int  # the limit now (the SLO controller's choice with --pp; else --max-batch-rows)
    micro_step_s: float  # the smoothed wall time of a micro-step (0 before the first)
    slo_decisions: dict[str, int]  # the SLO controller's decisions by action (hold, decrease, increase)
    ranks: tuple[RankFigures, ...]
    step_graphs: dict[str, int] = {}  # captured steps (cuda_graphs): captures, replays, fallbacks, held; {}: none


ResultMessage = (
    WorkerReady
    | WorkerStartupFailed
    | SessionStarted
    | SessionRejected
    | ChunkReady
    | InteractionQueued
    | InteractionApplied
    | InteractionSuperseded
    | InteractionRejected
    | SessionDone
    | SessionFailed
    | EngineDead
    | ProbeReply
    | EngineStats
    | WorkerHello
    | WorkerExiting
)


# --------------------------------------------------------------------------
# Between pipeline ranks (workers.parallel): plans, ring headers, decode frames
# --------------------------------------------------------------------------
# Ranks run the same code, so a field a rank does not know is an error
# (``forbid_unknown_fields``), as is a missing tag: ``rtvideo.engine.transport.decode_rank``.


class RankRow(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One row a rank runs: denoise step ``step`` of chunk ``chunk_index`` of a
    session (``step`` = the chunk's steps: its commit pass)."""

    session_id: str
    chunk_index: int
    step: int


class RankBoundary(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A chunk boundary a later rank follows (its blocks' cache follows rank 0's)."""

    session_id: str
    chunk_index: int
    prompt_changed: bool  # an interaction applies at it (a ``reset`` prompt change empties the cache)


class RankPlan(_Wire, tag="rank_plan", forbid_unknown_fields=True):
    """A micro-step's plan, rank 0 to every later rank, in order (the same bytes
    to each): a follower releases, opens and follows boundaries as rank 0 does,
    then runs its own rows (``ranks[its rank]``) as the ring brings them."""

    number: int  # the micro-step's number: the tag of the ring messages it runs
    release: tuple[str, ...] = ()  # session ids whose state is freed
    open: tuple[StartSession, ...] = ()  # sessions to open (each rank allocates its blocks' cache)
    boundaries: tuple[RankBoundary, ...] = ()
    ranks: tuple[tuple[RankRow, ...], ...] = ()  # per rank, rank 0 first: the rows it runs in this micro-step


class TensorSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One tensor a ring message carries after its header, in order."""

    shape: tuple[int, ...]
    dtype: str  # torch's name of it (``str(tensor.dtype)``), one the link knows (``workers.parallel.link.DTYPES``)


class RingItem(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One pass a ring message carries: a forward over some rows, or one row's
    commit pass, and how many of the message's tensors are its own (the next
    ``count`` after the items before it)."""

    kind: Literal["forward", "commit"]
    count: int
    meta: dict[str, Any] | None = None
    """Hidden states going to the next rank: the pipeline's description of them
    (``pack``; opaque here), None on the way back to rank 0."""
    rows: tuple[tuple[str, int, int], ...] = ()
    """On the way back to rank 0: (session, chunk, step) of each prediction (a
    forward; ``count`` of them) or finished commit pass (``count`` 0)."""

    def __post_init__(self) -> None:
        if self.count < 0:
            raise ValueError(f"a ring item's count must be >= 0, got {self.count}")
        if self.meta is None and len(self.rows) != self.count and self.kind == "forward":
            raise ValueError(f"a forward coming back names {len(self.rows)} rows for {self.count} predictions")


class RingHeader(_Wire, tag="ring_header", forbid_unknown_fields=True):
    """The header of a ring message, one rank to the next (the last rank: to rank 0)
    for one micro-step (the link's tag); its tensors follow it."""

    items: tuple[RingItem, ...] = ()
    failed: dict[str, str] = msgspec.field(default_factory=dict)  # session -> why a rank failed it (rows dropped)
    figures: tuple[RankFigures, ...] = ()  # every rank's figures so far, as the ranks it passed left them
    tensors: tuple[TensorSpec, ...] = ()  # the tensors that follow, in order (the link sets it as it sends)
    inline: bool = True  # the tensors travel inside the header's buffer (``RingLink``; the link sets it)


# The decode stage's frames between rank 0 and a follower (``rtvideo.workers.parallel.rank_decode``:
# rank 0's side; ``rtvideo.workers.parallel.decode_server``: the follower's), on the ranks' decode
# connections. ``tensors`` says what follows each header (the sockets set it as they send).


class DecodeWhole(_Wire, tag="decode_whole", forbid_unknown_fields=True):
    """A ``DECODE`` frame: decode a whole chunk of a session; its one tensor is the
    chunk's clean latent."""

    session_id: str
    chunk_index: int
    tensors: tuple[TensorSpec, ...] = ()


class DecodeFront(_Wire, tag="decode_front", forbid_unknown_fields=True):
    """A ``DECODE`` frame: latent frame ``part`` of a split chunk, through the
    decoder's first ``split`` stages on rank 0; its one tensor is the activation,
    ``meta`` the pipeline's description of it (``decode_front``; opaque here)."""

    session_id: str
    chunk_index: int
    split: int
    part: int
    meta: dict[str, Any] = msgspec.field(default_factory=dict)
    tensors: tuple[TensorSpec, ...] = ()


class DecodeFrontEnd(_Wire, tag="decode_front_end", forbid_unknown_fields=True):
    """A ``DECODE`` frame: the last of a split chunk, after its parts: rank 0's
    front time, and whether the front was abandoned (``cancelled``) or failed
    (``error``)."""

    session_id: str
    chunk_index: int
    split: int
    front_ms: float = 0.0
    error: str | None = None
    cancelled: bool = False
    tensors: tuple[TensorSpec, ...] = ()


class DecodeFronts(_Wire, tag="decode_fronts", forbid_unknown_fields=True):
    """A ``DECODE`` frame: latent frame ``part`` of a batch of split chunks
    (``rows``: session and chunk of each, in the batch's order), through the
    front as one batch; its one tensor holds every row's activation."""

    rows: tuple[tuple[str, int], ...]
    split: int
    part: int
    meta: dict[str, Any] = msgspec.field(default_factory=dict)
    tensors: tuple[TensorSpec, ...] = ()

    def __post_init__(self) -> None:
        if not self.rows:
            raise ValueError("a batch of split chunks names no rows")


class DecodeFrontsEnd(_Wire, tag="decode_fronts_end", forbid_unknown_fields=True):
    """A ``DECODE`` frame: the last of a batch of split chunks (``rows`` as its
    parts'): rank 0's front time, whether the batch was abandoned
    (``cancelled``), or, with ``retry``, that it failed on rank 0 and each chunk
    comes again alone (the follower drops the batch unanswered)."""

    rows: tuple[tuple[str, int], ...]
    split: int
    front_ms: float = 0.0
    cancelled: bool = False
    retry: bool = False
    tensors: tuple[TensorSpec, ...] = ()

    def __post_init__(self) -> None:
        if not self.rows:
            raise ValueError("a batch of split chunks names no rows")


class DecodeCancel(_Wire, tag="decode_cancel", forbid_unknown_fields=True):
    """A ``CANCEL`` frame: the session is stopping (its decodes on the follower
    are abandoned), or, with ``ended``, it was released and the cancel is over."""

    session_id: str
    ended: bool = False
    tensors: tuple[TensorSpec, ...] = ()


class Decoded(_Wire, tag="decoded", forbid_unknown_fields=True):
    """A ``DECODED`` frame, a follower to rank 0: one chunk's decode, its frames
    (``frames``: count, width, height; their RGB bytes the one tensor) or why
    there are none (``error``, ``cancelled``)."""

    session_id: str
    chunk_index: int
    ms: float
    frames: tuple[int, int, int] | None = None
    error: str | None = None
    cancelled: bool = False
    tensors: tuple[TensorSpec, ...] = ()


DecodeRequest = DecodeWhole | DecodeFront | DecodeFrontEnd | DecodeFronts | DecodeFrontsEnd
"""What a ``DECODE`` frame carries."""

DecodeFrame = DecodeRequest | DecodeCancel | Decoded

RankMessage = RankPlan | RingHeader | DecodeFrame
