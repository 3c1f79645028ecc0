"""A chunk's latent frames through Wan's decoder in one pass
(``workers.pipelines.vae_stream._PassChoice``): only where that gives the
frames and the cache of a frame at a time bit for bit, each shape decided
once, and whatever was decided a chunk decodes to a frame at a time's bits."""

from __future__ import annotations

import pytest
import torch
from diffusers import AutoencoderKLWan

from workers.pipelines import vae_stream
from workers.pipelines.base import Abandoned, abandon_when
from workers.pipelines.presets import TINY_VAE
from workers.pipelines.vae_stream import CPU_PASS_BYTES, StreamingDecoder


def tiny_decoder() -> StreamingDecoder:
    """A fresh decoder (nothing decided yet) on the tiny preset's VAE."""
    torch.manual_seed(0)
    return StreamingDecoder(AutoencoderKLWan(**TINY_VAE).eval())


def streams(rows: int, side: int, frames: int = 9, seed: int = 4) -> list[torch.Tensor]:
    torch.manual_seed(seed)
    return [torch.randn(1, 16, frames, side, side) for _ in range(rows)]


CHUNKS = [(slice(0, 3), True), (slice(3, 6), False), (slice(6, 9), False)]


def frame_at_a_time(decoder: StreamingDecoder, latents: torch.Tensor, cache: list, first: bool) -> torch.Tensor:
    """``decode``'s frames the way the split decode computes them: a latent frame a pass."""
    with torch.no_grad():
        x = decoder.vae.post_quant_conv(decoder._unnormalised(latents))
        return torch.clamp(decoder.frame_by_frame(x, cache, first=first), -1.0, 1.0)


@pytest.mark.parametrize("side", [4, 8])  # 32x32 (where the pass rounds differently) and 64x64 frames
def test_whatever_was_decided_a_chunk_decodes_to_the_bits_of_a_frame_at_a_time(side):
    """Chunk after chunk, one stream and a batch of two: ``decode`` and
    ``decode_rows`` give the frames a frame at a time gives."""
    decoder = tiny_decoder()
    rows = streams(2, side)
    one, batch = decoder.new_cache(), [decoder.new_cache() for _ in rows]
    plain_one, plain_batch = decoder.new_cache(), [decoder.new_cache() for _ in rows]
    for piece, first in CHUNKS:
        got = decoder.decode(rows[0][:, :, piece], one, first)
        assert torch.equal(got, frame_at_a_time(decoder, rows[0][:, :, piece], plain_one, first))
        got_rows = decoder.decode_rows([r[:, :, piece] for r in rows], batch, first)
        for latents, cache, row in zip(rows, plain_batch, got_rows, strict=True):
            assert torch.equal(row, frame_at_a_time(decoder, latents[:, :, piece], cache, first))
    # the stream's first frame went alone; its chunk's other two frames, and later chunks' three, were decided
    decided = {shape[:3] for shape, _ in decoder._passes.one_pass}
    assert decided == {(1, 16, 2), (1, 16, 3), (2, 16, 2), (2, 16, 3)}


def test_a_pass_that_rounds_differently_is_tried_once_and_never_used(monkeypatch):
    decoder = tiny_decoder()
    real = decoder.one_pass
    calls = []

    def off_by_a_little(x, cache):
        calls.append(tuple(x.shape))
        return real(x, cache) + 1e-3

    monkeypatch.setattr(decoder, "one_pass", off_by_a_little)
    (latents,) = streams(1, 8)
    cache, plain = decoder.new_cache(), decoder.new_cache()
    for piece, first in CHUNKS:
        assert torch.equal(
            decoder.decode(latents[:, :, piece], cache, first),
            frame_at_a_time(decoder, latents[:, :, piece], plain, first),
        )
    assert sorted(calls) == [(1, 16, 2, 8, 8), (1, 16, 3, 8, 8)]  # the check, once per shape
    assert not any(decoder._passes.one_pass.values())


def test_an_exact_faster_pass_is_kept_and_used_without_deciding_again(monkeypatch):
    """With the timings made to favour the pass, the shape is decided for it
    once, and later chunks of that shape take one call each."""
    decoder = tiny_decoder()
    timings = iter([0.001, 0.002] * 4)  # pass, then frame at a time, per decision
    monkeypatch.setattr(vae_stream, "best_of_two", lambda call: next(timings))
    real_pass, real_frames = decoder.one_pass, decoder.frame_by_frame
    calls = {"pass": 0, "frames": 0}

    def counted_pass(x, cache):
        calls["pass"] += 1
        return real_pass(x, cache)

    def counted_frames(x, cache, first=False):
        calls["frames"] += 1
        return real_frames(x, cache, first)

    monkeypatch.setattr(decoder, "one_pass", counted_pass)
    monkeypatch.setattr(decoder, "frame_by_frame", counted_frames)
    (latents,) = streams(1, 8)
    cache = decoder.new_cache()
    decoder.decode(latents[:, :, 0:3], cache, True)  # first frame alone; the other two: the decision
    decoder.decode(latents[:, :, 3:6], cache, False)  # three frames: the decision
    assert decoder._passes.one_pass == {
        ((1, 16, 2, 8, 8), torch.float32): True,
        ((1, 16, 3, 8, 8), torch.float32): True,
    }
    calls.update(dict.fromkeys(calls, 0))
    decoder.decode(latents[:, :, 6:9], cache, False)
    assert calls == {"pass": 1, "frames": 0}


def test_passes_too_large_for_the_cpus_caches_are_not_tried(monkeypatch):
    decoder = tiny_decoder()
    tried = []
    monkeypatch.setattr(decoder, "one_pass", lambda x, cache: tried.append(x.shape))
    side = 8
    (latents,) = streams(1, side, frames=3)
    x = decoder.vae.post_quant_conv(latents)
    monkeypatch.setattr(vae_stream, "CPU_PASS_BYTES", decoder._passes._bytes(x) - 1)
    assert decoder._passes._bytes(x) <= CPU_PASS_BYTES  # the real cap would have tried this one
    decoder.decode(latents, decoder.new_cache(), False)
    assert tried == []
    assert decoder._passes.one_pass == {((1, 16, 3, side, side), torch.float32): False}


def test_a_decision_abandoned_part_way_leaves_the_cache_as_it_was_and_decides_nothing():
    decoder = tiny_decoder()
    (latents,) = streams(1, 8)
    cache = decoder.new_cache()
    decoder.decode(latents[:, :, 0:1], cache, True)
    before = list(cache)
    stops = iter([False] * 3 + [True] * 1000)  # a few stop points in, then stop
    with pytest.raises(Abandoned), abandon_when(lambda: next(stops)):
        decoder.decode(latents[:, :, 1:4], cache, False)
    assert all(a is b for a, b in zip(cache, before, strict=True))
    assert decoder._passes.one_pass == {}
