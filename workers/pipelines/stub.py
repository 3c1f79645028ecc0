"""A deterministic, arithmetic ``ChunkPipeline`` for engine tests and benchmarks.

Not a model: each session carries an 8-number "latent"; a prompt becomes an
8-number conditioning vector (from its SHA-256); denoise steps and the
sampler are a few float operations whose result depends on every step, the
seed, the chunk index and the session's history (a running context, like a
KV cache). Frames are real uint8 RGB so media code downstream can run on it.

What a test can read back from each decoded frame:
- row 0 holds the chunk's conditioning (``conditioning_row``), so the prompt,
  or blend of prompts, active in a chunk is visible in its pixels;
- the other rows hold the final latent, so any difference in the denoise
  arithmetic (a step skipped, run twice, or run out of order) changes them.

Knobs for tests and benchmarks (all keyword options of the constructor):
``step_time_s`` / ``decode_time_s`` (simulated compute: slept, or spun with
``spin=True`` the way a host thread spins on a GPU sync), ``gates``
(``StubGate``: block at a chunk and step until released, to place a control
message mid-chunk deterministically), ``fail_prompt`` / ``fail_chunk`` (raise
in ``denoise_step`` for sessions started with that prompt), ``startup_gate``
(a path: when a FIFO lies there, construction waits until a writer opens it,
so a test can hold a worker restart for as long as it needs).
"""

from __future__ import annotations

import hashlib
import os
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from engine.messages import SessionGeometry, StartSession
from engine.plan import ChunkOutput
from workers.pipelines.base import PipelineState, StepBatch, refuse_negative_prompt
from workers.pipelines.conditioning import PromptBlend

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
    supports_micro_step_execution: ClassVar[bool] = False
    warm_up_chunks: ClassVar[int] = 0  # arithmetic: nothing to warm, and gates must see only real sessions

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
        self.fail_chunk = fail_chunk
        self.memory_budget = memory_budget  # what session_memory_budget() reports (tests of admission)
        self._pool: dict[str, bytearray] = {}  # stands in for a KV-cache pool: 4 bytes a pixel

    # -- geometry -----------------------------------------------------------

    def describe(self, start: StartSession) -> SessionGeometry:
        refuse_negative_prompt(start, self.name)
        width, height, fps, steps = self.defaults
        width = start.width if start.width is not None else width
        height = start.height if start.height is not None else height
        fps = start.fps if start.fps is not None else fps
        steps = start.num_inference_steps if start.num_inference_steps is not None else steps
        for name, value in (("width", width), ("height", height)):
            if not 2 <= value <= self.max_size or value % 2:
                raise ValueError(f"{name} must be an even number between 2 and {self.max_size}, got {value}")
        if not 1 <= steps <= self.max_steps:
            raise ValueError(f"num_inference_steps must be between 1 and {self.max_steps}, got {steps}")
        if not 1.0 <= fps <= 120.0:
            raise ValueError(f"fps must be between 1 and 120, got {fps}")
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

    # -- lifecycle ----------------------------------------------------------

    def prepare_encode(self, state: PipelineState) -> None:
        self._pool[state.session_id] = bytearray(state.geometry.state_bytes)
        state.extra.update(prompt=PromptBlend(embed(state.start.prompt)), context=np.zeros(DIM))

    def apply_interaction_at_chunk_boundary(self, state: PipelineState, prompt: str, transition_chunks: int) -> None:
        state.extra["prompt"].switch(embed(prompt), transition_chunks)

    def prepare_next_chunk(self, state: PipelineState) -> None:
        extra = state.extra
        extra["conditioning"] = extra["prompt"].next_chunk()
        rng = random.Random(f"{state.start.seed}:{state.chunk_index}")
        extra["noise"] = np.array([rng.gauss(0.0, 1.0) for _ in range(DIM)])
        extra["latent"] = extra["noise"].copy()
        state.step_in_chunk = 0

    def denoise_step(self, batch: StepBatch, states: Sequence[PipelineState]) -> list[np.ndarray]:
        for row, state in zip(batch.rows, states, strict=True):
            self._pass_gates(row.chunk_index, row.step, state)
            if state.start.prompt == self.fail_prompt and row.chunk_index == self.fail_chunk:
                raise RuntimeError(f"stub pipeline: injected failure at chunk {row.chunk_index}")
        if self.step_time_s:
            self._wait(self.step_time_s)  # one forward for the whole batch
        predictions = []
        for state in states:
            extra = state.extra
            target = extra["conditioning"] + 0.1 * extra["context"]
            predictions.append(extra["latent"] - target)  # flow-like: latent minus clean target
        return predictions

    def step_scheduler(self, state: PipelineState, noise_pred: np.ndarray) -> None:
        extra = state.extra
        steps = state.geometry.num_inference_steps
        sigma = 1.0 - state.step_in_chunk / steps
        sigma_next = 1.0 - (state.step_in_chunk + 1) / steps
        x0 = extra["latent"] - sigma * noise_pred
        extra["latent"] = (1.0 - sigma_next) * x0 + sigma_next * extra["noise"]
        state.step_in_chunk += 1

    def post_decode(self, state: PipelineState) -> ChunkOutput:
        extra = state.extra
        final = extra["latent"]
        extra["context"] = 0.5 * extra["context"] + 0.5 * final  # commit to the history
        if self.decode_time_s:
            self._wait(self.decode_time_s)
        geometry = state.geometry
        frames = self.first_chunk_frames if state.chunk_index == 0 else self.frames_per_chunk
        width, height = geometry.width, geometry.height
        y, x = np.mgrid[0:height, 0:width]
        video = np.empty((frames, height, width, 3), dtype=np.uint8)
        for f in range(frames):
            for c in range(3):
                values = np.abs(final[(y + x + f + c) % DIM]) * 997.0
                video[f, :, :, c] = (np.floor(values).astype(np.int64) + 7 * state.chunk_index + f) % 256
            video[f, 0] = conditioning_row(extra["conditioning"], width)
        return ChunkOutput(num_frames=frames, width=width, height=height, payload=video.tobytes())

    def release(self, state: PipelineState) -> None:
        self._pool.pop(state.session_id, None)
        state.extra.clear()

    def held_sessions(self) -> tuple[str, ...]:
        return tuple(self._pool)

    def session_memory_budget(self) -> int | None:
        return self.memory_budget

    # -- test hooks ---------------------------------------------------------

    def _pass_gates(self, chunk: int, step: int, state: PipelineState) -> None:
        for gate in list(self.gates):
            if gate.chunk != chunk or gate.step != step:
                continue
            if gate.prompt is not None and gate.prompt != state.start.prompt:
                continue
            self.gates.remove(gate)
            gate.reached.set()
            if not gate.release.wait(gate.timeout_s):
                raise RuntimeError(f"stub gate at chunk {chunk} step {step} was never released")
