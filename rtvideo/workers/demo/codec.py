"""The demo model's latent codec: fixed and linear, fitted once by PCA.

Worker process. A latent pixel holds one ``spatial x spatial`` block of
``temporal`` consecutive RGB frames (8 x 8 x 4 x 3 = 768 numbers), projected
on the ``z_dim`` principal components of such blocks in the training scenes
and whitened (each channel divided by its standard deviation), so latents
have unit variance per channel, like the noise they are denoised from. A
stream's first latent frame holds its first pixel frame alone (encoded as that
frame repeated ``temporal`` times), as a Wan VAE's does: 3 latent frames are
9 pixel frames for the first chunk, 12 after.

``LinearVideoCodec`` presents what the served pipeline's
``StreamingDecoder`` uses of an ``AutoencoderKLWan``: ``config.z_dim``,
``latents_mean`` / ``latents_std`` (the whitening lives there: the decoder
un-whitens before ``post_quant_conv``), ``temperal_downsample`` (4x in time),
``post_quant_conv``, ``decoder(x, feat_cache, feat_idx, first_chunk)`` for one
latent frame, and ``_cached_conv_counts``. It is a diffusers ``ModelMixin``:
``save_pretrained`` / ``from_pretrained`` write and read ``vae/config.json``
and its safetensors.

The linear inverse of the projection keeps what 16 components hold of motion
inside a block of 4 frames, and that is little: decoded, an object moving
1 px a frame moves about 0.5 px a frame inside a latent frame and jumps
2.5 px to the next. With ``refiner_width`` > 0 the decoder adds a learned
correction (``CausalRefiner``, trained by ``rtvideo.training.demo.refine``): a small
convolutional net that sees the latent frame and the one before it (where the
object was 4 frames earlier: its velocity) and corrects the linear blocks. The
encoder, and so the latent space the transformer works in, stays the
projection. The refiner keeps the previous latent frame in the decode's
feature cache (one entry, ``_cached_conv_counts``), as a Wan VAE keeps its
causal convolutions' frames, so a streamed decode equals a one-shot decode;
without it the decoder keeps no state.
"""

from __future__ import annotations

import torch
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.modeling_utils import ModelMixin
from torch import nn


class LinearFrameDecoder(nn.Module):
    """One latent frame (un-whitened coefficients) to its pixel frames in [-1, 1]."""

    def __init__(self, z_dim: int, spatial: int, temporal: int, channels: int, refiner_width: int = 0) -> None:
        super().__init__()
        self.spatial, self.temporal, self.channels = spatial, temporal, channels
        block = temporal * channels * spatial * spatial
        self.basis = nn.Parameter(torch.zeros(z_dim, block), requires_grad=False)  # rows: components
        self.mean = nn.Parameter(torch.zeros(block), requires_grad=False)  # the mean block
        # The whitening, for the refiner: the codec's config holds it (latents_std), so it is not saved.
        self.register_buffer("std", torch.ones(z_dim), persistent=False)
        self.refiner = CausalRefiner(z_dim, refiner_width, block) if refiner_width else None

    def forward(
        self,
        x: torch.Tensor,
        feat_cache: list | None = None,
        feat_idx: list | None = None,
        first_chunk: bool = False,
    ) -> torch.Tensor:
        """``x`` [batch, z_dim, latent_frames, h, w] -> [batch, 3, frames, h * s, w * s]; the
        stream's first latent frame (``first_chunk``) gives one frame (the mean of its
        ``temporal`` reconstructions), any other ``temporal`` frames each. With a
        refiner, ``feat_cache[feat_idx[0]]`` carries the previous latent frame
        (whitened) from one call to the next, and ``feat_idx[0]`` moves past it."""
        batch, _, frames, h, w = x.shape
        s, t, c = self.spatial, self.temporal, self.channels
        coefficients = x.permute(0, 2, 3, 4, 1)  # [b, f, h, w, z]
        blocks = coefficients @ self.basis.to(x.dtype) + self.mean.to(x.dtype)  # [b, f, h, w, t*c*s*s]
        if self.refiner is not None:
            blocks = blocks + self._corrections(x, feat_cache, feat_idx, first_chunk)
        blocks = blocks.view(batch, frames, h, w, t, c, s, s)
        pixels = blocks.permute(0, 5, 1, 4, 2, 6, 3, 7).reshape(batch, c, frames * t, h * s, w * s)
        if first_chunk:
            if frames != 1:
                raise ValueError("the stream's first latent frame is decoded on its own")
            pixels = pixels.mean(dim=2, keepdim=True)
        return pixels

    def _corrections(self, x: torch.Tensor, feat_cache: list | None, feat_idx: list | None, first: bool):
        """The refiner's corrections ``[b, f, h, w, block]`` of the latent frames in ``x``,
        each seeing the one before (the cache's, for the first of them)."""
        whitened = x / self.std.to(x.dtype).view(1, -1, 1, 1, 1)  # [b, z, f, h, w]
        batch, z, frames, h, w = whitened.shape
        slot = feat_idx[0] if feat_idx is not None else None
        before = None if first or feat_cache is None else feat_cache[slot]
        if before is None:
            before = torch.zeros_like(whitened[:, :, :1])
        previous = torch.cat([before, whitened[:, :, :-1]], dim=2)
        known = torch.ones_like(whitened[:, :1])
        if first or feat_cache is None or feat_cache[slot] is None:
            known[:, :, 0] = 0.0
        if feat_cache is not None:
            feat_cache[slot] = whitened[:, :, -1:].detach().clone()
            feat_idx[0] += 1

        def fold(t: torch.Tensor) -> torch.Tensor:  # [b, c, f, h, w] -> [b * f, c, h, w]
            return t.permute(0, 2, 1, 3, 4).reshape(batch * frames, -1, h, w)

        corrections = self.refiner(fold(whitened), fold(previous), fold(known))  # [b * f, h, w, block]
        return corrections.view(batch, frames, h, w, -1)


