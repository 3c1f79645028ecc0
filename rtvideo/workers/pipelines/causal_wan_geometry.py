"""The causal Wan pipeline's sessions from outside: what a start asks, and what it costs.

Worker process. ``CausalWanGeometry`` is the part of ``CausalWanPipeline``
that answers before a session opens: ``describe`` checks a ``StartSession``
against this model (size, steps, rate, input, decoder, prompt change) and
gives its ``SessionGeometry``, ``state_bytes`` in it what the session will
hold on the device, ``limits`` the model's bounds, and
``session_memory_budget`` what sessions may hold in all (read once, after
the warm-up). ``self_forcing_timesteps`` is the few-step schedule a session
runs. Nothing here holds or changes a session.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from rtvideo.engine.messages import ModelLimits, SessionGeometry, StartSession
from rtvideo.workers.host_memory import host_session_budget
from rtvideo.workers.pipelines.base import chosen_decoder, refuse_negative_prompt
from rtvideo.workers.pipelines.video_input import check_input_geometry, input_start_step


def self_forcing_timesteps(steps: int, shift: float = 5.0) -> list[float]:
    """The few-step schedule: ``steps`` evenly spaced points of a 1000-step flow
    table, warped by ``shift`` (4 steps: 1000, 937.5, 833.33, 625)."""
    if not 1 <= steps <= 4:
        raise ValueError(f"num_inference_steps must be between 1 and 4, got {steps}")
    out = []
    for k in range(steps):
        sigma = 1.0 - k / steps
        out.append(1000.0 * shift * sigma / (1.0 + (shift - 1.0) * sigma))
    return out


class CausalWanGeometry:
    """Needs the model (``transformer``, ``dtype``, ``device``, ``decoders``,
    ``default_decoder``, ``encoder``, ``encoder_dropped``), the sizes (``default_size``,
    ``spatial``, ``max_size``, ``fps``), the span (``sink_frames``,
    ``window_frames``, ``latent_frames``), ``text_length``, ``kv_layers``,
    ``max_batch_rows``, ``cuda_graphs``, ``commit_from_last_step``,
    ``chunks_in_flight``, ``split``, ``name`` and ``kept_room`` of the pipeline."""

    transformer: Any
    dtype: torch.dtype
    device: torch.device
    decoders: dict
    default_decoder: str
    encoder: Any
    encoder_dropped: bool
    default_size: tuple[int, int]
    spatial: int
    max_size: int
    fps: float
    sink_frames: int
    window_frames: int
    latent_frames: int
    text_length: int
    kv_layers: int
    max_batch_rows: int
    cuda_graphs: Any
    commit_from_last_step: bool
    chunks_in_flight: Callable[[str], int]
    split: bool
    name: str
    kept_room: Callable[[], int]

    def describe(self, start: StartSession) -> SessionGeometry:
        """The session's geometry; ``ValueError`` names a field this model cannot serve.
        (Model-independent fields, ``prompt_change`` among them, are the engine's
        to check: ``rtvideo.engine.validation``.)"""
        refuse_negative_prompt(start, self.name)
        if start.prompt_change == "recache" and self.split:
            raise ValueError(
                "prompt_change: 'recache' re-runs every cached chunk through every block, which a "
                "transformer split over pipeline ranks cannot do at a boundary; use 'soft' or 'reset', or --pp 1"
            )
        given = start.input  # video to video: the session's size and rate default to the input's
        width = start.width if start.width is not None else given.width if given else self.default_size[0]
        height = start.height if start.height is not None else given.height if given else self.default_size[1]
        for name, value in (("width", width), ("height", height)):
            if value % self.spatial or not self.spatial <= value <= self.max_size:
                field = _named(name, start)
                raise ValueError(f"{field} must be a multiple of {self.spatial} up to {self.max_size}, got {value}")
        steps = start.num_inference_steps if start.num_inference_steps is not None else 4
        timesteps = self_forcing_timesteps(steps)  # raises naming num_inference_steps
        fps = start.fps if start.fps is not None else given.fps if given else self.fps
        if not 1.0 <= fps <= 60.0:
            raise ValueError(f"{_named('fps', start)} must be between 1 and 60, got {fps}")
        if given is not None:  # the chunks run the steps left from the input's start step
            steps -= self._check_input(given, width, height, fps, timesteps)
        decoder = self.decoders[chosen_decoder(start, self.default_decoder, self.decoders, self.name)]
        lookahead = self.chunks_in_flight(start.prompt_change)
        return SessionGeometry(
            width=width,
            height=height,
            fps=fps,
            num_inference_steps=steps,
            first_chunk_frames=decoder.frames_for(self.latent_frames, first=True),
            frames_per_chunk=decoder.frames_for(self.latent_frames, first=False),
            num_chunks=start.num_chunks,
            transition_chunks=start.transition_chunks,
            state_bytes=self.state_bytes(width, height, steps, lookahead, decoder, encoder=given is not None),
        )

    def _check_input(self, given: Any, width: int, height: int, fps: float, timesteps: list[float]) -> int:
        """A start's input (``VideoInput``) this model can take: it has an encoder,
        the frames are the session's, and (with ``commit_from_last_step``) its
        chunks run a step at least. Returns the start step (``input_start_step``);
        ``ValueError`` names the field. A later pipeline rank, which dropped its
        encoder (``encoder_dropped``: the first rank encodes), answers as the
        first rank does."""
        if self.encoder is None and not self.encoder_dropped:
            raise ValueError(f"input: the {self.name!r} model's VAE has no encoder to take video frames")
        check_input_geometry(given, width, height, fps)
        start_step = input_start_step(given.strength, timesteps)
        if start_step == len(timesteps) and self.commit_from_last_step:
            raise ValueError(
                f"input.strength: {given.strength} leaves no denoise step, and commit_from_last_step commits "
                "the last step's keys; ask for more strength or run without the option"
            )
        return start_step

    def state_bytes(
        self,
        width: int,
        height: int,
        steps: int,
        chunks_in_flight: int = 1,
        decoder: Any = None,
        encoder: bool = False,
    ) -> int:
        """Device memory one session of this size holds on the device that holds
        most of it: its KV cache, its VAE feature cache, its latents (per chunk in
        flight the noise draws and the chunk; the cached chunks' clean latents)
        and its prompt embeddings (``encoder``, video to video: the VAE encoder's
        feature cache and a chunk's encoded input too, where the encoder is: a
        later pipeline rank holds neither and counts none); with stream batch
        (``chunks_in_flight`` > 1) the provisional keys and values of the chunks
        in flight before the newest.
        Split over pipeline ranks the KV cache counts ``kv_layers``: the most
        layers one GPU holds, or every layer when the ranks share the host's
        memory (a CPU). The roped keys (``RopedKeys``) are a pool of at most
        ``max_batch_rows`` sessions' keys, not per session: the budget reserves
        them (its transient peak). ``decoder``: the session's (its feature
        cache); None, the default's."""
        config = self.transformer.config
        h, w = height // 8, width // 8
        per_frame = (h // config.patch_size[1]) * (w // config.patch_size[2])
        item = torch.tensor([], dtype=self.dtype).element_size()
        per_token = self.kv_layers * config.num_attention_heads * config.attention_head_dim * item
        keys = (self.sink_frames + self.window_frames + self.latent_frames) * per_frame * per_token  # and the tail
        provisional = (chunks_in_flight - 1) * self.latent_frames * per_frame * per_token
        latent = config.in_channels * self.latent_frames * h * w * item
        cached_chunks = (self.sink_frames + self.window_frames) // self.latent_frames
        prompts = 2 * self.text_length * config.text_dim * item  # the current and the target embeddings
        latents = (chunks_in_flight * (steps + 2) + cached_chunks) * latent
        decoder = decoder or self.decoders[self.default_decoder]
        inputs = self.encoder.cache_bytes(h, w) + chunks_in_flight * latent if encoder and self.encoder else 0
        return 2 * (keys + provisional) + decoder.cache_bytes(h, w) + latents + prompts + inputs

    def limits(self) -> ModelLimits:
        return ModelLimits(size_multiple=self.spatial, max_size=self.max_size, max_inference_steps=4, max_fps=60.0)

    def memory_mark(self) -> int | None:
        """The device's peak allocation so far (None off CUDA): taken before a
        measurement that may run out of memory (``rtvideo.workers.calibrate``)."""
        return torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else None

    def after_out_of_memory(self, mark: int | None) -> None:
        """A measurement ran out of memory: its cached blocks are freed, and the
        peak it left (the device full) is forgotten for ``mark``, the peak before
        it, which ``session_memory_budget`` reads in its place."""
        if self.device.type != "cuda":
            return
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self._peak_floor = max(getattr(self, "_peak_floor", 0), mark or 0)

    def session_memory_budget(self) -> int | None:
        """On a GPU: the memory free after the warm-up (the device's free memory
        and what torch's allocator holds unused), less the warm-up's transient
        peak, less 1 GiB. The warm-up ran a forward of ``max_batch_rows`` rows
        (``rtvideo.workers.warmup``), so its peak is that of a full batch: activations
        and roped keys beyond the model and the warm-up sessions' state (about
        ``state_bytes`` each). With CUDA graphs (``cuda_graphs``) that peak is
        reserved twice: the graphs' memory pool, grown after this is read,
        holds one forward's activations of its own, a full batch's at most
        (the commit graphs hold no output: ``causal_wan_graphs``). On a CPU, where
        the state lives in host memory: the host's available memory (and its
        cgroup's room) less this process's transient peak and a margin
        (``rtvideo.workers.host_memory``). Either way less what the kept caches may
        still take (``kept_room``: a released session's cache kept for the
        next session of its size holds memory no session's state counts)."""
        if self.device.type != "cuda":
            return max(0, host_session_budget() - self.kept_room())
        free, _ = torch.cuda.mem_get_info(self.device)
        allocated = torch.cuda.memory_allocated(self.device)
        unused = torch.cuda.memory_reserved(self.device) - allocated
        g = self.describe(StartSession(session_id="budget", prompt="budget"))
        peak = max(getattr(self, "_peak_floor", 0), torch.cuda.max_memory_allocated(self.device)) - allocated
        transient = max(0, peak - g.state_bytes * self.max_batch_rows)
        if self.cuda_graphs is True:  # at most one full batch's activations, in the graphs' pool
            transient *= 2
        return max(0, free + unused - transient - 2**30 - self.kept_room())


def _named(name: str, start: StartSession) -> str:
    """The field a session's ``width``, ``height`` or ``fps`` came from: the
    request's own, or, where it gave none, its input video's (``input.width`` ...)."""
    return f"input.{name}" if getattr(start, name) is None and start.input is not None else name
