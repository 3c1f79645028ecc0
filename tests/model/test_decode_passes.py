"""A chunk's latent frames through Wan's decoder in one pass
(``rtvideo.workers.pipelines.vae_stream._PassChoice``): only where that gives the
frames and the cache of a frame at a time bit for bit, kept only where it
was the faster in its trial, each shape decided once, and whatever was
decided (or while on trial) a chunk decodes to a frame at a time's bits."""

from __future__ import annotations

import pytest
import torch
from diffusers import AutoencoderKLWan

from rtvideo.workers.pipelines import vae_stream
from rtvideo.workers.pipelines.base import Abandoned, abandon_when
from rtvideo.workers.pipelines.presets import TINY_VAE
from rtvideo.workers.pipelines.vae_stream import CPU_PASS_BYTES, StreamingDecoder


def tiny_decoder() -> StreamingDecoder:
    """A fresh decoder (nothing decided yet) on the tiny preset's VAE."""
    torch.manual_seed(0)
    return StreamingDecoder(AutoencoderKLWan(**TINY_VAE).eval())


def streams(rows: int, side: int, frames: int = 21, seed: int = 4) -> list[torch.Tensor]:
    torch.manual_seed(seed)
    return [torch.randn(1, 16, frames, side, side) for _ in range(rows)]


# the stream's first chunk, one that checks the three-frame shape, TRIALS x 2 on trial, two after the decision
CHUNKS = [(slice(0, 3), True)] + [(slice(start, start + 3), False) for start in range(3, 21, 3)]


def frame_at_a_time(decoder: StreamingDecoder, latents: torch.Tensor, cache: list, first: bool) -> torch.Tensor:
    """``decode``'s frames the way the split decode computes them: a latent frame a pass."""
    with torch.no_grad():
        x = decoder.vae.post_quant_conv(decoder._unnormalised(latents))
        return torch.clamp(decoder.frame_by_frame(x, cache, first=first), -1.0, 1.0)


@pytest.mark.parametrize("side", [4, 8])  # 32x32 (where the pass rounds differently) and 64x64 frames
def test_whatever_was_decided_a_chunk_decodes_to_the_bits_of_a_frame_at_a_time(side):
    """Chunk after chunk, one stream and a batch of two: ``decode`` and
    ``decode_rows`` give the frames a frame at a time gives, through the
    check, the trial and after the decision."""
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
    # the stream's first frame went alone; the three-frame shape was checked, tried and decided
    decided = {shape[:3] for shape, _ in decoder._passes.one_pass}
    assert decided == {(1, 16, 3), (2, 16, 3)} | {(1, 16, 2), (2, 16, 2)} - {
        shape[:3] for shape, _ in decoder._passes.trials
    }  # the two-frame shape (the first chunk's) comes once: checked, and on trial if exact
    assert all(len(seconds) <= 1 for trial in decoder._passes.trials.values() for seconds in trial.values())


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
    assert decoder._passes.trials == {}
    assert not any(decoder._passes.one_pass.values())


@pytest.mark.parametrize(("pass_s", "frames_s", "kept"), [(0.001, 0.002, True), (0.003, 0.002, False)])
def test_an_exact_pass_is_tried_in_turn_with_a_frame_at_a_time_and_the_faster_kept(monkeypatch, pass_s, frames_s, kept):
    """Checked once (a frame at a time kept, the pass on a copy of the cache),
    then each of the next chunks of that shape decoded once, the pass and a
    frame at a time in turn, ``TRIALS`` each; the faster decides, and later
    chunks take it without timing. A clock the forms advance makes the pass
    the faster, or a frame at a time."""
    decoder = tiny_decoder()
    now = [0.0]
    decoder._passes._clock = lambda: now[0]
    real_pass, real_frames = decoder.one_pass, decoder.frame_by_frame
    calls = []

    def timed_pass(x, cache):
        calls.append("pass")
        now[0] += pass_s
        return real_pass(x, cache)

    def timed_frames(x, cache, first=False):
        calls.append("frames")
        now[0] += frames_s
        return real_frames(x, cache, first)

    monkeypatch.setattr(decoder, "one_pass", timed_pass)
    monkeypatch.setattr(decoder, "frame_by_frame", timed_frames)
    (latents,) = streams(1, 8)
    cache = decoder.new_cache()
    decoder.decode(latents[:, :, 0:1], cache, True)
    calls.clear()
    decoder.decode(latents[:, :, 1:4], cache, False)
    assert calls == ["frames", "pass"]  # the check
    key = ((1, 16, 3, 8, 8), torch.float32)
    assert decoder._passes.trials == {key: {True: [], False: []}}
    for chunk in range(2 * vae_stream.TRIALS):
        calls.clear()
        decoder.decode(latents[:, :, 4 + 3 * chunk : 7 + 3 * chunk], cache, False)
        assert calls == ["pass" if chunk % 2 == 0 else "frames"]
    assert decoder._passes.one_pass == {key: kept} and decoder._passes.trials == {}
    calls.clear()
    decoder.decode(latents[:, :, 16:19], cache, False)
    assert calls == ["pass" if kept else "frames"]


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
