"""A deterministic, arithmetic ``ChunkPipeline`` for engine tests and benchmarks.

Not a model: each session carries an 8-number "latent"; a prompt becomes an
8-number conditioning vector (from its SHA-256); denoise steps and the
sampler are a few float operations whose result depends on every step, the
seed, the chunk index and the session's history (a running context, like a
KV cache). Frames are real uint8 RGB so media code downstream can run on it.
It has the stages of a model (``rtvideo.workers.pipelines.base``), two "blocks"
included, so engine and runner tests drive the very calls a model gets.

Video to video (``video_input``): a session started with an ``input`` runs the
last ``input_steps(strength, steps)`` steps of its schedule from its frames,
and a chunk's frames are its input blended toward the usual pattern by those
steps over the schedule's (``input_frames``): at strength 0 (no step) the
input itself, byte for byte; otherwise row 0 still holds the conditioning.

What a test can read back from each decoded frame:
- row 0 holds the chunk's conditioning (``conditioning_row``), so the prompt,
  or blend of prompts, active in a chunk is visible in its pixels;
- the other rows hold the final latent, so any difference in the denoise
  arithmetic (a step skipped, run twice, or run out of order) changes them.

Knobs for tests and benchmarks (all keyword options of the constructor):
``step_time_s`` / ``decode_time_s`` (simulated compute: slept, or spun with
``spin=True`` the way a host thread spins on a GPU sync), ``gates``
(``StubGate``: block at a chunk and step until released, to place a control
message mid-chunk deterministically; at step ``DECODE_GATE_STEP``, the chunk's
decode; a forward's gate is passed before its blocks, so a forward whose
sessions all stopped meanwhile is abandoned at its first block),
``fail_prompt`` / ``fail_chunk`` (raise in ``forward`` for sessions started
with that prompt; in ``decode`` with ``fail_in_decode``), ``startup_gate`` (a path:
when a FIFO lies there, construction waits until a writer opens it,
so a test can hold a worker restart for as long as it needs).
"""

from __future__ import annotations

import hashlib
import os
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from rtvideo.engine.messages import ModelLimits, SessionGeometry, StartSession
from rtvideo.engine.plan import ChunkOutput
from rtvideo.workers.pipelines.base import (
    BatchRow,
    ChunkOrderError,
    ChunkRecord,
    Hidden,
    SessionState,
    StepBatch,
    abandon_point,
    block_range,
    check_hidden,
    chosen_decoder,
    refuse_negative_prompt,
)
from rtvideo.workers.pipelines.capabilities import Capabilities
from rtvideo.workers.pipelines.conditioning import PromptBlend

DIM = 8


def embed(prompt: str) -> np.ndarray:
    """The stub's text encoder: 8 numbers in [0, 1) from the prompt's SHA-256."""
    digest = hashlib.sha256(prompt.encode()).digest()
    return np.frombuffer(digest[:DIM], dtype=np.uint8).astype(np.float64) / 256.0


def conditioning_row(conditioning: np.ndarray, width: int) -> np.ndarray:
    """Row 0 of every frame decoded under ``conditioning``: shape (width, 3), uint8."""
    index = np.arange(width * 3) % DIM
    return np.round(conditioning[index] * 255.0).astype(np.uint8).reshape(width, 3)


def _spin(seconds: float) -> None:
    """Busy-wait: keeps the CPU hot, as a host thread spinning on a GPU sync does."""
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        pass


@dataclass(kw_only=True)
class StubChunk(ChunkRecord):
    """A stub chunk in flight: its conditioning and noise, the latent being
    denoised, and the clean latent once its last step ran."""

    conditioning: np.ndarray
    noise: np.ndarray
    latent: np.ndarray
    clean: np.ndarray | None = None
    input: np.ndarray | None = None  # video to video: the chunk's input frames, uint8 [F, H, W, 3]
    weight: float = 1.0  # video to video: the pattern's share of its frames (its steps over the schedule's)


