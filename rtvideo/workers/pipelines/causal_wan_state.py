"""What the causal Wan pipeline keeps per session, and per chunk in flight.

Worker process; the tensors live on the model's device. A ``CausalWanSession``
holds the session's caches and the few tensors it keeps across chunks; each
chunk between its boundary and its decode is a ``CausalWanChunk`` in the
session's ``chunks``, keyed by chunk index. Which chunk and which step a
stage works on comes from the engine's plan, never from a counter here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rtvideo.workers.pipelines.base import ChunkRecord, SessionState
from rtvideo.workers.pipelines.conditioning import PromptBlend
from rtvideo.workers.pipelines.kv_cache import SessionKVCache
from rtvideo.workers.pipelines.video_input import SessionInput


@dataclass(kw_only=True)
class CausalWanChunk(ChunkRecord):
    """One chunk in flight. ``boundary`` makes it, each ``sampler_step`` moves its
    latent one noise level down, the last one leaves ``clean``; ``commit``
    writes that into the cache, ``decode`` turns it into frames and drops the record."""

    conditioning: torch.Tensor  # [1, text_length, text_dim]: its text embeddings (a transition's blend)
    noise: torch.Tensor | None  # [steps, *latent_shape]: the starting noise, then one draw per re-noising
    latent: torch.Tensor | None  # x_t at step ``at_step``; None once clean
    clean: torch.Tensor | None = None  # x0 after the last step: what is committed and decoded
    committed_on_device: torch.cuda.Event | None = None  # CUDA: recorded after the commit, waited on by the decode


@dataclass(kw_only=True)
class CausalWanSession(SessionState[CausalWanChunk]):
    """One session's caches and schedule."""

    kv: SessionKVCache  # every layer's keys and values: sink + rolling window
    decoder: str = "full"  # which of the pipeline's decoders makes its frames (``StartSession.decoder``)
    vae_cache: list  # that decoder's per-session state: its causal feature cache
    latent_shape: tuple[int, ...]  # [1, channels, latent frames per chunk, height / 8, width / 8]
    timesteps: list[float]
    """The denoise schedule a chunk runs (the sampler's sigmas are these / 1000): the
    whole few-step schedule, or with an input what is left of it from its start step."""
    schedule: torch.Tensor  # the same, on the device: the forward's timesteps, no host round trip
    prompt: PromptBlend  # the prompt embeddings chunks are conditioned on, and a transition in progress
    noise_origin: int = 0  # the chunk index the noise sequence counts from (a reset moves it)
    sink_chunks: list[torch.Tensor] = field(default_factory=list)  # clean latents of the cache's sink chunks
    window_chunks: list[torch.Tensor] = field(default_factory=list)  # and of its window chunks (re-cache)
    decoded_any: bool = False  # the decoder has seen the stream's first frame
    input: SessionInput | None = None  # video to video: its encoder's cache and encoded chunks; None: text to video

    @property
    def cached_chunks(self) -> list[torch.Tensor]:
        """The clean latents of the chunks the KV cache holds, oldest first (the newest committed last)."""
        return self.sink_chunks + self.window_chunks

    def free(self) -> None:
        """Drop every tensor the session holds (release); safe to call twice."""
        self.chunks.clear()
        self.kv.free()
        self.vae_cache.clear()
        self.sink_chunks, self.window_chunks = [], []
        self.schedule = self.schedule.new_empty(0)
        self.prompt = PromptBlend(None)
        if self.input is not None:
            self.input.free()
