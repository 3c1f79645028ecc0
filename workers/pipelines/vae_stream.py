"""Streaming decode with diffusers' ``AutoencoderKLWan``, chunk by chunk.

Worker process. ``vae.decode`` clears the causal convolutions' feature cache
on every call, so decoding chunk by chunk that way leaves seams and drops
frames. Here each session owns its feature cache (a list the decoder fills),
and latent frames go through the decoder one at a time, the very first of the
stream marked ``first_chunk``: the frames equal a one-shot decode of all the
latents so far. Two sessions never share a cache.

``StreamingDecoder`` also swaps the VAE's RMS norms for ``FastRMSNorm``: the
same function, computed as ``x * rsqrt(sum(x^2))`` instead of
``F.normalize``, whose channel-dim reduction was half of the tiny preset's
decode time on a CPU.
"""

from __future__ import annotations

import torch
from diffusers import AutoencoderKLWan
from diffusers.models.autoencoders.autoencoder_kl_wan import WanRMS_norm


class FastRMSNorm(WanRMS_norm):
    """``WanRMS_norm`` with the normalisation written as a sum of squares and an
    rsqrt (in fp32 for half-precision inputs, as the original does); same
    parameters, same result to float rounding."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        work = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        squares = work.square().sum(dim=1 if self.channel_first else -1, keepdim=True)
        normalized = (work * torch.rsqrt(squares.clamp_min(1e-24))).to(x.dtype)  # F.normalize's eps is 1e-12
        return normalized * self.scale * self.gamma + self.bias


def use_fast_norms(vae: torch.nn.Module) -> int:
    """Make every ``WanRMS_norm`` in ``vae`` a ``FastRMSNorm`` (in place, weights
    kept); returns how many were swapped."""
    swapped = 0
    for module in vae.modules():
        if type(module) is WanRMS_norm:
            module.__class__ = FastRMSNorm
            swapped += 1
    return swapped


class StreamingDecoder:
    def __init__(self, vae: AutoencoderKLWan) -> None:
        self.vae = vae
        use_fast_norms(vae)
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
