"""Block-causal teacher forcing: the demo model's training forward and loss.

Torch side, training only. What serving does, chunk by chunk (``CausalWanPipeline``): chunk
k is denoised attending to the KV cache of the clean chunks before it
(committed at t = 0, each under its own caption) and to itself at the step's
noise level; the sampler takes ``x0 = x_t - sigma * v``. Training computes
the same attention pattern for every chunk of a clip in one forward of the
same ``WanTransformer3DModel`` with the served self-attention processors
(``make_causal``, without caches, given a mask):

- the sequence is the clean chunks 0 .. N-2 followed by the noisy chunks
  0 .. N-1, each clean chunk at its chunk's RoPE positions, and each noisy
  chunk at the same positions as its clean twin;
- a clean chunk attends to the clean chunks up to itself (the commit pass);
  a noisy chunk attends to the clean chunks before it and to itself (a
  denoise step reading the cache); with ``window_chunks`` W, only to the W
  clean chunks just before it, as the served cache's rolling window holds
  them (RoPE is relative in attention, so absolute positions along the clip
  give the same scores as the cache-relative ones serving uses);
- the timestep is per chunk (0 for the clean ones), the caption per chunk
  (``ChunkTextProcessor`` on every ``attn2``: a token attends to its own
  chunk's caption only, which is exactly diffusers' cross-attention over that
  caption alone);
- the loss is flow matching, ``v = noise - x0`` at ``x_t = (1 - sigma) x0 +
  sigma noise``, at noise levels drawn from the serving schedule;
- the clean chunks attended to (the context) may be other latents than the
  targets' (``loss(context=...)``): the trainer passes the model's own
  denoised chunks (``denoise``), since a served chunk attends to chunks the
  model made, never to ground truth.

``tests/model/test_demo_train.py`` checks that a noisy chunk's prediction
here equals the served pipeline's cached forward of that chunk.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.transformers.transformer_wan import WanTransformer3DModel, _get_qkv_projections

from rtvideo.workers.pipelines.wan_attention import ForwardContext, make_causal


class ChunkTextProcessor:
    """``attn2`` for training: diffusers' cross-attention with a mask (``[batch, 1,
    tokens, text]``, True = may attend) so each chunk sees its own caption."""

    _attention_backend = None
    _parallel_config = None

    def __init__(self) -> None:
        self.mask: torch.Tensor | None = None

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        query, key, value = _get_qkv_projections(attn, hidden_states, encoder_hidden_states)
        query = attn.norm_q(query).unflatten(2, (attn.heads, -1))
        key = attn.norm_k(key).unflatten(2, (attn.heads, -1))
        value = value.unflatten(2, (attn.heads, -1))
        out = dispatch_attention_fn(
            query, key, value, attn_mask=self.mask, dropout_p=0.0, is_causal=False, backend=None, parallel_config=None
        )
        out = out.flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))


class TeacherForcing:
    """The training forward of one transformer (whose processors it swaps once)."""

    def __init__(
        self, model: WanTransformer3DModel, latent_frames_per_chunk: int = 3, window_chunks: int | None = None
    ) -> None:
        self.model = model
        self.frames = latent_frames_per_chunk
        self.window = window_chunks  # clean chunks a chunk attends to before itself (None: all)
        self.context: ForwardContext = make_causal(model)
        self.text_processors = [ChunkTextProcessor() for _ in model.blocks]
        for block, processor in zip(model.blocks, self.text_processors, strict=True):
            block.attn2.set_processor(processor)

    def self_attention_mask(self, chunks: int, tokens_per_chunk: int, device: torch.device) -> torch.Tensor:
        """Boolean ``[tokens, tokens]`` over [clean 0 .. N-2, noisy 0 .. N-1]; with a
        window, a chunk sees the ``window`` clean chunks just before it, no earlier."""
        clean = torch.arange(chunks - 1, device=device)
        chunk = torch.cat([clean, torch.arange(chunks, device=device)]).repeat_interleave(tokens_per_chunk)
        noisy = torch.cat([torch.zeros(chunks - 1, dtype=torch.bool), torch.ones(chunks, dtype=torch.bool)])
        noisy = noisy.to(device).repeat_interleave(tokens_per_chunk)
        q_chunk, k_chunk = chunk[:, None], chunk[None, :]
        q_noisy, k_noisy = noisy[:, None], noisy[None, :]
        clean_to_clean = ~q_noisy & ~k_noisy & (k_chunk <= q_chunk)
        noisy_to_clean = q_noisy & ~k_noisy & (k_chunk < q_chunk)
        noisy_to_itself = q_noisy & k_noisy & (k_chunk == q_chunk)
        mask = clean_to_clean | noisy_to_clean | noisy_to_itself
        if self.window is not None:
            mask &= k_chunk >= q_chunk - self.window
        return mask

    def predict(
        self,
        clean: torch.Tensor,
        noisy: torch.Tensor,
        timesteps: torch.Tensor,
        text: torch.Tensor,
        caption_of_chunk: torch.Tensor,
        text_length: int,
    ) -> torch.Tensor:
        """The flow prediction ``v`` for every noisy chunk, ``[batch, C, 3N, h, w]``.

        ``clean``: the clip's latents ``[batch, C, 3N, h, w]`` (the last chunk's
        clean copy is not needed and not run); ``noisy``: the same at each
        chunk's noise level; ``timesteps``: ``[batch, N]`` (0-1000);
        ``text``: ``[batch, captions * L, text_dim]``, the clip's captions'
        embeddings one after the other; ``caption_of_chunk``: ``[batch, N]``,
        which caption each chunk has; ``text_length``: tokens per caption (L)."""
        model, f = self.model, self.frames
        batch, _, frames, height, width = noisy.shape
        chunks = frames // f
        p_t, p_h, p_w = model.config.patch_size
        tokens_per_chunk = f * (height // p_h) * (width // p_w)
        clean_frames = (chunks - 1) * f
        x = torch.cat([clean[:, :, :clean_frames], noisy], dim=2)

        cos, sin = model.rope.at(frames, height, width, 0)
        clean_tokens = clean_frames * (height // p_h) * (width // p_w)
        rotary = (torch.cat([cos[:, :clean_tokens], cos], dim=1), torch.cat([sin[:, :clean_tokens], sin], dim=1))

        parts = torch.cat([torch.zeros_like(timesteps[:, : chunks - 1]), timesteps], dim=1)  # [batch, 2N-1]
        temb, projection, text_tokens, _ = model.condition_embedder(
            parts.flatten().float(), text, None, timestep_seq_len=parts.shape[1]
        )
        temb = temb.repeat_interleave(tokens_per_chunk, dim=1)  # [batch, tokens, dim]
        projection = projection.unflatten(2, (6, -1)).repeat_interleave(tokens_per_chunk, dim=1)

        caption_parts = torch.cat([caption_of_chunk[:, : chunks - 1], caption_of_chunk], dim=1)
        caption_of_token = caption_parts.repeat_interleave(tokens_per_chunk, dim=1)  # [batch, tokens]
        caption_of_key = torch.arange(text.shape[1], device=text.device) // text_length
        cross_mask = (caption_of_token[:, :, None] == caption_of_key[None, None, :]).unsqueeze(1)

        hidden = model.patch_embedding(x).flatten(2).transpose(1, 2).contiguous()
        self.context.mask = self.self_attention_mask(chunks, tokens_per_chunk, x.device)
        for processor in self.text_processors:
            processor.mask = cross_mask
        try:
            for block in model.blocks:
                hidden = block(hidden, text_tokens, projection, rotary)
        finally:
            self.context.mask = None
            for processor in self.text_processors:
                processor.mask = None

        hidden, temb = hidden[:, clean_tokens:], temb[:, clean_tokens:]
        shift, scale = (model.scale_shift_table.unsqueeze(0) + temb.unsqueeze(2)).chunk(2, dim=2)
        out = (model.norm_out(hidden.float()) * (1 + scale.squeeze(2)) + shift.squeeze(2)).type_as(hidden)
        out = model.proj_out(out)
        out = out.reshape(batch, frames // p_t, height // p_h, width // p_w, p_t, p_h, p_w, -1)
        return out.permute(0, 7, 1, 4, 2, 5, 3, 6).flatten(6, 7).flatten(4, 5).flatten(2, 3)

    def loss(
        self,
        clean: torch.Tensor,
        noise: torch.Tensor,
        timesteps: torch.Tensor,
        text: torch.Tensor,
        caption_of_chunk: torch.Tensor,
        text_length: int,
        weight: torch.Tensor,
        context: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Flow-matching MSE over the noisy chunks, each chunk weighted by ``weight``
        ``[batch, N]`` (0 leaves a chunk out of the loss). ``context``: the clean
        chunks attended to, ``clean``'s shape (default ``clean`` itself: teacher
        forcing); the targets are ``clean``'s either way."""
        f = self.frames
        sigma = (timesteps / 1000.0).repeat_interleave(f, dim=1)[:, None, :, None, None]
        noisy = (1.0 - sigma) * clean + sigma * noise
        context = clean if context is None else context
        prediction = self.predict(context, noisy, timesteps, text, caption_of_chunk, text_length)
        error = F.mse_loss(prediction.float(), (noise - clean).float(), reduction="none")
        per_chunk = error.unflatten(2, (-1, f)).mean(dim=(1, 3, 4, 5))  # [batch, N]
        return (per_chunk * weight).sum() / weight.sum().clamp_min(1.0)

    @torch.no_grad()
    def denoise(
        self,
        clean: torch.Tensor,
        noise: torch.Tensor,
        level: float,
        text: torch.Tensor,
        caption_of_chunk: torch.Tensor,
        text_length: int,
    ) -> torch.Tensor:
        """Every chunk as the model makes it from ``clean``'s chunk noised to ``level``
        (0-1000) with ``noise``, attending to ``clean``'s chunks before it: ``x0 = x_t -
        sigma v``, the served sampler's last update (no gradient), ``clean``'s shape."""
        sigma = level / 1000.0
        noisy = (1.0 - sigma) * clean + sigma * noise
        timesteps = torch.full(caption_of_chunk.shape, float(level), device=clean.device)
        prediction = self.predict(clean, noisy, timesteps, text, caption_of_chunk, text_length)
        return (noisy.float() - sigma * prediction.float()).to(clean.dtype)
