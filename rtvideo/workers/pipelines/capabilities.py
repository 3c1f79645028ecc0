"""What a pipeline can do beyond the ``ChunkPipeline`` stages: declared, not probed.

Runs in a worker process; pure Python (a worker serving the stub never imports
torch). Each pipeline class declares ``capabilities``, a ``Capabilities``:
which of the optional parts below it implements, each part a small protocol
of the methods (and attributes) it needs. ``check_pipeline`` runs once, when
the worker builds the pipeline (``rtvideo.workers.pipelines.build_pipeline``: a
registered name or a factory's import path alike), and refuses with
``PipelineContractError``, naming the pipeline and the method, one that lacks
a ``ChunkPipeline`` member, or declares a part without implementing it (a
method missing, not callable, or not taking the arguments the protocol
gives it), or declares a part without the one it builds on. From then on the
worker asks the declaration (``pipeline.capabilities.decode_batch``), never
the object: an optional method a pipeline has but does not declare is never
called.

The parts, and who calls them:

    commit_batch        BatchedCommit       the runner: the chunks a forward finished, committed together
    decode_batch        BatchedDecode       the runner and the decode stage: chunks of several sessions decoded together
    rank_decode         RankDecode          pipeline ranks: a session's chunks decoded whole on another rank
    rank_decode_batch   RankDecodeBatch     ... and several sessions' together there (needs rank_decode)
    split_decode        SplitDecode         pipeline ranks: a session's decoder split over two ranks (needs rank_decode)
    split_decode_batch  SplitDecodeBatch    ... several sessions' split chunks as one batch (needs split_decode)
    pipeline_ranks      PipelineRanks       the transformer's blocks split over ranks (needs
                                            ``supports_micro_step_execution``)
    kv_window           KvWindow            calibration: how many chunks fill a session's KV cache
    video_input         VideoInputs         the runner: a session's input frames (video to video) before each
                                            boundary; a start with an ``input`` is refused without it
    synchronize         Synchronize         timings: wait for the device's queued work
    step_graphs         StepGraphCounts     metrics: the captured steps' counts (captures, replays, eager
                                            first uses), reported with the engine's figures
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields
from typing import Any, Protocol

from rtvideo.engine.plan import ChunkOutput
from rtvideo.workers.pipelines.base import ChunkPipeline, Hidden, SessionState


class PipelineContractError(TypeError):
    """A pipeline does not implement what the ``ChunkPipeline`` contract or its own
    declared ``capabilities`` say it does; the message names the pipeline and
    the member."""


class BatchedCommit(Protocol):
    def commit_batch(self, sessions: Sequence[SessionState], chunk_indices: Sequence[int]) -> None:
        """``commit`` (every block, one rank) of one chunk of each of several
        sessions at once, all or nothing. The runner calls it for the rows whose
        chunks a forward finished together, and commits each alone when it
        raises."""
        ...


class BatchedDecode(Protocol):
    def decode_batch(self, sessions: Sequence[SessionState], chunk_indices: Sequence[int]) -> list[ChunkOutput]:
        """``decode`` of one chunk of each of several sessions at once, their
        frames in the same order, all or nothing (when it raises or is abandoned
        no session changed). The runner calls it for the chunks a forward
        commits together when it decodes in line, the decode stage for the
        decodes waiting on a lane (``RunnerSessions.decode_many``); each decodes
        alone when it raises."""
        ...


class RankDecode(Protocol):
    def decode_input(self, session: SessionState, chunk_index: int) -> Any:
        """What another rank needs to decode a committed chunk; drops the chunk's
        record, as ``decode`` does."""
        ...

    def decode_latent(self, session: SessionState, clean: Any) -> ChunkOutput:
        """``decode`` on the rank the session's decodes were given to, from
        ``decode_input``'s value, with that rank's copy of the session."""
        ...


class RankDecodeBatch(Protocol):
    def decode_latents(self, sessions: Sequence[SessionState], cleans: Sequence[Any]) -> list[ChunkOutput]:
        """``decode_latent`` of one chunk of each of several sessions, batched; all or nothing."""
        ...


class SplitDecode(Protocol):
    decode_stages: int
    """Stages the decoder can be split between (0: this one cannot be split)."""

    def decode_stage_seconds(self) -> list[float]:
        """Each decoder stage's seconds for a chunk at the default size."""
        ...

    def decode_front(self, session: SessionState, clean: Any, split: int) -> Iterator[tuple[dict, Any]]:
        """The first ``split`` stages of a chunk, per latent frame: a header and the activation."""
        ...

    def decode_back(self, session: SessionState, header: dict, activation: Any, split: int) -> Any:
        """The other stages of one latent frame: its pixels."""
        ...

    def frames_of(self, pixels: Sequence[Any]) -> ChunkOutput:
        """A chunk's frames from its latent frames' ``decode_back`` pixels, in order."""
        ...


