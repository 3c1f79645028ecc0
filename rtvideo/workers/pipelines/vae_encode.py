"""Streaming encode with diffusers' ``AutoencoderKLWan``, chunk by chunk: a
camera's frames into the latents a video-to-video session denoises from.

Worker process; the VAE lives on the model's device. ``vae.encode`` clears
the encoder's causal feature cache (``_enc_feat_map``) on every call, so
encoding a stream chunk by chunk that way would start every chunk as if it
began the stream. Here each session owns its encoder's feature cache (a list
the encoder fills, ``new_cache``), and frames go through Wan's encoder the
way ``AutoencoderKLWan._encode`` feeds it: the stream's first frame alone,
then 4 frames a call (one latent frame each), the cache carried from call to
call and from chunk to chunk. So a chunk's latents equal the same frames'
latents in a one-shot encode of the stream so far, and no past frame is ever
encoded again: the first chunk takes 1 + 4k frames (9 for 3 latent frames),
every later chunk 4k (12).

The latent is the posterior's mean (its mode: no sampling, so the same frames
always give the same latent), normalised with the VAE's ``latents_mean`` and
``latents_std`` as the transformer takes latents (``StreamingDecoder`` undoes
that before decoding).

The demo model's ``LinearVideoCodec`` (no causal state across latent frames)
encodes each chunk with its own ``encode_frames``; its cache stays empty.

A process that never encodes (a later pipeline rank: the first encodes)
frees the encoder's weights with ``drop_encoder``; the VAE still decodes.

An encode is all or nothing: it works on a copy of the cache's list (the
encoder replaces a slot's tensor, never writes into one) and puts the copy
back only once every frame went through, so an encode that raises or is
abandoned (``abandon_point``, before each call of the encoder) leaves the
session's cache as it was, and the same chunk may be given again.
"""

from __future__ import annotations

import torch
from diffusers.models.autoencoders.autoencoder_kl_wan import WanEncoder3d, patchify

from rtvideo.workers.pipelines.base import abandon_point
from rtvideo.workers.pipelines.vae_stream import layout_bytes


def drop_encoder(vae: torch.nn.Module) -> int:
    """Free the weights only encoding reads, keeping ``vae``'s decode paths:
    Wan's ``encoder`` and ``quant_conv`` (its posterior's 1x1x1 convolution,
    which ``AutoencoderKLWan`` runs only after the encoder). Decoding reads
    neither: ``post_quant_conv`` and ``decoder``, and ``clear_cache`` the conv
    counts taken at construction. Returns the bytes freed; the demo codec's
    encode is its decoder's basis, so nothing of it goes (0). ``vae.encode``
    then fails: only a process that never encodes calls this."""
    if not isinstance(getattr(vae, "encoder", None), WanEncoder3d):
        return 0
    freed = 0
    for name in ("encoder", "quant_conv"):
        module = getattr(vae, name)
        freed += sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))
        setattr(vae, name, None)
    return freed


