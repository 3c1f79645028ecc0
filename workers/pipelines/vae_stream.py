"""Streaming decode with diffusers' ``AutoencoderKLWan``, chunk by chunk.

Worker process. ``vae.decode`` clears the causal convolutions' feature cache
on every call, so decoding chunk by chunk that way leaves seams and drops
frames. Here each session owns its feature cache (a list the decoder fills),
and latent frames go through the decoder one at a time, the very first of the
stream marked ``first_chunk``: the frames equal a one-shot decode of all the
latents so far. Two sessions never share a cache.
"""

from __future__ import annotations

import torch
from diffusers import AutoencoderKLWan


class StreamingDecoder:
    def __init__(self, vae: AutoencoderKLWan) -> None:
        self.vae = vae
        config = vae.config
        self.mean = torch.tensor(config.latents_mean).view(1, -1, 1, 1, 1)
        self.std = torch.tensor(config.latents_std).view(1, -1, 1, 1, 1)
        self.temporal_ratio = 2 ** sum(config.temperal_downsample)

    def new_cache(self) -> list:
        """A fresh per-session feature cache."""
        return [None] * self.vae._cached_conv_counts["decoder"]

    def frames_for(self, latent_frames: int, first: bool) -> int:
        """Pixel frames decoded from ``latent_frames`` (the stream's first frame makes one)."""
        return latent_frames * self.temporal_ratio - (self.temporal_ratio - 1 if first else 0)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, cache: list, first: bool) -> torch.Tensor:
        """Pixels in [-1, 1], ``[batch, 3, frames, height, width]``, for normalised
        ``latents`` ``[batch, 16, latent_frames, h, w]``; ``cache`` carries over."""
        vae = self.vae
        z = latents.to(vae.dtype) * self.std.to(latents.device, vae.dtype) + self.mean.to(latents.device, vae.dtype)
        x = vae.post_quant_conv(z)
        outputs = []
        for i in range(x.shape[2]):
            outputs.append(
                vae.decoder(x[:, :, i : i + 1], feat_cache=cache, feat_idx=[0], first_chunk=first and i == 0)
            )
        return torch.clamp(torch.cat(outputs, dim=2), -1.0, 1.0)

    def reference_decode(self, latents: torch.Tensor) -> torch.Tensor:
        """A one-shot decode through diffusers' own path (for tests)."""
        vae = self.vae
        z = latents.to(vae.dtype) * self.std.to(latents.device, vae.dtype) + self.mean.to(latents.device, vae.dtype)
        return vae.decode(z, return_dict=False)[0]
