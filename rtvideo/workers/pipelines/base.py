"""The ``ChunkPipeline`` contract: the stages a model implements so the runner
can drive it one forward at a time.

Runs in a worker process. A pipeline keeps no progress of its own: which chunk
and which denoise step a call is about comes from the row the engine planned
(``BatchRow``, from ``rtvideo.engine.plan.StepRow``), or from the chunk index passed
in. What it keeps per session is a typed state (a ``SessionState`` subclass:
``CausalWanSession``, ``StubSession``) of tensors and caches, whose
``chunks`` hold one record per chunk in flight (a ``ChunkRecord`` subclass:
the chunk's noise draws, the latent being denoised, its clean latent, its
conditioning), keyed by chunk index, so that chunk k can be decoded while
chunk k+1 denoises.

The stages, and which rank of a pipeline split over ranks (by transformer
blocks) runs each; with one rank, that rank runs them all. The runner
(``rtvideo.workers.runner.ModelRunner``) calls them, per session, in this order:

    encode_prompt            first rank   when the session opens, and for an interaction
    open                     all ranks    once, allocate the session's tensors
    boundary                 first rank   at every chunk: apply an interaction, prepare the chunk
    forward                  each rank    x steps: its block range over a batch of rows
    sampler_step             last rank    x steps: one row's sampler update
    commit                   each rank    after the last step: the clean pass into the KV cache
    decode                   last rank    after the commit: the chunk's frames
    release                  all ranks    when the session ends, always

A chunk's records move through prepared (boundary) -> denoised (last
``sampler_step``) -> committed (``commit``) -> gone (``decode``). A stage
asked for a chunk that is not where it needs it refuses with
``ChunkOrderError``, and so does a stage that would break the chunks' order:
chunk k+1's boundary and forwards need chunk k committed (it attends to
chunk k's keys), and chunks decode in order (the decoder's causal cache).

Everything a pipeline allocates for a session lives in its ``SessionState``
or in a pool keyed by the session id, and is gone after ``release``;
``held_sessions`` lets the worker prove it.

A long call may be abandoned: the runner runs ``forward``, ``commit`` and
``decode`` inside ``abandon_when(check)``, and the pipeline calls
``abandon_point()`` where stopping is cheap and safe (between transformer
blocks, between decoded latent frames), which raises ``Abandoned`` once the
check says every row of the call belongs to a session that is stopping. What
an abandoned call leaves is only ever read again by ``release``: a forward
writes nothing a later forward trusts (a stream-batch forward may have staged
some layers' provisional keys), a commit leaves the chunk uncommitted (some
layers' keys staged, never committed), a decode leaves the session's decoder
cache part-way through the chunk and the chunk's record in place, so the
runner runs no later decode of that session.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Generic, NamedTuple, Protocol, TypeVar, runtime_checkable

from rtvideo.engine.messages import ModelLimits, SessionGeometry, StartSession
from rtvideo.engine.plan import ChunkOutput

if TYPE_CHECKING:
    from rtvideo.workers.pipelines.capabilities import Capabilities


class ChunkOrderError(RuntimeError):
    """A stage was asked for a chunk that is not ready for it (not prepared, at
    another step, not denoised, not committed), or out of the chunks' order."""


class Abandoned(BaseException):  # noqa: N818 -- like CancelledError: not an error, and not caught as one
    """Raised by ``abandon_point`` when the running call's check says stop. A
    ``BaseException``, as ``asyncio.CancelledError`` is: the handlers that turn a
    pipeline's exception into a failed session (``except Exception``) let it
    through to the runner, which reports the rows cancelled, not failed."""


_abandon = threading.local()  # per thread: the forward and the decode stage run on threads of their own


@contextmanager
def abandon_when(check: Callable[[], bool] | None) -> Iterator[None]:
    """Within the block, ``abandon_point()`` on this thread raises ``Abandoned``
    once ``check()`` is true (None: never). Nests; the outer check is restored
    on exit."""
    outer = getattr(_abandon, "check", None)
    _abandon.check = check
    try:
        yield
    finally:
        _abandon.check = outer


def abandon_point() -> None:
    """Where a long pipeline call may stop (between blocks, between latent
    frames): raises ``Abandoned`` when the check of the enclosing
    ``abandon_when`` on this thread is true; a no-op outside one."""
    check = getattr(_abandon, "check", None)
    if check is not None and check():
        raise Abandoned


@dataclass
class ChunkRecord:
    """One chunk of one session, from its boundary until it is decoded. Each
    pipeline subclasses it with the chunk's tensors."""

    index: int
    steps: int  # the chunk's denoise steps
    at_step: int = 0
    """The denoise step its latent is the input of: the noise level it sits at
    (``steps`` once it is clean). Set from the row each ``sampler_step`` runs;
    a forward or sampler step planned at another step is refused."""
    committed: bool = False  # written into the session's caches; only decode is left
    committing: bool = False  # its commit pass is under way through the pipeline ranks (split over ranks)

    @property
    def denoised(self) -> bool:
        return self.at_step == self.steps