@dataclass(kw_only=True)
class StubSession(SessionState[StubChunk]):
    """A stub session: its prompt (and any transition), and its running context,
    which commits fold each chunk into (the stub's KV cache)."""

    prompt: PromptBlend
    context: np.ndarray = field(default_factory=lambda: np.zeros(DIM))
    schedule_steps: int = 0  # video to video: the steps of the whole schedule (its chunks run the last ones)
    inputs: dict[int, np.ndarray] = field(default_factory=dict)  # input frames waiting for their boundary
    input_next: int = 0  # the chunk whose input frames come next


DECODE_GATE_STEP = -1  # a StubGate at this step blocks the decode of its chunk


def input_steps(strength: float, steps: int) -> int:
    """Video to video on the stub: the denoise steps a chunk runs of a schedule of
    ``steps`` (the last ones), for an input of ``strength``: ``strength x steps``
    rounded half up (strength 0: none, 1: all)."""
    return int(strength * steps + 0.5)


def input_frames(given: np.ndarray, pattern: np.ndarray, weight: float) -> np.ndarray:
    """The stub's frames of a video-to-video chunk: ``given`` (its input, uint8)
    blended toward its usual ``pattern`` by ``weight`` (its steps over the
    schedule's), rounded half up: the input itself at strength 0 (weight 0), so
    every pixel lies within ``weight x 255`` (+ 1) of ``(1 - weight) x input``."""
    return np.floor((1.0 - weight) * given + weight * pattern + 0.5).astype(np.uint8)


@dataclass
class StubGate:
    """Block the first denoise step that computes step ``step`` of chunk ``chunk``
    (of a session started with ``prompt``, when given): set ``reached``, then
    wait for ``release``. Events come from the spawn context of the test."""

    chunk: int
    step: int
    reached: Any  # multiprocessing Event
    release: Any  # multiprocessing Event
    prompt: str | None = None
    timeout_s: float = 60.0


