"""Video to video on the causal pipeline: where a chunk starts, and a session's input.

Worker process (first pipeline rank). A session opened with an input
(``StartSession.input``, a ``VideoInput``) hands the pipeline each chunk's
camera frames (``CausalWanPipeline.take_input``) before that chunk's
boundary; they are encoded at once by the session's streaming VAE encoder
(``vae_encode.StreamingEncoder``, its feature cache here, in the session's
``SessionInput``), and the boundary starts the chunk from them instead of
from pure noise, part-way down the few-step schedule.

**Strength to start step.** The schedule of ``num_inference_steps`` N has the
noise levels ``sigma_k = t_k / 1000``, k = 0 .. N-1 (4 steps: 1.0, 0.9375,
0.8333, 0.625), and after its last step a chunk is clean (sigma 0, k = N).
``input_start_step`` picks the k whose level is nearest ``strength``, the
noisier one on a tie: the chunk starts at ``x = (1 - sigma_k) * latent +
sigma_k * noise`` (the sampler's own re-noising, at the schedule's own level,
so the model sees a level it was trained at) and runs the N - k steps left.
Strength 1 is k = 0: pure noise and the whole schedule, text to video (the
frames are taken but not encoded: nothing would read them). Strength 0 is
k = N: no denoise step; the chunk's clean latent is the encoded input, so
its frames are the input as the VAE reconstructs it. With 4 steps:
strength [0, 0.3125) starts at k = 4 (no step), [0.3125, 0.7292) at k = 3
(1 step, sigma 0.625), [0.7292, 0.8854) at 2, [0.8854, 0.9688) at 1,
[0.9688, 1] at 0 (4 steps).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from rtvideo.engine.messages import VideoInput
from rtvideo.workers.pipelines.base import ChunkOrderError
from rtvideo.workers.pipelines.vae_encode import StreamingEncoder


def input_start_step(strength: float, timesteps: Sequence[float]) -> int:
    """The step of the whole schedule ``timesteps`` (in the 0-1000 flow scale) a
    chunk of an input of ``strength`` starts at: the k whose noise level
    ``timesteps[k] / 1000`` (or 0 for k = ``len(timesteps)``, clean) is nearest
    ``strength``, the noisier on a tie. ``ValueError`` outside 0..1."""
    if not 0.0 <= strength <= 1.0:
        raise ValueError(f"input.strength must be between 0 and 1, got {strength}")
    levels = [t / 1000.0 for t in timesteps] + [0.0]
    return min(range(len(levels)), key=lambda k: (abs(levels[k] - strength), k))


def check_input_geometry(given: VideoInput, width: int, height: int, fps: float) -> None:
    """The input's frames are the session's: its size and rate (``ValueError``
    naming the input's field otherwise; the server scales or drops frames
    before they reach the model, if ever)."""
    for name, value, session in (("width", given.width, width), ("height", given.height, height)):
        if value != session:
            raise ValueError(f"input.{name} must equal the session's {name} ({session}), got {value}")
    if given.fps != fps:
        raise ValueError(f"input.fps must equal the session's fps ({fps}), got {given.fps}")


@dataclass(kw_only=True)
class SessionInput:
    """A video-to-video session's input side: its encoder's feature cache and
    the chunks encoded and waiting for their boundary."""

    strength: float
    start_step: int  # the step of the whole schedule its chunks start at (``input_start_step``)
    encode: bool  # whether its frames are encoded (not at start step 0: pure noise reads none; nor on a later rank)
    encoder_cache: list  # the streaming encoder's causal feature cache, through chunk ``next_chunk - 1``
    next_chunk: int = 0  # the chunk whose frames come next: the encoder's cache is a stream, taken in order
    latents: dict[int, torch.Tensor | None] = field(default_factory=dict)
    """Encoded chunks waiting for their boundary, by chunk index (None: taken, not encoded)."""

    def take(
        self,
        encoder: StreamingEncoder,
        session_id: str,
        chunk_index: int,
        frames: torch.Tensor | np.ndarray,
        size: tuple[int, int],
        latent_frames: int,
        dtype: torch.dtype,
    ) -> None:
        """Chunk ``chunk_index``'s frames, uint8 ``[frames, height, width, 3]`` at
        ``size`` (width, height): checked, encoded (``latent_frames`` latent
        frames, in ``dtype``), kept for the chunk's boundary. Chunks come in
        order, each once; ``ValueError`` / ``ChunkOrderError`` name what is wrong,
        and leave the input as it was (the encode is all or nothing)."""
        if chunk_index != self.next_chunk:
            said = "were already taken" if chunk_index < self.next_chunk else "came early"
            raise ChunkOrderError(
                f"session {session_id}: input frames for chunk {chunk_index} {said}: "
                f"the input takes chunk {self.next_chunk}'s next"
            )
        if isinstance(frames, np.ndarray):
            frames = torch.from_numpy(frames)
        first = chunk_index == 0
        count = encoder.frames_for(latent_frames, first)
        width, height = size
        if frames.dtype != torch.uint8 or tuple(frames.shape) != (count, height, width, 3):
            raise ValueError(
                f"session {session_id}: chunk {chunk_index} takes {count} input frames, uint8 "
                f"[{count}, {height}, {width}, 3], got {frames.dtype} {list(frames.shape)}"
            )
        latent = None
        if self.encode:
            device = next(encoder.vae.parameters()).device
            latent = encoder.encode_uint8(frames, self.encoder_cache, first, device).to(dtype)
        self.latents[chunk_index] = latent
        self.next_chunk += 1

    def for_boundary(self, session_id: str, chunk_index: int) -> torch.Tensor | None:
        """The encoded input of chunk ``chunk_index``, handed to its boundary once
        (None at start step 0); ``ChunkOrderError`` when its frames have not come."""
        if chunk_index not in self.latents:
            raise ChunkOrderError(
                f"session {session_id}: chunk {chunk_index} has no input frames yet (take_input comes before "
                "its boundary)"
            )
        return self.latents.pop(chunk_index)

    def free(self) -> None:
        self.latents.clear()
        self.encoder_cache.clear()