C = TypeVar("C", bound=ChunkRecord)


@dataclass(kw_only=True)
class SessionState(Generic[C]):
    """One session's state as a pipeline keeps it: what it was started with and,
    in subclasses, its tensors and caches; ``chunks`` holds the chunks in flight.
    No counters: the planned rows say which chunk and step a call is about."""

    session_id: str
    start: StartSession
    geometry: SessionGeometry
    chunks: dict[int, C] = field(default_factory=dict)
    """Two threads change it while a decode stage runs beside the micro-steps:
    a boundary adds a chunk (the micro-step thread) while a decode removes an
    earlier one (the decode thread). So the checks below read a snapshot of it
    (``tuple(...)``, which CPython takes without letting another thread run),
    never iterate the dict itself: a change mid-iteration raises, failing the
    session. What a snapshot may miss cannot change a check: a decode removes
    only committed chunks, and a boundary adds only a later one."""
    lookahead: int = 1
    """Chunks it may have in flight before the earliest is committed: 1 is exact
    (a chunk is prepared and run only after every chunk before it is committed);
    more is stream batch, where a chunk runs while up to ``lookahead - 1`` chunks
    before it are still in flight (it is still committed only after them)."""

    def check_boundary(self, index: int) -> None:
        """Chunk ``index`` may be prepared: it is not yet, and fewer than ``lookahead``
        chunks before it are in flight uncommitted."""
        if index in self.chunks:
            raise ChunkOrderError(f"session {self.session_id}: chunk {index} is already prepared")
        self._check_earlier_committed(index, "be prepared", self.lookahead - 1)

    def chunk_at(self, row: BatchRow) -> C:
        """The record of ``row``'s chunk, which must be prepared, at ``row.step``,
        and after committed chunks only (its forward attends to them)."""
        chunk = self.chunks.get(row.chunk_index)
        if chunk is None:
            raise ChunkOrderError(f"session {self.session_id}: chunk {row.chunk_index} was not prepared (no boundary)")
        if chunk.at_step != row.step:
            where = "denoised" if chunk.denoised else f"at step {chunk.at_step}"
            raise ChunkOrderError(
                f"session {self.session_id}: chunk {row.chunk_index} is {where}, but the row asks for step {row.step}"
            )
        self._check_earlier_committed(row.chunk_index, "run", self.lookahead - 1)
        return chunk

    def chunk_to_commit(self, index: int) -> C:
        """The record of chunk ``index``, denoised and not yet committed, after
        committed chunks only (split over ranks: or chunks whose commit pass went
        through the ranks ahead of it, ``committing``)."""
        chunk = self.chunks.get(index)
        if chunk is None or not chunk.denoised or chunk.committed:
            state = "not prepared" if chunk is None else "already committed" if chunk.committed else "not denoised"
            raise ChunkOrderError(f"session {self.session_id}: cannot commit chunk {index}: it is {state}")
        self._check_earlier_committed(index, "be committed", committing_counts=True)
        return chunk

    def chunk_to_decode(self, index: int) -> C:
        """The record of chunk ``index``, committed, with every earlier chunk decoded."""
        chunk = self.chunks.get(index)
        if chunk is None or not chunk.committed:
            state = "not prepared" if chunk is None else "not committed"
            raise ChunkOrderError(f"session {self.session_id}: cannot decode chunk {index}: it is {state}")
        earlier = [i for i in tuple(self.chunks) if i < index]
        if earlier:
            raise ChunkOrderError(
                f"session {self.session_id}: chunk {index} cannot be decoded before chunk {min(earlier)}"
            )
        return chunk

    def _check_earlier_committed(
        self, index: int, what: str, allowed: int = 0, committing_counts: bool = False
    ) -> None:
        """At most ``allowed`` chunks before ``index`` are in flight uncommitted
        (with ``committing_counts``, a chunk whose commit pass is under way counts
        as committed)."""
        pending = sorted(
            i
            for i, chunk in tuple(self.chunks.items())
            if i < index and not chunk.committed and not (committing_counts and chunk.committing)
        )
        if len(pending) > allowed:
            raise ChunkOrderError(
                f"session {self.session_id}: chunk {index} cannot {what} before chunk {pending[0]} is committed"
            )


class BatchRow(NamedTuple):
    session_id: str
    chunk_index: int
    step: int  # the denoise step this forward computes (0-based)