class StubPipeline:
    name: ClassVar[str] = "stub"
    supports_chunk_step_grouping: ClassVar[bool] = True
    supports_micro_step_execution: ClassVar[bool] = True
    decode_overlap_pays: ClassVar[bool] = True  # simulated compute sleeps: the stages overlap for real
    num_blocks: ClassVar[int] = 2  # block 0: the conditioning; block 1: the committed context
    warm_up_chunks: ClassVar[int] = 0  # arithmetic: nothing to warm, and gates must see only real sessions
    capture_chunks: ClassVar[int] = 0  # no captured steps
    batch_invariant: ClassVar[bool] = True  # each row's arithmetic is its own, whatever the batch
    device: ClassVar[None] = None  # numpy on the host: no torch device
    # The stages, and video input; each chunk commits and decodes alone.
    capabilities: ClassVar[Capabilities] = Capabilities(video_input=True)

    def __init__(
        self,
        *,
        width: int = 32,
        height: int = 32,
        fps: float = 16.0,
        frames_per_chunk: int = 4,
        first_chunk_frames: int | None = None,
        default_steps: int = 4,
        max_steps: int = 4,
        max_size: int = 512,
        step_time_s: float = 0.0,
        decode_time_s: float = 0.0,
        spin: bool = False,
        gates: Sequence[StubGate] = (),
        fail_prompt: str | None = None,
        fail_in_decode: bool = False,
        fail_chunk: int = 0,
        memory_budget: int | None = None,
        startup_gate: str | None = None,
        max_batch_rows: int = 8,
    ) -> None:
        if startup_gate is not None and os.path.exists(startup_gate):
            with open(startup_gate, "rb"):  # a FIFO: blocks until the test opens its write end
                pass
        if max_batch_rows < 1:
            raise ValueError(f"max_batch_rows must be >= 1, got {max_batch_rows}")
        for name, seconds in (("step_time_s", step_time_s), ("decode_time_s", decode_time_s)):
            if not 0.0 <= seconds < float("inf"):
                raise ValueError(f"{name} must be a finite number >= 0, got {seconds}")
        self.max_batch_rows = max_batch_rows
        self.defaults = (width, height, fps, default_steps)
        self.frames_per_chunk = frames_per_chunk
        self.first_chunk_frames = first_chunk_frames or frames_per_chunk
        self.max_steps = max_steps
        self.max_size = max_size
        self.step_time_s = step_time_s
        self.decode_time_s = decode_time_s
        self._wait = _spin if spin else time.sleep
        self.gates = list(gates)
        self.fail_prompt = fail_prompt
        self.fail_in_decode = fail_in_decode
        self.fail_chunk = fail_chunk
        self.memory_budget = memory_budget  # what session_memory_budget() reports (tests of admission)
        self._pool: dict[str, bytearray] = {}  # stands in for a KV-cache pool: 4 bytes a pixel

    # -- geometry -----------------------------------------------------------

    def describe(self, start: StartSession) -> SessionGeometry:
        refuse_negative_prompt(start, self.name)
        chosen_decoder(start, "full", ("full",), self.name)
        given = start.input  # video to video: the session's size and rate default to the input's
        width, height, fps, steps = self.defaults
        width = start.width if start.width is not None else given.width if given else width
        height = start.height if start.height is not None else given.height if given else height
        fps = start.fps if start.fps is not None else given.fps if given else fps
        steps = start.num_inference_steps if start.num_inference_steps is not None else steps
        for name, value in (("width", width), ("height", height)):
            if not 2 <= value <= self.max_size or value % 2:
                raise ValueError(f"{name} must be an even number between 2 and {self.max_size}, got {value}")
        if not 1 <= steps <= self.max_steps:
            raise ValueError(f"num_inference_steps must be between 1 and {self.max_steps}, got {steps}")
        if not 1.0 <= fps <= 120.0:
            raise ValueError(f"fps must be between 1 and 120, got {fps}")
        if given is not None:
            for name, value, session in (("width", given.width, width), ("height", given.height, height)):
                if value != session:
                    raise ValueError(f"input.{name} must equal the session's {name} ({session}), got {value}")
            if given.fps != fps:
                raise ValueError(f"input.fps must equal the session's fps ({fps}), got {given.fps}")
            steps = input_steps(given.strength, steps)  # the chunks run the last steps of the schedule
        return SessionGeometry(
            width=width,
            height=height,
            fps=fps,
            num_inference_steps=steps,
            first_chunk_frames=self.first_chunk_frames,
            frames_per_chunk=self.frames_per_chunk,
            num_chunks=start.num_chunks,
            transition_chunks=start.transition_chunks,
            state_bytes=4 * width * height,
        )

    # -- stages -------------------------------------------------------------

    def encode_prompt(self, prompt: str) -> np.ndarray:
        return embed(prompt)

    def open(self, start: StartSession, geometry: SessionGeometry, prompt: np.ndarray) -> StubSession:
        session = StubSession(
            session_id=start.session_id,
            start=start,
            geometry=geometry,
            prompt=PromptBlend(prompt),
            context=np.zeros(DIM),
            schedule_steps=self.defaults[3] if start.num_inference_steps is None else start.num_inference_steps,
        )
        self._pool[start.session_id] = bytearray(geometry.state_bytes)
        return session

    def take_input(self, session: StubSession, chunk_index: int, frames: np.ndarray) -> None:
        """Video to video: chunk ``chunk_index``'s input frames, uint8 ``[F, H, W, 3]``
        (F: ``first_chunk_frames`` for chunk 0, ``frames_per_chunk`` after), in
        chunk order, kept for its boundary; ``ValueError`` / ``ChunkOrderError``
        name what is wrong."""
        sid = session.session_id
        if session.start.input is None:
            raise ValueError(f"session {sid} was opened without an input: it takes no frames")
        if chunk_index != session.input_next:
            raise ChunkOrderError(
                f"session {sid}: input frames for chunk {chunk_index}; chunk {session.input_next}'s come next"
            )
        g = session.geometry
        count = g.first_chunk_frames if chunk_index == 0 else g.frames_per_chunk
        if frames.dtype != np.uint8 or frames.shape != (count, g.height, g.width, 3):
            raise ValueError(
                f"session {sid}: chunk {chunk_index} takes uint8 [{count}, {g.height}, {g.width}, 3] input frames, "
                f"got {frames.dtype} {list(frames.shape)}"
            )
        session.inputs[chunk_index] = frames
        session.input_next += 1

    def boundary(
        self, session: StubSession, chunk_index: int, prompt: np.ndarray | None = None, transition_chunks: int = 0
    ) -> None:
        session.check_boundary(chunk_index)
        if prompt is not None:
            session.prompt.switch(prompt, transition_chunks)
        conditioning = session.prompt.next_chunk()
        rng = random.Random(f"{session.start.seed}:{chunk_index}")
        noise = np.array([rng.gauss(0.0, 1.0) for _ in range(DIM)])
        steps = session.geometry.num_inference_steps
        chunk = StubChunk(chunk_index, steps, conditioning=conditioning, noise=noise, latent=noise.copy())
        if session.start.input is not None:  # video to video: start from the input, part-way down the schedule
            given = session.inputs.pop(chunk_index, None)
            if given is None:
                raise ChunkOrderError(
                    f"session {session.session_id}: chunk {chunk_index} has no input frames yet (take_input comes "
                    "before its boundary)"
                )
            chunk.input, chunk.weight = given, steps / session.schedule_steps
            encoded = given.reshape(-1, 3).mean(axis=0)[np.arange(DIM) % 3] / 255.0  # the stub's "encoder"
            chunk.latent = (1.0 - chunk.weight) * encoded + chunk.weight * noise
            if steps == 0:  # no denoise step: the encoded input is the chunk's clean latent
                chunk.clean = chunk.latent
        session.chunks[chunk_index] = chunk

    def forward(
        self,
        batch: StepBatch,
        sessions: Sequence[StubSession],
        blocks: range | None = None,
        hidden: Hidden | None = None,
    ) -> list[np.ndarray] | Hidden:
        """Embed: each row's latent; block 0 puts the conditioning into the row's
        target, block 1 adds a tenth of the committed context; head: the latent
        minus the target (flow-like)."""
        blocks = block_range(blocks, self.num_blocks)
        check_hidden(hidden, blocks, batch.rows)
        if blocks.start == 0:
            chunks = [session.chunk_at(row) for row, session in zip(batch.rows, sessions, strict=True)]
            for row, session in zip(batch.rows, sessions, strict=True):
                self._pass_gates(row.chunk_index, row.step, session)
                if (
                    not self.fail_in_decode
                    and session.start.prompt == self.fail_prompt
                    and row.chunk_index == self.fail_chunk
                ):
                    raise RuntimeError(f"stub pipeline: injected failure at chunk {row.chunk_index}")
            carried = [(chunk.latent, chunk.conditioning, None) for chunk in chunks]  # (latent, conditioning, target)
        else:
            carried = hidden.tensors
        for block in blocks:
            abandon_point()  # as a model does between blocks: a forward of stopping sessions ends here
            if self.step_time_s:
                self._wait(self.step_time_s / self.num_blocks)  # one forward for the whole batch
            if block == 0:
                carried = [(latent, conditioning, conditioning) for latent, conditioning, _ in carried]
            else:
                carried = [
                    (latent, conditioning, target + 0.1 * session.context)
                    for (latent, conditioning, target), session in zip(carried, sessions, strict=True)
                ]
        if blocks.stop < self.num_blocks:
            return Hidden(blocks.stop, batch.rows, carried)
        return [latent - target for latent, _, target in carried]

    def sampler_step(self, session: StubSession, row: BatchRow, prediction: np.ndarray) -> None:
        chunk = session.chunk_at(row)
        steps = chunk.steps
        sigma = 1.0 - row.step / steps
        sigma_next = 1.0 - (row.step + 1) / steps
        x0 = chunk.latent - sigma * prediction
        chunk.latent = (1.0 - sigma_next) * x0 + sigma_next * chunk.noise
        chunk.at_step = row.step + 1
        if chunk.denoised:
            chunk.clean = chunk.latent

    def commit(
        self, session: StubSession, chunk_index: int, blocks: range | None = None, hidden: Hidden | None = None
    ) -> Hidden | None:
        """The stub's cache is its running context: half the old, half the chunk (in the last block)."""
        blocks = block_range(blocks, self.num_blocks)
        chunk = session.chunk_to_commit(chunk_index)
        rows = (BatchRow(session.session_id, chunk_index, chunk.steps),)
        check_hidden(hidden, blocks, rows)
        if blocks.stop < self.num_blocks:
            return Hidden(blocks.stop, rows, None)
        session.context = 0.5 * session.context + 0.5 * chunk.clean
        chunk.committed = True
        return None

    def decode(self, session: StubSession, chunk_index: int) -> ChunkOutput:
        chunk = session.chunk_to_decode(chunk_index)
        self._pass_gates(chunk_index, DECODE_GATE_STEP, session)
        if self.fail_in_decode and session.start.prompt == self.fail_prompt and chunk_index == self.fail_chunk:
            raise RuntimeError(f"stub pipeline: injected decode failure at chunk {chunk_index}")
        final = chunk.clean
        frames = self.first_chunk_frames if chunk_index == 0 else self.frames_per_chunk
        for _ in range(frames):  # as a model's decode, frame by frame: a stop abandons it between frames
            abandon_point()
            if self.decode_time_s:
                self._wait(self.decode_time_s / frames)
        width, height = session.geometry.width, session.geometry.height
        y, x = np.mgrid[0:height, 0:width]
        video = np.empty((frames, height, width, 3), dtype=np.uint8)
        for f in range(frames):
            for c in range(3):
                values = np.abs(final[(y + x + f + c) % DIM]) * 997.0
                video[f, :, :, c] = (np.floor(values).astype(np.int64) + 7 * chunk_index + f) % 256
            video[f, 0] = conditioning_row(chunk.conditioning, width)
        if chunk.input is not None:  # video to video: the input blended toward the pattern (itself at strength 0)
            video = input_frames(chunk.input, video, chunk.weight)
            if chunk.weight > 0:
                video[:, 0] = conditioning_row(chunk.conditioning, width)
        del session.chunks[chunk_index]
        return ChunkOutput(num_frames=frames, width=width, height=height, payload=video.tobytes())

    def release(self, session: StubSession) -> None:
        self._pool.pop(session.session_id, None)
        session.chunks.clear()
        session.inputs.clear()

    def held_sessions(self) -> tuple[str, ...]:
        return tuple(self._pool)

    def limits(self) -> ModelLimits:
        return ModelLimits(size_multiple=2, max_size=self.max_size, max_inference_steps=self.max_steps, max_fps=120.0)

    def session_memory_budget(self) -> int | None:
        return self.memory_budget

    # -- test hooks ---------------------------------------------------------

    def _pass_gates(self, chunk: int, step: int, state: StubSession) -> None:
        for gate in list(self.gates):
            if gate.chunk != chunk or gate.step != step:
                continue
            if gate.prompt is not None and gate.prompt != state.start.prompt:
                continue
            self.gates.remove(gate)
            gate.reached.set()
            if not gate.release.wait(gate.timeout_s):
                raise RuntimeError(f"stub gate at chunk {chunk} step {step} was never released")