class StreamingEncoder:
    """A VAE's encoder for streams of pixel frames, one feature cache per stream."""

    def __init__(self, vae: torch.nn.Module) -> None:
        self.vae = vae
        config = vae.config
        self.temporal_ratio = 2 ** sum(config.temperal_downsample)
        if isinstance(getattr(vae, "encoder", None), WanEncoder3d):
            self.codec = False
            self.spatial_ratio = 2 ** len(config.temperal_downsample) * (config.patch_size or 1)
        elif hasattr(vae, "encode_frames"):  # the demo model's codec
            self.codec = True
            self.spatial_ratio = config.spatial
        else:
            raise ValueError(f"{type(vae).__name__} has no encoder this pipeline can stream")
        self.z_dim = config.z_dim
        self.dtype = next(vae.parameters()).dtype
        self.mean = torch.tensor(config.latents_mean).view(1, -1, 1, 1, 1)
        self.std = torch.tensor(config.latents_std).view(1, -1, 1, 1, 1)
        self._layout = [] if self.codec else self._probe_layout()  # so cache_bytes is arithmetic

    def new_cache(self) -> list:
        """A fresh per-stream feature cache (empty for the demo codec)."""
        return [] if self.codec else [None] * self.vae._cached_conv_counts["encoder"]

    def cache_bytes(self, latent_height: int, latent_width: int) -> int:
        """Bytes a stream's feature cache holds at this latent size once past its
        first chunk. The layout (channels, cached frames, scale of each cached
        feature) was read at construction from an encode of 1 + 4 frames of 2x2
        latent pixels."""
        return layout_bytes(self._layout, latent_height, latent_width)

    @torch.no_grad()
    def _probe_layout(self) -> list[tuple[int, int, float, float, int]]:
        side = 2
        pixels = torch.zeros(1, 3, 1 + self.temporal_ratio, side * self.spatial_ratio, side * self.spatial_ratio)
        cache = self.new_cache()
        self.encode(pixels.to(next(self.vae.parameters()).device), cache, first=True)
        return [
            (t.shape[1], t.shape[2], t.shape[-2] / side, t.shape[-1] / side, t.element_size())
            for t in cache
            if isinstance(t, torch.Tensor)
        ]

    def frames_for(self, latent_frames: int, first: bool) -> int:
        """Pixel frames that make ``latent_frames`` latent frames (the stream's
        first frame makes one on its own): 9 and 12 for 3 with Wan's VAE."""
        return latent_frames * self.temporal_ratio - (self.temporal_ratio - 1 if first else 0)

    def latent_frames_of(self, frames: int, first: bool) -> int:
        """Latent frames ``frames`` pixel frames make; ``ValueError`` unless they
        make whole latent frames (1 + 4k at the stream's start, else 4k, k >= 1)."""
        r = self.temporal_ratio
        rest = frames - 1 if first else frames
        if frames < 1 or rest % r or (not first and rest == 0):
            form = f"1 + {r}k" if first else f"{r}k (k >= 1)"
            where = "the stream's first chunk" if first else "a chunk after the first"
            raise ValueError(f"{where} takes {form} frames to make whole latent frames, got {frames}")
        return rest // r + (1 if first else 0)

    @torch.no_grad()
    def encode(self, pixels: torch.Tensor, cache: list, first: bool) -> torch.Tensor:
        """Normalised latents ``[batch, z_dim, latent_frames, H / 8, W / 8]`` of
        ``pixels`` ``[batch, 3, frames, H, W]`` in [-1, 1] on the VAE's device;
        ``first``: they begin the stream. ``cache`` carries over (changed only
        once the whole chunk is encoded)."""
        if pixels.dim() != 5 or pixels.shape[1] != 3:
            raise ValueError(f"pixels must be [batch, 3, frames, height, width], got {list(pixels.shape)}")
        height, width = pixels.shape[-2:]
        if height % self.spatial_ratio or width % self.spatial_ratio:
            raise ValueError(
                f"frame size {width}x{height} is not a multiple of the VAE's {self.spatial_ratio} pixels a latent"
            )
        self.latent_frames_of(pixels.shape[2], first)  # raises naming the frame count
        x = pixels.to(self.dtype)
        if self.codec:
            abandon_point()
            return self.vae.encode_frames(x, first)
        vae = self.vae
        if vae.config.patch_size is not None:
            x = patchify(x, patch_size=vae.config.patch_size)
        fresh = all(slot is None for slot in cache)
        if fresh != first:  # Wan's time down-samplers take a stream's start by their empty slots
            raise ValueError(
                "the stream's first chunk needs a fresh encoder cache"
                if first
                else "a chunk after the first needs the encoder cache of the chunks before it"
            )
        work = list(cache)
        r = self.temporal_ratio
        calls = [x[:, :, :1]] if first else []
        start = 1 if first else 0
        calls += [x[:, :, start + r * i : start + r * (i + 1)] for i in range((x.shape[2] - start) // r)]
        outputs = []
        for part in calls:
            abandon_point()
            outputs.append(vae.encoder(part, feat_cache=work, feat_idx=[0]))
        moments = vae.quant_conv(torch.cat(outputs, dim=2))  # a 1x1x1 convolution: per frame, no cache
        mu = moments[:, : self.z_dim]
        cache[:] = work
        return (mu - self.mean.to(mu.device, mu.dtype)) / self.std.to(mu.device, mu.dtype)

    def encode_uint8(
        self, frames: torch.Tensor, cache: list, first: bool, device: torch.device | None = None
    ) -> torch.Tensor:
        """``encode`` of uint8 RGB frames ``[frames, height, width, 3]`` (a camera's,
        decoded; level 0 is -1 and 255 is 1, the inverse of how decoded pixels
        become frames)."""
        if frames.dtype != torch.uint8 or frames.dim() != 4 or frames.shape[-1] != 3:
            raise ValueError(
                f"frames must be uint8 [frames, height, width, 3], got {frames.dtype} {list(frames.shape)}"
            )
        pixels = frames.to(device or frames.device).permute(3, 0, 1, 2).unsqueeze(0).float() / 127.5 - 1.0
        return self.encode(pixels, cache, first)

    @torch.no_grad()
    def reference_encode(self, pixels: torch.Tensor) -> torch.Tensor:
        """A one-shot encode of ``pixels`` from the stream's start through
        diffusers' own path, normalised (for tests)."""
        mu = self.vae.encode(pixels.to(self.dtype)).latent_dist.mode()
        return (mu - self.mean.to(mu.device, mu.dtype)) / self.std.to(mu.device, mu.dtype)