class StepBatch(NamedTuple):
    """The rows of one forward, in the order of its sessions.
    (Named tuples: built once per denoise step, so cheap to make.)"""

    rows: tuple[BatchRow, ...]


@dataclass
class Hidden:
    """What a forward (or commit) over blocks ``[a, b)`` hands the one over
    ``[b, c)``: the rows' hidden states and what the later blocks and the head
    need with them (pipeline-specific, opaque to the runner)."""

    blocks_done: int  # the range's stop: where the next range must start
    rows: tuple[BatchRow, ...]  # the batch it was computed for
    tensors: Any


def block_range(blocks: range | None, num_blocks: int) -> range:
    """``blocks``, or every block when None; ``ValueError`` unless it is a
    non-empty, contiguous range within ``[0, num_blocks)``."""
    if blocks is None:
        return range(num_blocks)
    if blocks.step != 1 or not 0 <= blocks.start < blocks.stop <= num_blocks:
        raise ValueError(f"blocks must be a non-empty contiguous range within 0..{num_blocks}, got {blocks}")
    return blocks


def check_hidden(hidden: Hidden | None, blocks: range, rows: tuple[BatchRow, ...]) -> None:
    """A range that starts at block 0 embeds and takes no ``hidden``; a later one
    takes the ``hidden`` of the range before it, for the same rows."""
    if blocks.start == 0:
        if hidden is not None:
            raise ValueError("a range from block 0 embeds its rows: it takes no hidden states")
        return
    if hidden is None or hidden.blocks_done != blocks.start or hidden.rows != rows:
        done = None if hidden is None else hidden.blocks_done
        raise ValueError(f"blocks from {blocks.start} need the hidden states of the range ending there, got {done}")


def chosen_decoder(start: StartSession, default: str, loaded: Iterable[str], model: str) -> str:
    """The decoder a session's frames come from: its own choice (``decoder``) or
    ``default``; ``ValueError`` naming the field when the model has not loaded
    it (a tiny decoder needs its weights: docs/MODEL.md)."""
    kind = start.decoder or default
    if kind not in loaded:
        raise ValueError(
            f"decoder: the {model!r} model has no {kind} decoder loaded (it has: {', '.join(loaded)}); "
            "a tiny one needs its weights (rtvideo convert --tiny-decoder FILE MODEL_DIR)"
        )
    return kind


def refuse_negative_prompt(start: StartSession, model: str) -> None:
    """For a pipeline that samples without classifier-free guidance (``describe``
    calls it): a negative prompt could change nothing, so it is refused with a
    ``ValueError`` naming the field, never accepted and ignored. Blank is fine."""
    if start.negative_prompt.strip():
        raise ValueError(
            f"negative_prompt: the {model!r} model samples without classifier-free guidance, "
            "so a negative prompt would have no effect; leave it out"
        )