class SplitDecodeBatch(Protocol):
    def decode_groups(self, sessions: Sequence[SessionState], cleans: Sequence[Any]) -> list[list[int]]:
        """The rows that can go through the decoder as one batch, in groups."""
        ...

    def decode_fronts(
        self, sessions: Sequence[SessionState], cleans: Sequence[Any], split: int
    ) -> Iterator[tuple[dict, Any]]:
        """``decode_front`` of one group's chunks as one batch."""
        ...

    def back_rows(self, sessions: Sequence[SessionState]) -> Any:
        """The back of a batch ``decode_fronts`` makes (``decode(header, activation, split)``, ``frames()``)."""
        ...


class PipelineRanks(Protocol):
    chunks_in_flight: int
    """Chunks a session may have in flight (``EngineConfig.lookahead``), set before any session opens."""

    def own_blocks(self, blocks: range, most_per_rank: int | None = None) -> None:
        """Keep only ``blocks``; called once, before any session opens."""
        ...

    def embed_rows(self, batch: Any, sessions: Sequence[SessionState]) -> Any:
        """The rows' embedded latents (what block 0 takes): ``rtvideo.workers.parallel.partition`` times it."""
        ...

    def pack(self, hidden: Hidden) -> tuple[dict, list[Any]]:
        """``hidden`` as (a plain description, its tensors), to send to the next rank."""
        ...

    def unpack(self, meta: dict, tensors: list[Any]) -> Hidden:
        """The ``Hidden`` that ``pack`` described."""
        ...

    def select(self, hidden: Hidden, keep: list[int]) -> Hidden:
        """The rows ``keep`` of ``hidden``."""
        ...

    def follow_boundary(self, session: SessionState, chunk_index: int, prompt_changed: bool) -> None:
        """A later rank's share of ``boundary``."""
        ...

    def finish_commit(self, session: SessionState, chunk_index: int) -> None:
        """The first rank marks a chunk committed once every rank's commit range ran."""
        ...


class KvWindow(Protocol):
    latent_frames: int
    """Latent frames a chunk makes."""
    sink_frames: int
    """Latent frames the KV cache keeps from the start of a session."""
    window_frames: int
    """Latent frames the KV cache keeps of the most recent ones."""


class VideoInputs(Protocol):
    def take_input(self, session: SessionState, chunk_index: int, frames: Any) -> None:
        """Video to video, first rank: chunk ``chunk_index``'s input frames, uint8
        ``[frames, height, width, 3]`` (numpy) at the session's size, for a session
        opened with an ``input``; the runner gives them once per chunk, in chunk
        order, before the chunk's boundary. ``describe`` says in
        ``geometry.num_inference_steps`` the denoise steps its chunks then run
        (0: none, the chunk's boundary then its commit). ``ValueError`` names
        what is wrong; when it raises the session fails."""
        ...


class Synchronize(Protocol):
    def synchronize(self) -> None:
        """Wait for the work queued on the pipeline's device (timings)."""
        ...


class StepGraphCounts(Protocol):
    def graph_figures(self) -> dict[str, int] | None:
        """The captured steps' counts since the pipeline was built: ``captures``,
        ``replays``, ``fallbacks`` (eager runs of keys not captured yet) and
        ``held`` (graphs kept), besides any of its own; None when it captures
        nothing (its option is off)."""
        ...


@dataclass(frozen=True)
class Capabilities:
    """The optional parts a pipeline class implements (module docstring); each
    field True promises its protocol, which ``check_pipeline`` holds it to."""

    commit_batch: bool = False
    decode_batch: bool = False
    rank_decode: bool = False
    rank_decode_batch: bool = False
    split_decode: bool = False
    split_decode_batch: bool = False
    pipeline_ranks: bool = False
    kv_window: bool = False
    video_input: bool = False
    synchronize: bool = False
    step_graphs: bool = False

    def declared(self) -> tuple[str, ...]:
        return tuple(f.name for f in fields(self) if getattr(self, f.name))


