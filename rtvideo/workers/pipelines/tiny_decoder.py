"""A tiny streaming decoder for Wan 2.1 latents: the TAEHV architecture.

Worker process; its weights and each session's state live on the model's
device. Wan's VAE decoder is about a third of a chunk's time on a GPU (316
of 788 ms at 832x480 on an H200); a tiny decoder of the TAEHV design
(madebyollin/taehv, MIT; ``taew2_1`` is trained for Wan 2.1's latents)
makes the same frames' size and count from the same latents in a small
fraction of that, at some cost in detail. This is our implementation of
that design, which loads its published weights.

The network, on one latent frame at a time or on many at once: the latent
(16 channels, in the diffusion model's own space: no mean or scale to undo)
through a soft clamp (3 tanh(x / 3)), a 3x3 convolution to 256 channels and
three stages, each of three memory blocks, a 2x nearest up-sampling, a
time up-sampling (a 1x1 convolution that makes ``stride`` frames of each
frame's channels: 1 in the first stage, 2 in the others) and a 3x3
convolution to the next stage's width (256, 128, 64, 64); then a ReLU and a
3x3 convolution to RGB in [0, 1]. A memory block sees its input frame beside
its own input one frame before (zeros before the stream's first): that is
the decoder's only memory, so a session's state is the last input frame of
each of its nine memory blocks. Four frames come out of each latent frame;
the stream's first three are dropped, so a stream of ``1 + 4k`` frames
comes from ``1 + k`` latents, as Wan's decoder makes it.

Streaming: ``decode`` takes a chunk's latent frames and the session's state
and runs each layer over all of the chunk's frames at once (a memory block's
"frame before" is the chunk's frames shifted by one, the first taken from
the state), then keeps each block's last input frame as the new state. A
chunk's frames are therefore those of one pass over every latent so far,
with nothing decoded twice (``tests/model/test_tiny_decoder.py``: equal to
the design's one-shot decode). Several sessions decode as one batch when
their streams are alike (``decode_rows``).

Weights: the ``taew2_1`` file as published (``.safetensors``, or a torch
file of its state dict), of which the decoder's tensors (``decoder.N.…``)
are read; ``load_tiny_decoder`` names the file and what is wrong with it
when it is not one. ``rtvideo convert --tiny-decoder FILE MODEL_DIR``
copies them into a model directory (``tiny_decoder/``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from rtvideo.workers.pipelines.base import abandon_point
from rtvideo.workers.pipelines.vae_stream import StreamingDecoder

LATENT_CHANNELS = 16  # Wan 2.1's latent channels
WIDTHS = (256, 128, 64, 64)  # the channels of each stage, and of the last convolution's input
TIME_STRIDES = (1, 2, 2)  # frames each stage's time up-sampling makes of one
FRAMES_PER_LATENT = 4
DROPPED = FRAMES_PER_LATENT - 1  # frames dropped at a stream's start
SPATIAL = 8  # pixels per latent pixel, each way
WEIGHTS_NAME = "tiny_decoder/diffusion_pytorch_model.safetensors"  # in a model directory


def _conv(n_in: int, n_out: int, bias: bool = True) -> nn.Conv2d:
    return nn.Conv2d(n_in, n_out, 3, padding=1, bias=bias)


class _SoftClamp(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x / 3) * 3


class _MemoryBlock(nn.Module):
    """Three 3x3 convolutions over a frame and the same block's input one frame
    before, added to the frame (a residual), then a ReLU."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.conv = nn.Sequential(
            _conv(2 * width, width), nn.ReLU(), _conv(width, width), nn.ReLU(), _conv(width, width)
        )

    def forward(self, x: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
        return F.relu(self.conv(torch.cat([x, before], 1)) + x)


class _TimeUp(nn.Module):
    """Each frame's channels made into ``stride`` frames, in order (a 1x1 convolution)."""

    def __init__(self, width: int, stride: int) -> None:
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv2d(width, width * stride, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        frames, channels, height, width = x.shape
        return self.conv(x).reshape(frames * self.stride, channels, height, width)


def _layers() -> nn.ModuleList:
    """The decoder's layers, indexed as the published weights name them."""
    layers: list[nn.Module] = [_SoftClamp(), _conv(LATENT_CHANNELS, WIDTHS[0]), nn.ReLU()]
    for stage, stride in enumerate(TIME_STRIDES):
        width = WIDTHS[stage]
        layers += [_MemoryBlock(width) for _ in range(3)]
        layers += [nn.Upsample(scale_factor=2), _TimeUp(width, stride), _conv(width, WIDTHS[stage + 1], bias=False)]
    layers += [nn.ReLU(), _conv(WIDTHS[-1], 3)]
    return nn.ModuleList(layers)


class TinyDecoder(nn.Module):
    """The network (random weights until ``load_state_dict``)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = _layers()

    @property
    def memory_blocks(self) -> int:
        return sum(isinstance(layer, _MemoryBlock) for layer in self.layers)

    def run(self, latents: torch.Tensor, state: list) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``latents`` ``[rows, frames, 16, h, w]`` after ``state`` (each memory
        block's last input frame, ``[rows, width, ...]``, or None before a
        stream's first frame): ``[rows, 4 * frames, 3, 8h, 8w]`` in [0, 1]
        (nothing dropped) and the state after them."""
        rows, frames = latents.shape[:2]
        x = latents.reshape(rows * frames, *latents.shape[2:])
        after: list[torch.Tensor] = []
        for layer in self.layers:
            abandon_point()
            if isinstance(layer, _MemoryBlock):
                seq = x.reshape(rows, x.shape[0] // rows, *x.shape[1:])
                kept = state[len(after)]
                first = torch.zeros_like(seq[:, :1]) if kept is None else kept.unsqueeze(1).to(seq.dtype)
                before = torch.cat([first, seq[:, :-1]], 1).reshape(x.shape)
                after.append(seq[:, -1].clone())
                x = layer(x, before)
            else:
                x = layer(x)
        out = x.reshape(rows, x.shape[0] // rows, *x.shape[1:])
        return out.clamp(0.0, 1.0), after

    def decode_all(self, latents: torch.Tensor) -> torch.Tensor:
        """The whole stream ``latents`` ``[rows, frames, 16, h, w]`` in one pass:
        ``[rows, 4 * frames - 3, 3, 8h, 8w]`` in [0, 1]."""
        frames, _ = self.run(latents, [None] * self.memory_blocks)
        return frames[:, DROPPED:]


class TinyStreamingDecoder:
    """``vae_stream.StreamingDecoder``'s interface over ``TinyDecoder``: latents
    and pixels as the pipeline passes them (``[batch, 16, frames, h, w]`` in the
    model's space; pixels ``[batch, 3, frames, H, W]`` in [-1, 1]), a session's
    state as its cache (a list, one slot per memory block)."""

    stages = 0  # not split over ranks: its stages are a fraction of a frame's work

    def __init__(self, network: TinyDecoder, dtype: torch.dtype) -> None:
        self.network = network
        self.dtype = dtype

    def new_cache(self) -> list:
        return [None] * self.network.memory_blocks

    def cache_bytes(self, latent_height: int, latent_width: int) -> int:
        """Bytes a session's state holds at this latent size."""
        itemsize = torch.empty(0, dtype=self.dtype).element_size()
        pixels, total = latent_height * latent_width, 0
        for layer in self.network.layers:
            if isinstance(layer, nn.Upsample):
                pixels *= 4
            elif isinstance(layer, _MemoryBlock):
                total += layer.conv[0].out_channels * pixels * itemsize
        return total

    @staticmethod
    def frames_for(latent_frames: int, first: bool) -> int:
        return latent_frames * FRAMES_PER_LATENT - (DROPPED if first else 0)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, cache: list, first: bool) -> torch.Tensor:
        """Pixels in [-1, 1], ``[batch, 3, frames, H, W]``, of ``latents``
        ``[batch, 16, latent_frames, h, w]`` (``first``: they begin the stream);
        ``cache`` (the state) carries over, replaced only once the chunk is made."""
        frames, after = self.network.run(latents.to(self.dtype).transpose(1, 2), cache)
        if first:
            frames = frames[:, DROPPED:]
        cache[:] = after
        return frames.transpose(1, 2).float() * 2.0 - 1.0

    cache_shape = staticmethod(StreamingDecoder.cache_shape)  # a state is a list of tensors or None, as Wan's

    @torch.no_grad()
    def decode_rows(self, latents: Sequence[torch.Tensor], caches: Sequence[list], first: bool) -> list[torch.Tensor]:
        """``decode`` of several streams as one batch (latents of one shape, caches
        of one ``cache_shape``), stacked and unstacked as the streaming VAE
        decoder's are; each row's pixels. The caches change only once every row
        is decoded."""
        StreamingDecoder.check_rows(latents, caches, "decode_rows")
        work = StreamingDecoder.stacked(caches)
        pixels = self.decode(torch.cat(list(latents)), work, first)
        StreamingDecoder.unstack(work, caches)
        return list(pixels.split(1))


class TinyDecoderWeightsError(ValueError):
    """A tiny decoder's weights file that is missing or is not one (the message names it)."""


def read_decoder_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """The decoder's tensors of a ``taew2_1`` weights file (``.safetensors``, or a
    torch file of a state dict), keyed as ``TinyDecoder.layers`` names them,
    checked against its shapes. ``TinyDecoderWeightsError`` naming the file
    when it is missing, unreadable, or holds other tensors."""
    path = Path(path)
    if not path.is_file():
        raise TinyDecoderWeightsError(f"tiny decoder weights {str(path)!r}: no such file")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            tensors = load_file(str(path))
        else:
            tensors = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as error:
        raise TinyDecoderWeightsError(
            f"tiny decoder weights {str(path)!r} could not be read ({type(error).__name__}: {error}); "
            "expected the taew2_1 file as published (.safetensors, or .pth)"
        ) from None
    if not isinstance(tensors, dict) or not all(isinstance(t, torch.Tensor) for t in tensors.values()):
        raise TinyDecoderWeightsError(f"tiny decoder weights {str(path)!r} hold no state dict of tensors")
    wanted = TinyDecoder().state_dict()
    found = {f"layers.{key[len('decoder.') :]}": t for key, t in tensors.items() if key.startswith("decoder.")}
    missing = sorted(set(wanted) - set(found))
    if missing:
        names = ", ".join("decoder." + key.removeprefix("layers.") for key in missing[:3])
        raise TinyDecoderWeightsError(
            f"tiny decoder weights {str(path)!r} lack {len(missing)} of the decoder's {len(wanted)} tensors "
            f"(first: {names}): not a TAEHV file for Wan 2.1 (taew2_1)"
        )
    out = {}
    for key, expected in wanted.items():
        tensor = found[key]
        if key.endswith("conv.weight") and _is_time_up(key) and tensor.shape[0] > expected.shape[0]:
            tensor = tensor[-expected.shape[0] :]  # trained to make more frames: the last frame's channels
        if tuple(tensor.shape) != tuple(expected.shape):
            raise TinyDecoderWeightsError(
                f"tiny decoder weights {str(path)!r}: decoder.{key.removeprefix('layers.')} has shape "
                f"{tuple(tensor.shape)}, the Wan 2.1 decoder's is {tuple(expected.shape)} (another model's TAEHV?)"
            )
        out[key] = tensor.float()
    return out


def _is_time_up(key: str) -> bool:
    index = int(key.split(".")[1])
    return isinstance(_LAYOUT[index], _TimeUp)


_LAYOUT = _layers()  # the layer kinds by index (for reading weights files)


def load_tiny_decoder(path: str | Path, device: torch.device, dtype: torch.dtype) -> TinyStreamingDecoder:
    """The tiny decoder with the weights of ``path`` (``read_decoder_weights``), on
    ``device`` in ``dtype``."""
    network = TinyDecoder()
    network.load_state_dict(read_decoder_weights(path))
    return TinyStreamingDecoder(network.to(device=device, dtype=dtype).eval().requires_grad_(False), dtype)


def random_tiny_decoder(device: torch.device, dtype: torch.dtype, seed: int = 0) -> TinyStreamingDecoder:
    """The tiny decoder with random weights (the ``tiny`` preset's, for tests):
    each tensor drawn from one generator in the order of its name."""
    network = TinyDecoder()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, tensor in sorted(network.state_dict(keep_vars=True).items()):
            fan_in = max(1, tensor[0].numel()) if tensor.ndim > 1 else WIDTHS[0]
            tensor.copy_(torch.randn(tensor.shape, generator=generator) / fan_in**0.5)
    return TinyStreamingDecoder(network.to(device=device, dtype=dtype).eval().requires_grad_(False), dtype)