class CausalRefiner(nn.Module):
    """A correction to a latent frame's linear blocks, from that frame and the one
    before it (whitened). Zero at initialisation: the linear decode exactly."""

    def __init__(self, z_dim: int, width: int, block: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(2 * z_dim + 1, width, 3, padding=1, padding_mode="circular"),
            nn.SiLU(),
            nn.Conv2d(width, width, 3, padding=1, padding_mode="circular"),
            nn.SiLU(),
            nn.Conv2d(width, block, 1),
        )
        nn.init.zeros_(self.net[-1].weight)
        nn.init.zeros_(self.net[-1].bias)

    def forward(self, current: torch.Tensor, previous: torch.Tensor, known: torch.Tensor) -> torch.Tensor:
        """``current``, ``previous``: whitened ``[n, z, h, w]``; ``known`` ``[n, 1, h, w]``: 1
        where there is a previous frame (0: a stream's first, ``previous`` zeros) ->
        block corrections ``[n, h, w, block]``."""
        return self.net(torch.cat([current, previous, known], dim=1)).permute(0, 2, 3, 1)


class LinearVideoCodec(ModelMixin, ConfigMixin):
    """A fixed linear video codec with the streaming-decode interface of ``AutoencoderKLWan``."""

    @register_to_config
    def __init__(
        self,
        z_dim: int = 16,
        spatial: int = 8,
        temporal: int = 4,
        channels: int = 3,
        latents_mean: list[float] | None = None,
        latents_std: list[float] | None = None,
        temperal_downsample: list[bool] | None = None,
        refiner_width: int = 0,
    ) -> None:
        super().__init__()
        # Feature-cache entries per decode (StreamingDecoder.new_cache): the refiner's previous frame.
        self._cached_conv_counts = {"encoder": 0, "decoder": 1 if refiner_width else 0}
        if latents_mean is None or latents_std is None:
            self.register_to_config(latents_mean=[0.0] * z_dim, latents_std=[1.0] * z_dim)
        if temperal_downsample is None:  # AutoencoderKLWan's spelling; 2 ** sum = the temporal ratio
            halvings = temporal.bit_length() - 1
            if 2**halvings != temporal:
                raise ValueError(f"temporal must be a power of two, got {temporal}")
            self.register_to_config(temperal_downsample=[False] * (3 - halvings) + [True] * halvings)
        self.post_quant_conv = nn.Identity()
        self.decoder = LinearFrameDecoder(z_dim, spatial, temporal, channels, refiner_width)
        self.decoder.std.copy_(torch.tensor(self.config.latents_std))

    # -- fitting and encoding (training side) ------------------------------------------------

    @torch.no_grad()
    def fit(self, pixels: torch.Tensor) -> None:
        """Fit the basis, mean and whitening to ``pixels`` [n, 3, temporal, H, W] in [-1, 1]
        (groups of ``temporal`` frames), in float64: the top ``z_dim`` principal
        components, each signed so that its largest entry is positive."""
        blocks = self._blocks(pixels.double())
        mean = blocks.mean(dim=0)
        centred = blocks - mean
        covariance = centred.T @ centred / max(1, blocks.shape[0] - 1)
        values, vectors = torch.linalg.eigh(covariance)
        order = torch.argsort(values, descending=True)[: self.config.z_dim]
        basis = vectors[:, order].T  # [z, block]
        signs = torch.sign(basis.gather(1, basis.abs().argmax(dim=1, keepdim=True)))
        basis = basis * signs
        std = values[order].clamp_min(1e-12).sqrt()
        self.decoder.basis.copy_(basis.float())
        self.decoder.mean.copy_(mean.float())
        self.register_to_config(latents_std=std.float().tolist(), latents_mean=[0.0] * self.config.z_dim)
        self.decoder.std.copy_(std.float())

    @torch.no_grad()
    def encode_frames(self, pixels: torch.Tensor, first: bool) -> torch.Tensor:
        """Whitened latents [batch, z_dim, latent_frames, H / s, W / s] of ``pixels``
        [batch, 3, frames, H, W] in [-1, 1]. ``first``: the frames begin the stream,
        so the first is a latent frame of its own (``frames`` = 1 + 4k), else ``frames`` = 4k."""
        t = self.config.temporal
        if first:
            head = pixels[:, :, :1].expand(-1, -1, t, -1, -1)
            pixels = torch.cat([head, pixels[:, :, 1:]], dim=2)
        batch, channels, frames, height, width = pixels.shape
        if frames % t:
            raise ValueError(f"{frames} frames do not make whole latent frames of {t}")
        groups = pixels.view(batch, channels, frames // t, t, height, width).permute(0, 2, 1, 3, 4, 5)
        blocks = self._blocks(groups.reshape(-1, channels, t, height, width).to(self.decoder.basis.dtype))
        coefficients = (blocks - self.decoder.mean) @ self.decoder.basis.T  # [n*h*w, z]
        std = torch.tensor(self.config.latents_std, dtype=coefficients.dtype, device=coefficients.device)
        s = self.config.spatial
        latents = (coefficients / std).view(batch, frames // t, height // s, width // s, -1)
        return latents.permute(0, 4, 1, 2, 3).contiguous()

    def _blocks(self, groups: torch.Tensor) -> torch.Tensor:
        """[n, c, t, H, W] -> [n * H/s * W/s, t*c*s*s], in the decoder's block layout."""
        n, c, t, height, width = groups.shape
        s = self.config.spatial
        blocks = groups.reshape(n, c, t, height // s, s, width // s, s)
        return blocks.permute(0, 3, 5, 2, 1, 4, 6).reshape(-1, t * c * s * s)

    # -- decoding ----------------------------------------------------------------------------

    def _unwhiten(self, latents: torch.Tensor) -> torch.Tensor:
        shape = (1, -1, 1, 1, 1)
        std = torch.tensor(self.config.latents_std, dtype=latents.dtype, device=latents.device).view(shape)
        mean = torch.tensor(self.config.latents_mean, dtype=latents.dtype, device=latents.device).view(shape)
        return latents * std + mean

    @torch.no_grad()
    def decode_latents(self, latents: torch.Tensor, first: bool) -> torch.Tensor:
        """Pixels in [-1, 1] of whitened ``latents``, the way the served pipeline streams them."""
        return self.decode_stream(latents, self.new_cache(), first).clamp(-1.0, 1.0)

    def new_cache(self) -> list:
        """A fresh feature cache for ``decode_stream`` (what ``StreamingDecoder`` makes)."""
        return [None] * self._cached_conv_counts["decoder"]

    def decode_stream(self, latents: torch.Tensor, cache: list, first: bool) -> torch.Tensor:
        """Pixels (not clamped) of whitened ``latents``, one latent frame a call, as the
        served pipeline decodes them: ``cache`` carries over between calls."""
        x = self.post_quant_conv(self._unwhiten(latents))
        parts = [
            self.decoder(x[:, :, i : i + 1], feat_cache=cache, feat_idx=[0], first_chunk=first and i == 0)
            for i in range(x.shape[2])
        ]
        return torch.cat(parts, dim=2)

    def decode(self, z: torch.Tensor, return_dict: bool = True):
        """One-shot decode of un-whitened ``z`` from the stream's start (``AutoencoderKLWan.decode``'s
        contract: a tuple with the pixels when ``return_dict`` is False)."""
        x = self.post_quant_conv(z)
        cache = self.new_cache()
        parts = [
            self.decoder(x[:, :, i : i + 1], feat_cache=cache, feat_idx=[0], first_chunk=i == 0)
            for i in range(x.shape[2])
        ]
        pixels = torch.cat(parts, dim=2).clamp(-1.0, 1.0)
        return (pixels,) if not return_dict else {"sample": pixels}