PROTOCOLS: dict[str, type] = {
    "commit_batch": BatchedCommit,
    "decode_batch": BatchedDecode,
    "rank_decode": RankDecode,
    "rank_decode_batch": RankDecodeBatch,
    "split_decode": SplitDecode,
    "split_decode_batch": SplitDecodeBatch,
    "pipeline_ranks": PipelineRanks,
    "kv_window": KvWindow,
    "video_input": VideoInputs,
    "synchronize": Synchronize,
    "step_graphs": StepGraphCounts,
}
"""Each capability's protocol."""

NEEDS: dict[str, str] = {
    "rank_decode_batch": "rank_decode",
    "split_decode": "rank_decode",
    "split_decode_batch": "split_decode",
}
"""A capability that builds on another: declaring it without that one is refused."""


def check_pipeline(pipeline: Any) -> ChunkPipeline:
    """``pipeline``, once it is shown to have every ``ChunkPipeline`` member and
    every member of the protocols its ``capabilities`` declare (methods
    callable with the protocol's arguments); ``PipelineContractError`` naming
    the pipeline and the member otherwise. Called once, when it is built."""
    who = _who(pipeline)
    _check_members(pipeline, ChunkPipeline, who, "is not a ChunkPipeline")
    capabilities = pipeline.capabilities
    if not isinstance(capabilities, Capabilities):
        raise PipelineContractError(
            f"pipeline {who}: capabilities must be a rtvideo.workers.pipelines.capabilities.Capabilities, "
            f"got {type(capabilities).__name__}"
        )
    declared = capabilities.declared()
    for name in declared:
        needed = NEEDS.get(name)
        if needed is not None and not getattr(capabilities, needed):
            raise PipelineContractError(f"pipeline {who} declares {name} but not {needed}, which it builds on")
        _check_members(pipeline, PROTOCOLS[name], who, f"declares {name}")
    if capabilities.pipeline_ranks and not pipeline.supports_micro_step_execution:
        raise PipelineContractError(
            f"pipeline {who} declares pipeline_ranks but not supports_micro_step_execution, which it builds on"
        )
    return pipeline


def device_type(pipeline: ChunkPipeline) -> str | None:
    """The type of the torch device the pipeline computes on (``"cpu"``,
    ``"cuda"``); None for one with no device (the stub's host arithmetic)."""
    device = pipeline.device
    return None if device is None else device.type


def _who(pipeline: Any) -> str:
    cls = type(pipeline)
    return f"{getattr(pipeline, 'name', cls.__name__)!r} ({cls.__module__}.{cls.__qualname__})"


def _check_members(pipeline: Any, protocol: type, who: str, what: str) -> None:
    """Every attribute ``protocol`` annotates and every method it defines is on
    ``pipeline``, each method callable with the protocol's parameters (those
    without a default positionally, the others by name)."""
    said = f"pipeline {who} {what}:"
    for name in _annotations(protocol):
        if not hasattr(pipeline, name):
            raise PipelineContractError(f"{said} it has no attribute {name!r}")
    for name, template in vars(protocol).items():
        if name.startswith("_") or not inspect.isfunction(template):
            continue
        wanted = _parameters(template)
        shown = f"{name}({', '.join(wanted)})"
        method = getattr(pipeline, name, None)
        if method is None:
            raise PipelineContractError(f"{said} it has no method {shown}")
        if not callable(method):
            raise PipelineContractError(f"{said} its {name} is not callable (want {shown})")
        try:
            signature = inspect.signature(method)
        except (TypeError, ValueError):  # a builtin without one: cannot be checked, taken on trust
            continue
        positional = [p for p in wanted.values() if p.default is inspect.Parameter.empty]
        keywords = {p.name: None for p in wanted.values() if p.default is not inspect.Parameter.empty}
        try:
            signature.bind(*[None] * len(positional), **keywords)
        except TypeError as error:
            raise PipelineContractError(f"{said} its {name}{signature} does not take {shown}: {error}") from None


def _annotations(protocol: type) -> list[str]:
    names: list[str] = []
    for klass in reversed(protocol.__mro__):
        if klass in (object, Protocol) or klass.__name__ == "Generic":
            continue
        names.extend(name for name in vars(klass).get("__annotations__", {}) if name not in names)
    return names


def _parameters(function) -> dict[str, inspect.Parameter]:
    parameters = dict(inspect.signature(function).parameters)
    parameters.pop("self", None)
    return parameters