@runtime_checkable
class ChunkPipeline(Protocol):
    name: ClassVar[str]
    supports_chunk_step_grouping: ClassVar[bool]
    """Whether the engine may run a begun chunk's steps back to back (grouping)."""
    supports_micro_step_execution: ClassVar[bool]
    """Whether ``forward`` and ``commit`` take block ranges and hand hidden states
    between them, and chunks are records of their own: what splitting the blocks
    over ranks and overlapping chunks of a session (temporal pipeline
    parallelism) need."""
    decode_overlap_pays: bool
    """Whether decoding on a stage of its own, while the next chunk denoises, is
    worth it here: what the worker does unless ``EngineConfig.overlap_decode``
    says otherwise. On a GPU the decode gets a stream of its own and overlaps;
    on a small CPU two threads only contend for the same cores."""
    num_blocks: int
    """Transformer blocks; a block range is within ``[0, num_blocks)``."""
    max_batch_rows: int
    """How many session rows one ``forward`` may carry. A worker builds its
    pipeline with ``EngineConfig.max_batch_rows`` (``--max-batch-rows``), the one
    knob for it; sizes that depend on it (attention buffers, memory) follow."""
    warm_up_chunks: int
    """Chunks of a throwaway session the worker runs before READY (``rtvideo.workers.warmup``); 0: none."""
    capture_chunks: int
    """Chunks a session of one row runs before its steps' captured graphs are all
    captured (0: it captures none); the warm-up runs its session alone at least
    that many (``rtvideo.workers.warmup``)."""
    batch_invariant: bool
    """Whether a row of a batched forward computes bit for bit what it computes
    alone; the runner reports a chunk batched on a pipeline without it as not
    replay-exact. Read at every batched forward (it may depend on the device)."""
    device: Any
    """The ``torch.device`` it computes on; None for a pipeline without one (the
    stub's host arithmetic). ``rtvideo.workers.pipelines.capabilities.device_type``."""
    capabilities: Capabilities
    """The optional parts it implements (``rtvideo.workers.pipelines.capabilities``:
    batched commits and decodes, decodes on another rank, the decoder or the
    blocks split over ranks, ...), checked once when it is built; the worker
    asks this, never the object, whether it may call one."""

    def describe(self, start: StartSession) -> SessionGeometry:
        """The effective geometry of ``start``, defaults filled in. Raises
        ``ValueError`` naming the offending field. Pure: called from the
        control thread while the executor thread runs other sessions."""
        ...

    def encode_prompt(self, prompt: str) -> Any:
        """First rank. The text's embeddings, as ``open`` and ``boundary`` take
        them; cached by text. Reads the text encoder, writes the prompt cache."""
        ...

    def open(self, start: StartSession, geometry: SessionGeometry, prompt: Any) -> SessionState:
        """All ranks, once per session. Allocates the session's tensors and caches
        (each rank its own share) and returns its state, conditioned on ``prompt``
        (``encode_prompt`` of ``start.prompt``). Reads the geometry; writes only
        the new state (and the pipeline's list of held sessions). Holds nothing
        if it raises."""
        ...

    def boundary(self, session: SessionState, chunk_index: int, prompt: Any = None, transition_chunks: int = 0) -> None:
        """First rank, at every chunk. If ``prompt`` (encoded) is given, switch to it
        from this chunk on (a hard cut for 0 or 1 transition chunks, else a blend)
        and apply ``start.prompt_change`` to the session's caches; then prepare
        chunk ``chunk_index``: its record, with its conditioning and noise draws.
        Reads and writes the session's prompt (and transition), its caches when
        the prompt change touches them (a reset, a re-cache from the cached
        chunks' clean latents); writes the new chunk record. Refuses unless
        every earlier chunk in flight is committed."""
        ...

    def forward(
        self, batch: StepBatch, sessions: Sequence[SessionState], blocks: range | None = None, hidden: Any = None
    ) -> Any:
        """Each rank, its block range (None: every block). One pass over the rows
        of ``batch`` (``sessions`` in the same order), each row at its own chunk
        and step: a range from block 0 embeds the rows' latents (reads their chunk
        records), a later one continues from ``hidden``, the ``Hidden`` the range
        before it returned; a range that ends at the last block applies the head
        and returns one prediction per row, any other returns its ``Hidden``.
        Reads the sessions' caches; writes nothing (the runner may rerun a row
        alone to find which one fails). Refuses a row whose chunk is not
        prepared, or is at another step. Calls ``abandon_point()`` between
        blocks."""
        ...

    def sampler_step(self, session: SessionState, row: BatchRow, prediction: Any) -> None:
        """Last rank, once per row and step. The sampler update of ``row``'s chunk
        (``x0 = x_t - sigma * v``, re-noised to the next step's level; after the
        last step, the chunk's clean latent). Reads and writes that chunk's record."""
        ...

    def commit(self, session: SessionState, chunk_index: int, blocks: range | None = None, hidden: Any = None) -> Any:
        """Each rank, its block range, in order, after the chunk's last step: the
        clean pass (the clean latent at t = 0) that writes the chunk into the
        session's caches. Reads the chunk's clean latent and conditioning (from
        block 0) or ``hidden``; writes its blocks' keys and values into the KV
        cache, and at the last block marks the record committed (and keeps the
        clean latent for a re-cache). Returns the ``Hidden`` for the next range,
        or None once the last block has run. Refuses a chunk not denoised, or
        one after an uncommitted chunk. Calls ``abandon_point()`` between blocks
        (abandoned: the record is not marked committed)."""
        ...

    def decode(self, session: SessionState, chunk_index: int) -> ChunkOutput:
        """Last rank, chunks in order, after the commit: the chunk's frames. Reads its
        clean latent, reads and writes the session's decoder cache, drops the
        record. Refuses a chunk not committed, or one with an earlier chunk still
        undecoded. Calls ``abandon_point()`` between latent frames (abandoned:
        the decoder cache is part-way through the chunk; the record stays)."""
        ...

    def release(self, session: SessionState) -> None:
        """All ranks. The session ended: free everything held for it (its state's
        tensors, chunk records included, and what pools keep for it). Must not
        raise twice."""
        ...

    def held_sessions(self) -> tuple[str, ...]:
        """Session ids the pipeline still holds allocations for."""
        ...

    def limits(self) -> ModelLimits:
        """What ``describe`` accepts: size multiple, largest size, most steps, highest fps."""
        ...

    def session_memory_budget(self) -> int | None:
        """Device memory, in bytes, that open sessions' state may hold together,
        as found after the warm-up (``SessionGeometry.state_bytes`` is what one
        session holds); None: not limited (a CPU). Called once, before READY."""
        ...
