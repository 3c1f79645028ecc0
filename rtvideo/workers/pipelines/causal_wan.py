"""The causal Wan pipeline: Self-Forcing / CausVid-style chunk-autoregressive video.

Worker process; the transformer, VAE and text encoder live on the worker's
device, in bf16 on GPU and fp32 on CPU unless ``dtype`` / ``vae_dtype`` say
otherwise (``resolve_dtype``). Implements ``ChunkPipeline``:

- a chunk is ``latent_frames_per_chunk`` latent frames (3: 9 pixel frames for
  the first chunk, 12 after), denoised in 1-4 steps of the Self-Forcing
  schedule (``self_forcing_timesteps``): each step predicts the flow ``v``,
  takes ``x0 = x_t - sigma * v`` and re-noises to the next step's level;
- the transformer runs in block ranges (``wan_blocks``: embed, blocks, head),
  so ``forward`` and ``commit`` take a range and hand ``Hidden`` states on;
- after the last step, ``commit`` runs the clean forward (x0 at t = 0) that
  writes the chunk into the session's KV cache (``SessionKVCache``: sinks +
  rolling window, cache-relative RoPE), and ``decode`` turns it into frames
  with the session's streaming VAE decoder (``causal_wan_decode``: also on
  another rank, or split over two);
- prompt changes at a boundary, per session (``StartSession.prompt_change``):
  ``soft`` swaps the conditioning and keeps the cache; ``recache`` rebuilds
  the cache by re-committing the cached chunks' clean latents under the new
  conditioning; ``reset`` empties the cache and restarts the noise sequence,
  so the chunk equals the first chunk of a fresh session with the new prompt.
  ``transition_chunks`` blends the text embeddings linearly. Encoded prompts
  are cached by text.

Every session's tensors (KV cache, VAE feature cache, cached chunks' clean
latents) live in its ``CausalWanSession``, and each chunk's (conditioning,
noise draws, latent, clean latent) in a ``CausalWanChunk`` record of it
(``causal_wan_state``); ``release`` drops them all.

Parts of the pipeline live beside it: the decode side (``causal_wan_decode``),
what a start asks and costs (``causal_wan_geometry``), the captured steps
(``causal_wan_graphs``), the split over pipeline ranks
(``causal_wan_ranks``) and the models' device and dtype (``causal_wan_weights``).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch

from rtvideo.engine.messages import SessionGeometry, StartSession
from rtvideo.workers.pipelines.attention_backend import set_attention
from rtvideo.workers.pipelines.base import (
    BatchRow,
    Hidden,
    StepBatch,
    block_range,
    check_hidden,
    chosen_decoder,
)
from rtvideo.workers.pipelines.capabilities import Capabilities
from rtvideo.workers.pipelines.causal_wan_decode import CausalWanDecoding
from rtvideo.workers.pipelines.causal_wan_geometry import CausalWanGeometry, self_forcing_timesteps
from rtvideo.workers.pipelines.causal_wan_graphs import CapturedSteps, KeptCaches
from rtvideo.workers.pipelines.causal_wan_ranks import CausalWanRanks
from rtvideo.workers.pipelines.causal_wan_state import CausalWanChunk, CausalWanSession
from rtvideo.workers.pipelines.causal_wan_weights import cast, resolve_dtype
from rtvideo.workers.pipelines.causal_wan_weights import own_aligned_memory as _own_aligned_memory  # noqa: F401  (tests)
from rtvideo.workers.pipelines.conditioning import PromptBlend, nearest_known
from rtvideo.workers.pipelines.kv_cache import SessionKVCache
from rtvideo.workers.pipelines.options import check_option_types
from rtvideo.workers.pipelines.presets import Components, build_tiny, load_directory
from rtvideo.workers.pipelines.quantize import QUANTIZE, quantize_fp8
from rtvideo.workers.pipelines.step_graphs import CudaGraphsOption, step_graphs_for
from rtvideo.workers.pipelines.tiny_decoder import (
    LATENT_CHANNELS,
    TinyStreamingDecoder,
    load_tiny_decoder,
    random_tiny_decoder,
)
from rtvideo.workers.pipelines.vae_encode import StreamingEncoder
from rtvideo.workers.pipelines.vae_stream import StreamingDecoder
from rtvideo.workers.pipelines.video_input import SessionInput, input_start_step
from rtvideo.workers.pipelines.wan_attention import make_causal
from rtvideo.workers.pipelines.wan_block_forward import elementwise_ops_for, install_block_forward
from rtvideo.workers.pipelines.wan_blocks import (
    Activations,
    embed,
    head,
    run_blocks,
    stack_rows,
)


def _seed_for(*parts: object) -> int:
    digest = hashlib.sha256(":".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "big") & ((1 << 63) - 1)


class CausalWanPipeline(CausalWanGeometry, CapturedSteps, CausalWanRanks, CausalWanDecoding):
    name: ClassVar[str] = "causal_wan"
    supports_chunk_step_grouping: ClassVar[bool] = True
    supports_micro_step_execution: ClassVar[bool] = True
    capabilities: ClassVar[Capabilities] = Capabilities(
        commit_batch=True,
        decode_batch=True,
        rank_decode=True,
        rank_decode_batch=True,
        split_decode=True,  # decode_stages says whether this decoder can be split (the demo codec's cannot)
        split_decode_batch=True,
        pipeline_ranks=True,
        kv_window=True,
        video_input=True,  # take_input: a session's input frames, encoded before each boundary
        synchronize=True,
        step_graphs=True,  # graph_figures: None unless cuda_graphs
    )

    def __init__(
        self,
        components: Components,
        *,
        device: str | None = None,
        dtype: str | None = None,
        vae_dtype: str | None = None,
        latent_frames_per_chunk: int = 3,
        sink_frames: int | None = None,
        window_frames: int | None = None,
        fps: float = 16.0,
        max_size: int = 1280,
        warm_up_chunks: int = 2,
        max_batch_rows: int = 4,
        compile: bool = False,
        decoder: str = "full",
        tiny_decoder: str | None = None,
        commit_from_last_step: bool = False,
        quantize: str | None = None,
        cuda_graphs: CudaGraphsOption = False,
        kept_caches: int | None = None,
        fused_elementwise: bool = False,
        attention: str = "auto",
        name: str = "causal_wan",
    ) -> None:
        """``decoder``: what makes a session's frames unless it asks otherwise
        (``full``, the model's VAE decoder, or ``tiny``); ``tiny_decoder``: the
        tiny decoder's weights file (``random``: random weights, for tests),
        else the model directory's (``Components.tiny_decoder``), else none.
        ``commit_from_last_step``: a chunk's commit writes the keys and values
        its last denoise step computed (from the noisy latent at that step's
        timestep) instead of running a clean pass at t = 0 (StreamDiffusionV2's
        choice: a forward less a chunk; later chunks attend to a slightly
        different past, the quality cost ``bench pipeline --versus
        commit-from-last-step`` measures). One rank only. ``quantize``:
        ``fp8``, the blocks' linears in FP8 (``rtvideo.workers.pipelines.quantize``;
        a GPU of compute capability 8.9 or newer), else None.
        ``cuda_graphs``: a denoise forward (one row or several of one size)
        over full windows, and a commit pass, are captured as CUDA graphs and
        replayed (``causal_wan_graphs``; refused on a CPU); ``"eager"``: the
        same path replayed eagerly, for tests (``step_graphs_for``). ``kept_caches``: with ``cuda_graphs``, how many
        released sessions' KV caches are kept, with their graphs, for the next
        session of the same size (``causal_wan_graphs.KeptCaches``; default 1).
        ``fused_elementwise``: each block's norms, modulation and residuals as
        four compiled kernels (``wan_block_forward``; not beside ``compile``).
        ``attention``: torch's attention kernel for every block's
        self-attention (``auto``, torch's choice; ``flash``, ``cudnn``,
        ``efficient``, ``math``), refused here where torch will not run it
        (``attention_backend``)."""
        for option, value in (
            ("compile", compile),
            ("commit_from_last_step", commit_from_last_step),
            ("fused_elementwise", fused_elementwise),
        ):
            if not isinstance(value, bool):  # JSON's "yes" or 1 would pass an if
                raise ValueError(f"{option} must be true or false, got {value!r}")
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = resolve_dtype(dtype, self.device)
        auto = vae_dtype in (None, "auto")
        self.vae_dtype = self.dtype if auto else resolve_dtype(vae_dtype, self.device, "vae_dtype")
        self.name = name
        self.transformer = cast(components.transformer, self.device, self.dtype).eval()
        self.vae = cast(components.vae, self.device, self.vae_dtype).eval()
        self.text_encoder = cast(components.text_encoder, self.device, self.dtype).eval()
        self.tokenizer = components.tokenizer
        self.known_prompts = components.known_prompts  # a demo model's: any other prompt is drawn as the nearest
        self.text_length = components.text_length
        self.default_size = components.default_size
        if max_batch_rows < 1:
            raise ValueError(f"max_batch_rows must be >= 1, got {max_batch_rows}")
        self.max_batch_rows = max_batch_rows  # sessions of one geometry share a denoise forward
        self.context = make_causal(self.transformer, rows=max_batch_rows)
        self.attention = attention  # before compiling: the compiled blocks call its kernel
        set_attention(self.transformer, attention, self.device, self.dtype, self.text_length)
        self.cuda_graphs = cuda_graphs
        self.step_graphs = step_graphs_for(cuda_graphs, self.device)  # None: every forward eager
        self.context.roped.keep_stale = self.step_graphs is not None  # a graph reads its session's key buffers
        if quantize is not None and quantize not in QUANTIZE:
            raise ValueError(f"quantize must be one of {', '.join(QUANTIZE)} or null, got {quantize!r}")
        self.quantized = quantize
        if quantize == "fp8":  # before compiling: the compiled graphs take the FP8 linears
            quantize_fp8(self.transformer, self.device, self.dtype)
        self.compiled, self.fused_elementwise = compile, fused_elementwise
        self.commit_from_last_step = commit_from_last_step
        ops = elementwise_ops_for(fused_elementwise, compile, self.device)
        install_block_forward(self.transformer, ops)
        self.context.roped.rotate = ops.rope  # the queries' and keys' RoPE, fused with the groups or not
        if compile:  # regional: each block's norms, modulation, FFN, cross-attention; self-attention stays eager
            for block in self.transformer.blocks:
                block.compile()
        self.rope = self.transformer.rope
        self.num_blocks = len(self.transformer.blocks)
        self.owned = range(self.num_blocks)  # the blocks this process runs (``own_blocks``)
        self.kv_layers = self.num_blocks  # layers of KV a session costs the fullest device (``state_bytes``)
        self.decoder = StreamingDecoder(self.vae)  # the model's own: the only one a split decode splits
        try:  # video to video (``take_input``): the VAE's encoder, streaming; None for a VAE that has none
            self.encoder: StreamingEncoder | None = StreamingEncoder(self.vae)
        except ValueError:
            self.encoder = None
        self.encoder_dropped = False  # a later pipeline rank's (``own_blocks``): the first rank encodes
        self.decoders: dict[str, StreamingDecoder | TinyStreamingDecoder] = {"full": self.decoder}
        tiny = self._tiny_decoder(tiny_decoder if tiny_decoder is not None else components.tiny_decoder)
        if tiny is not None:
            self.decoders["tiny"] = tiny
        if decoder not in ("full", "tiny"):
            raise ValueError(f"decoder must be full or tiny, got {decoder!r}")
        if decoder not in self.decoders:
            raise ValueError(
                "decoder tiny: no tiny decoder weights were found: put them in the model directory "
                "(rtvideo convert --tiny-decoder taew2_1.safetensors MODEL_DIR) or name the file "
                "(pipeline option tiny_decoder)"
            )
        self.default_decoder = decoder
        self.latent_frames = latent_frames_per_chunk
        # The attention span is the weights' (the preset's, or the model directory's rtvideo.json); options override.
        sink_frames = components.sink_frames if sink_frames is None else sink_frames
        window_frames = components.window_frames if window_frames is None else window_frames
        per = latent_frames_per_chunk
        if per < 1:
            raise ValueError(f"latent_frames_per_chunk must be >= 1, got {per}")
        if sink_frames < 0 or window_frames < per:
            raise ValueError(
                f"need sink_frames >= 0 and window_frames >= latent_frames_per_chunk ({per}), "
                f"got {sink_frames} and {window_frames}"
            )
        if sink_frames % per or window_frames % per:
            raise ValueError(
                f"sink_frames ({sink_frames}) and window_frames ({window_frames}) must be multiples of "
                f"latent_frames_per_chunk ({per})"
            )
        self.sink_frames, self.window_frames = sink_frames, window_frames
        self.fps = fps
        self.max_size = max_size
        if warm_up_chunks < 0:
            raise ValueError(f"warm_up_chunks must be >= 0, got {warm_up_chunks}")
        self.warm_up_chunks = warm_up_chunks  # the first chunk and a cached one: both kernel paths
        self.spatial = 8 * self.transformer.config.patch_size[1]  # VAE 8x, then the patch
        self.kept = self._kept_caches(kept_caches)  # None: a released session's cache is freed
        self._t_zero = torch.zeros(1, device=self.device)  # the commit forward's timestep
        self._prompts: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._held: set[str] = set()
        self.batch_invariant = self.device.type == "cpu"
        """Whether a row of a batched forward computes bit for bit what it computes
        alone. Each row is embedded on its own (the patch convolution and the
        timestep MLP round by batch size: a one-row MLP is a matrix-vector
        product), and on a CPU the blocks and the head were then measured and
        are tested batch-invariant (``tests/model/test_batched_rows.py``). On a
        GPU the matrix products' kernels are chosen by shape, so a batch may
        round differently: not claimed. Read by the runner for
        ``ChunkTiming.batch_exact``."""
        self.chunks_in_flight: Callable[[str], int] = lambda prompt_change: 1
        """A session's ``lookahead`` from its ``prompt_change``: the engine's rule
        (``EngineConfig.lookahead``), set by the worker; 1 (exact) unless stream batch."""

    def _kept_caches(self, most: int | None) -> KeptCaches | None:
        """The pool of released sessions' caches (``kept_caches``): ``most`` of
        them, and at most ``most`` default-size caches (KV stores and roped keys)
        in bytes; None without captured steps, where there is no graph to keep."""
        if most is not None and (most < 0 or self.step_graphs is None):
            raise ValueError(f"kept_caches keeps caches for captured steps: needs cuda_graphs and >= 0, got {most}")
        if self.step_graphs is None:
            return None
        config, (width, height) = self.transformer.config, self.default_size
        tokens = (height // self.spatial) * (width // self.spatial)
        frames = self.sink_frames + self.window_frames + self.latent_frames  # and the tail
        item = torch.tensor([], dtype=self.dtype).element_size()
        per_layer = 3 * frames * tokens * config.num_attention_heads * config.attention_head_dim * item
        most = 1 if most is None else most
        return KeptCaches(most, most * per_layer * self.num_blocks)

    def _tiny_decoder(self, weights: str | None) -> TinyStreamingDecoder | None:
        """The tiny decoder of ``weights`` (a file, or ``random``), on this device
        in the VAE's dtype; None without weights. Refused for a model whose
        latents it was not made for."""
        if weights is None:
            return None
        channels = self.transformer.config.out_channels
        if channels != LATENT_CHANNELS:
            raise ValueError(
                f"tiny_decoder: the tiny decoder takes Wan 2.1's {LATENT_CHANNELS}-channel latents; "
                f"this model's have {channels}"
            )
        if weights == "random":
            return random_tiny_decoder(self.device, self.vae_dtype)
        return load_tiny_decoder(weights, self.device, self.vae_dtype)

    # -- text ----------------------------------------------------------------------

    @torch.no_grad()
    def encode_prompt(self, prompt: str) -> torch.Tensor:
        """Text embeddings ``[1, text_length, text_dim]``, padding rows zeroed; cached by prompt.
        A model that knows only a list of prompts gets the nearest of them (``nearest_known``)."""
        cached = self._prompts.get(prompt)
        if cached is not None:
            self._prompts.move_to_end(prompt)
            return cached
        tokens = self.tokenizer(
            nearest_known(prompt, self.known_prompts),
            padding="max_length",
            max_length=self.text_length,
            truncation=True,
            add_special_tokens=True,
            return_attention_mask=True,
            return_tensors="pt",
        )
        ids, mask = tokens.input_ids.to(self.device), tokens.attention_mask.to(self.device)
        hidden = self.text_encoder(ids, mask).last_hidden_state
        embeds = (hidden * mask.unsqueeze(-1)).to(self.dtype)
        self._prompts[prompt] = embeds
        if len(self._prompts) > 256:
            self._prompts.popitem(last=False)
        return embeds

    # -- stages ------------------------------------------------------------------------

    def open(self, start: StartSession, geometry: SessionGeometry, prompt: torch.Tensor) -> CausalWanSession:
        h, w = geometry.height // 8, geometry.width // 8
        config = self.transformer.config
        p = config.patch_size
        timesteps, given = self._schedule(start, geometry)
        session = CausalWanSession(
            session_id=start.session_id,
            start=start,
            geometry=geometry,
            kv=self._session_cache(
                layers=self.owned,
                sink_frames=self.sink_frames,
                window_frames=self.window_frames,
                tokens_per_frame=(h // p[1]) * (w // p[2]),
                heads=config.num_attention_heads,
                head_dim=config.attention_head_dim,
                batch=1,
                dtype=self.dtype,
                device=self.device,
                tail_frames=self.latent_frames,  # room for the chunk computed: attention reads one span
            ),
            decoder=(kind := chosen_decoder(start, self.default_decoder, self.decoders, self.name)),
            vae_cache=self.decoders[kind].new_cache(),
            latent_shape=(1, config.in_channels, self.latent_frames, h, w),
            timesteps=timesteps,
            schedule=torch.tensor(timesteps, device=self.device),
            prompt=PromptBlend(prompt),
            lookahead=self.chunks_in_flight(start.prompt_change),
            input=given,
        )
        self._held.add(start.session_id)
        return session

    def _schedule(self, start: StartSession, geometry: SessionGeometry) -> tuple[list[float], SessionInput | None]:
        """The schedule a session's chunks run (``geometry.num_inference_steps``
        steps), and its input side (None: text to video): with an input, the
        few-step schedule of the start's steps from the input's start step. A
        later pipeline rank (no encoder: the first rank encodes) keeps the
        schedule but no encoder cache, and encodes nothing."""
        given = start.input
        if given is None:
            return self_forcing_timesteps(geometry.num_inference_steps), None
        timesteps = self_forcing_timesteps(start.num_inference_steps if start.num_inference_steps is not None else 4)
        start_step = input_start_step(given.strength, timesteps)
        if len(timesteps) - start_step != geometry.num_inference_steps:
            raise ValueError(f"the geometry's {geometry.num_inference_steps} steps are not the input's schedule")
        encode = start_step > 0 and self.encoder is not None
        cache = self.encoder.new_cache() if encode else []
        return timesteps[start_step:], SessionInput(
            strength=given.strength, start_step=start_step, encode=encode, encoder_cache=cache
        )

    def take_input(self, session: CausalWanSession, chunk_index: int, frames: Any) -> None:
        """First rank, for a session opened with an input, once per chunk in chunk
        order, before that chunk's boundary: the chunk's camera frames, uint8
        ``[frames, height, width, 3]`` (torch or numpy) at the session's size, 9
        for chunk 0 and 12 for each later one (``geometry.first_chunk_frames`` /
        ``frames_per_chunk``), encoded at once by the session's streaming VAE
        encoder (its cache carried from the chunk before) and kept for the
        boundary. ``ValueError`` names a wrong count, size or type, and a
        session without an input; ``ChunkOrderError`` a chunk out of order. All
        or nothing: when it raises, the same chunk may be given again. A later
        pipeline rank, which dropped the encoder (``own_blocks``), is never given
        frames: ``RuntimeError``."""
        if self.owned.start > 0:
            raise RuntimeError(
                f"take_input: this pipeline rank runs blocks {self.owned.start}-{self.owned.stop - 1} of "
                f"{self.num_blocks} and holds no VAE encoder; a session's input frames go to the first rank "
                "(blocks from 0), which encodes them"
            )
        if session.input is None:
            raise ValueError(f"session {session.session_id} was opened without an input: it takes no frames")
        size = (session.geometry.width, session.geometry.height)
        session.input.take(self.encoder, session.session_id, chunk_index, frames, size, self.latent_frames, self.dtype)

    def boundary(
        self,
        session: CausalWanSession,
        chunk_index: int,
        prompt: torch.Tensor | None = None,
        transition_chunks: int = 0,
    ) -> None:
        """Apply a prompt change (``soft``: the conditioning only; ``reset``: empty
        the cache and restart the noise sequence; ``recache``: rebuild the cache
        under the chunk's new conditioning), then prepare the chunk: its
        conditioning and every noise draw it will take."""
        session.check_boundary(chunk_index)
        mode = session.start.prompt_change if prompt is not None else None
        if prompt is not None:
            session.prompt.switch(prompt, transition_chunks)
        if mode == "reset":
            session.kv.reset()
            session.sink_chunks, session.window_chunks = [], []
            session.noise_origin = chunk_index
        conditioning = session.prompt.next_chunk()
        if mode == "recache":
            self._recache(session, conditioning)
        # Every noise draw of the chunk (the start, then one per re-noising), in one
        # copy: a copy from pageable host memory waits for the device, so one per
        # chunk at the boundary rather than one per step.
        steps = len(session.timesteps)
        encoded = None if session.input is None else session.input.for_boundary(session.session_id, chunk_index)
        if steps == 0:  # an input at strength 0: the encoded frames are the chunk's clean latent
            session.chunks[chunk_index] = CausalWanChunk(
                chunk_index, 0, conditioning=conditioning, noise=None, latent=None, clean=encoded
            )
            return
        draws = torch.stack([self._noise(session, chunk_index, step) for step in range(-1, steps - 1)])
        noise = draws.to(self.device, self.dtype)
        latent = noise[0]
        if encoded is not None:  # an input: its latent noised to the first step's level, as the sampler re-noises
            sigma = session.timesteps[0] / 1000.0
            latent = ((1.0 - sigma) * encoded.float() + sigma * noise[0].float()).to(self.dtype)
        session.chunks[chunk_index] = CausalWanChunk(
            chunk_index, steps, conditioning=conditioning, noise=noise, latent=latent
        )

    @torch.no_grad()
    def forward(
        self,
        batch: StepBatch,
        sessions: Sequence[CausalWanSession],
        blocks: range | None = None,
        hidden: Hidden | None = None,
    ) -> list[torch.Tensor] | Hidden:
        """One pass per group of rows with the same latent shape (sessions of one
        geometry), each row at its own step, cache and position. A forward
        ``_captured_step`` can take goes through the captured steps."""
        blocks = block_range(blocks, self.num_blocks)
        check_hidden(hidden, blocks, batch.rows)
        if self._capturable(batch, sessions, blocks):
            return self._captured_step(batch, sessions)
        groups = self.embed_rows(batch, sessions) if blocks.start == 0 else hidden.tensors
        groups = [
            (
                indices,
                self._blocks(
                    tuple(sessions[i].kv for i in indices),
                    activations,
                    blocks,
                    commit=False,
                    chunks=tuple(batch.rows[i].chunk_index for i in indices),
                    provisional=tuple(sessions[i].lookahead > 1 for i in indices),
                    staged=tuple(
                        self.commit_from_last_step and batch.rows[i].step == len(sessions[i].timesteps) - 1
                        for i in indices
                    ),
                ),
            )
            for indices, activations in groups
        ]
        if blocks.stop < self.num_blocks:
            return Hidden(blocks.stop, batch.rows, groups)
        predictions: list[torch.Tensor] = [None] * len(sessions)  # type: ignore[list-item]
        for indices, activations in groups:
            for i, prediction in zip(indices, head(self.transformer, activations).split(1), strict=True):
                predictions[i] = prediction
        return predictions

    def sampler_step(self, session: CausalWanSession, row: BatchRow, prediction: torch.Tensor) -> None:
        chunk = session.chunk_at(row)
        timesteps = session.timesteps
        step = row.step
        sigma = timesteps[step] / 1000.0
        x0 = chunk.latent.float() - sigma * prediction.float()
        if step + 1 < len(timesteps):
            sigma_next = timesteps[step + 1] / 1000.0
            chunk.latent = ((1.0 - sigma_next) * x0 + sigma_next * chunk.noise[step + 1]).to(self.dtype)
        else:
            chunk.clean = x0.to(self.dtype)
            chunk.latent = chunk.noise = None  # freed once the chunk is denoised
        chunk.at_step = step + 1

    @torch.no_grad()
    def commit(
        self,
        session: CausalWanSession,
        chunk_index: int,
        blocks: range | None = None,
        hidden: Hidden | None = None,
    ) -> Hidden | None:
        """The clean pass at t = 0: every block's keys and values of the chunk go into
        the session's cache (no head: its output is not used). A range from block 0
        embeds the chunk's clean latent; a later one continues from ``hidden`` (on
        a later pipeline rank, which holds no chunk record, only its blocks' cache).
        The range that ends at the last block marks the record committed where the
        record lives in this process; across ranks the first rank does that
        (``finish_commit``) when the pass comes back."""
        blocks = block_range(blocks, self.num_blocks)
        sid = session.session_id
        caches = (session.kv,)
        if self.commit_from_last_step:  # one rank: the last step staged every layer's keys and values
            self._take_staged(session, chunk_index, session.chunk_to_commit(chunk_index))
            return None
        if blocks.start == 0:
            chunk = session.chunk_to_commit(chunk_index)
            chunk.committing = True
            if self._commit_capturable((session,), blocks):
                self._captured_commits((session,), (chunk_index,), (chunk,))
                self._take_staged(session, chunk_index, chunk)
                return None
            rows = (BatchRow(sid, chunk_index, chunk.steps),)
            activations = self._embed(caches, chunk.clean, self._t_zero, chunk.conditioning, (chunk_index,))
        else:
            if chunk_index in session.chunks:
                session.chunk_to_commit(chunk_index)
            if hidden is None or len(hidden.rows) != 1 or hidden.rows[0][:2] != (sid, chunk_index):
                raise ValueError(f"blocks from {blocks.start} need the hidden states of chunk {chunk_index} of {sid}")
            rows = hidden.rows
            check_hidden(hidden, blocks, rows)
            activations = hidden.tensors
        activations = self._blocks(caches, activations, blocks, commit=True, chunks=(chunk_index,))
        if blocks.stop < self.num_blocks:
            return Hidden(blocks.stop, rows, activations)
        if chunk_index in session.chunks:
            self.finish_commit(session, chunk_index)
        return None

    @torch.no_grad()
    def commit_batch(self, sessions: Sequence[CausalWanSession], chunk_indices: Sequence[int]) -> None:
        """``commit`` of one chunk of each of several sessions, every block (one
        rank), in one pass per latent shape. All or nothing: every pass only
        stages its keys and values, and the caches take them once every pass
        has run, so when it raises or is abandoned no cache and no record
        changed (a later commit stages every layer afresh). On a CPU each
        session's cache ends bit for bit as its own commit leaves it
        (``batch_invariant``)."""
        if self.split:
            raise ValueError("commit_batch runs every block: one rank only")
        if len(sessions) != len(chunk_indices) or len({s.session_id for s in sessions}) != len(sessions):
            raise ValueError("commit_batch takes one chunk of each session")
        chunks = [s.chunk_to_commit(index) for s, index in zip(sessions, chunk_indices, strict=True)]
        groups: dict[tuple, list[int]] = {}  # a pass per latent shape
        if self.commit_from_last_step:  # the last steps staged them: no pass, but all or nothing all the same
            for session in sessions:
                session.kv.check_staged()
        elif self._commit_capturable(sessions, range(self.num_blocks)):
            self._captured_commits(sessions, chunk_indices, chunks)
        else:
            for i, session in enumerate(sessions):
                groups.setdefault(session.latent_shape, []).append(i)
        for indices in groups.values():
            caches = tuple(sessions[i].kv for i in indices)
            at = tuple(chunk_indices[i] for i in indices)
            clean = torch.cat([chunks[i].clean for i in indices])
            text = torch.cat([chunks[i].conditioning for i in indices])
            activations = self._embed(caches, clean, self._t_zero, text, at)
            self._blocks(caches, activations, range(self.num_blocks), commit=True, chunks=at, write=False)
        for session, index, chunk in zip(sessions, chunk_indices, chunks, strict=True):
            self._take_staged(session, index, chunk)

    def _take_staged(self, session: CausalWanSession, chunk_index: int, chunk: CausalWanChunk) -> None:
        """The chunk's staged keys and values go into the session's cache, in
        place of its provisional ones, and its record is committed."""
        session.kv.commit(chunk.clean.shape[2])
        session.kv.drop_provisional(chunk_index)
        self.finish_commit(session, chunk_index)

    def finish_commit(self, session: CausalWanSession, chunk_index: int) -> None:
        """The commit pass has run through every block: mark the record committed
        (only ``decode`` is left) and keep its clean latent for a re-cache."""
        chunk = session.chunk_to_commit(chunk_index)
        chunk.committed = True
        if self.device.type == "cuda":  # the decode may run on another stream (the decode stage's thread)
            chunk.committed_on_device = torch.cuda.Event()
            chunk.committed_on_device.record()
        self._keep_for_recache(session, chunk.clean)

    def release(self, session: CausalWanSession) -> None:
        self._held.discard(session.session_id)
        self._let_go(session)  # its cache kept for the next session of its size, or its graphs forgotten
        session.free()

    def held_sessions(self) -> tuple[str, ...]:
        return tuple(self._held)

    def synchronize(self) -> None:
        """Wait until the device has finished its queued work (timing: benchmarks)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # -- internals ---------------------------------------------------------------------

    def _noise(self, session: CausalWanSession, chunk_index: int, step: int) -> torch.Tensor:
        """Gaussian noise for (seed, chunk since the last reset, step), drawn on
        the CPU in fp32: the same session parameters draw the same noise on any
        device."""
        chunk = chunk_index - session.noise_origin
        generator = torch.Generator(device="cpu").manual_seed(_seed_for(session.start.seed, chunk, step))
        return torch.randn(session.latent_shape, generator=generator, dtype=torch.float32)

    def embed_rows(self, batch: StepBatch, sessions: Sequence[CausalWanSession]) -> list[tuple[list[int], Activations]]:
        """The rows' chunks embedded, one group per latent shape: (row indices, activations)."""
        chunks = [session.chunk_at(row) for row, session in zip(batch.rows, sessions, strict=True)]
        groups: dict[tuple, list[int]] = {}
        for index, session in enumerate(sessions):
            groups.setdefault(session.latent_shape, []).append(index)
        embedded = []
        for indices in groups.values():
            timesteps = torch.stack([sessions[i].schedule[batch.rows[i].step] for i in indices])
            latents = torch.cat([chunks[i].latent for i in indices])
            text = torch.cat([chunks[i].conditioning for i in indices])
            caches = tuple(sessions[i].kv for i in indices)
            at = tuple(batch.rows[i].chunk_index for i in indices)
            embedded.append((indices, self._embed(caches, latents, timesteps, text, at)))
        return embedded

    def _embed(
        self,
        caches: tuple[SessionKVCache, ...],
        latent: torch.Tensor,
        timesteps: torch.Tensor | Sequence[float],
        text: torch.Tensor,
        chunks: Sequence[int] | None = None,
    ) -> Activations:
        """Embed ``latent`` (one batch row per cache), each row's RoPE positions
        after the frames it attends to before itself: those its cache holds, and
        with stream batch the provisional frames of the chunks before it
        (``chunks``: each row's chunk index; None: the held frames only)."""
        if chunks is None:
            offsets = tuple(kv.frames for kv in caches)
        else:
            offsets = tuple(kv.frames_before(c) for kv, c in zip(caches, chunks, strict=True))
        # fp32, as diffusers' Wan pipelines pass it: the time embedder stays fp32,
        # and bf16 would round 937.5 to 936. A tensor already on the device
        # (the sessions' schedules) costs no host round trip.
        timestep = torch.as_tensor(timesteps, device=self.device, dtype=torch.float32)
        try:
            # Row by row, so a row's embedding is the one it gets alone: the patch
            # convolution and the timestep MLP of a batch round differently from
            # one row's (see ``batch_invariant``); the blocks take the batch.
            rows = latent.shape[0]
            if rows == 1:
                self.rope.frame_offsets = offsets
                return embed(self.transformer, latent, timestep, text)
            timestep = timestep.reshape(-1).expand(rows) if timestep.numel() == 1 else timestep
            text = text.expand(rows, -1, -1) if text.shape[0] == 1 else text
            parts = []
            for row in range(rows):
                self.rope.frame_offsets = (offsets[row if len(offsets) > 1 else 0],)
                parts.append(
                    embed(self.transformer, latent[row : row + 1], timestep[row : row + 1], text[row : row + 1])
                )
            return stack_rows(parts)
        finally:
            self.rope.frame_offsets = (0,)

    def _blocks(
        self,
        caches: tuple[SessionKVCache, ...],
        activations: Activations,
        blocks: range,
        commit: bool,
        chunks: tuple[int, ...] = (),
        provisional: tuple[bool, ...] = (),
        write: bool = True,
        staged: tuple[bool, ...] = (),
    ) -> Activations:
        """Blocks ``blocks``, each row attending to its cache at its own position
        (``chunks``: each row's chunk index, for the provisional frames before it;
        ``provisional``: which rows keep theirs, stream batch); a commit pass
        stages each row's keys and values into its cache and, with ``write``
        (one row), commits them once the last block has run, replacing the
        chunk's provisional ones (``commit_batch`` writes its rows itself);
        ``staged``: the rows of a denoise pass that stage theirs for their
        chunk's commit (``commit_from_last_step``)."""
        if commit and write and len(caches) != 1:
            raise ValueError("a commit forward that writes its cache carries one row")
        ctx = self.context
        ctx.caches, ctx.commit, ctx.grid = caches, commit, activations.latent_shape[3:]
        ctx.chunks, ctx.provisional, ctx.staged = chunks, provisional, staged
        try:
            activations = run_blocks(self.transformer, activations, blocks)
            if commit and write and blocks.stop == self.owned.stop:
                caches[0].commit(activations.latent_shape[2])
                if chunks:
                    caches[0].drop_provisional(chunks[0])
        finally:
            ctx.caches, ctx.commit, ctx.chunks, ctx.provisional, ctx.staged = (), False, (), (), ()
        return activations

    def _run(
        self,
        caches: tuple[SessionKVCache, ...],
        latent: torch.Tensor,
        timesteps: torch.Tensor | Sequence[float],
        text: torch.Tensor,
        commit: bool = False,
    ) -> torch.Tensor:
        """A whole pass over ``latent`` (one row per cache): embed, every block, head."""
        activations = self._embed(caches, latent, timesteps, text)
        return head(self.transformer, self._blocks(caches, activations, range(self.num_blocks), commit))

    def _keep_for_recache(self, session: CausalWanSession, clean: torch.Tensor) -> None:
        """Keep a committed chunk's clean latent while the cache holds the chunk."""
        if len(session.sink_chunks) * self.latent_frames < self.sink_frames:
            session.sink_chunks.append(clean)
        else:
            keep = self.window_frames // self.latent_frames
            session.window_chunks = [*session.window_chunks, clean][-keep:]

    def _recache(self, session: CausalWanSession, conditioning: torch.Tensor) -> None:
        """Rebuild the cache from the cached chunks' clean latents under ``conditioning``."""
        session.kv.reset()
        caches = (session.kv,)
        for clean in session.cached_chunks:
            activations = self._embed(caches, clean, self._t_zero, conditioning)
            self._blocks(caches, activations, range(self.num_blocks), commit=True)


NOT_OPTIONS = ("components", "name")
"""Arguments of ``CausalWanPipeline`` the factories give, not the user."""
NAMED_CHOICES = ("attention", "cuda_graphs")
"""Options ``CausalWanPipeline`` refuses naming the values it takes."""


def build(preset: str = "tiny", model_dir: str | None = None, device: str | None = None, **options: Any):
    """The pipeline registry's factory: a preset (``tiny``: random weights;
    ``demo``: the shipped demo model), or a model directory."""
    check_option_types(CausalWanPipeline.__init__, options, NOT_OPTIONS, NAMED_CHOICES)
    if model_dir is not None:
        target = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = resolve_dtype(options.get("dtype"), target)
        if target.type == "cpu":  # a full-size chunk takes minutes there: no warm-up unless asked
            options.setdefault("warm_up_chunks", 0)
        return CausalWanPipeline(load_directory(model_dir, dtype), device=device, name=str(model_dir), **options)
    if preset == "demo":
        return build_demo(device=device, **options)
    if preset != "tiny":
        raise ValueError(f"unknown preset {preset!r}; known: tiny, demo")
    return CausalWanPipeline(build_tiny(options.pop("seed", 0)), device=device, name="tiny", **options)


def build_demo(device: str | None = None, **options: Any):
    """The ``demo`` preset: the shipped demo model (``rtvideo.workers.demo.WEIGHTS``), read
    offline. Small enough to warm up at start on a CPU like the tiny preset."""
    from rtvideo.workers.demo import WEIGHTS

    check_option_types(CausalWanPipeline.__init__, options, NOT_OPTIONS, NAMED_CHOICES)
    options.setdefault("warm_up_chunks", 2)
    target = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    components = load_directory(WEIGHTS, resolve_dtype(options.get("dtype"), target))
    return CausalWanPipeline(components, device=device, name="demo", **options)
