"""Attention over [held, chunk] as spans of the cache's own buffers (tiny preset, CPU).

A single-row forward over a cache that holds frames writes its chunk's roped
keys and its values in place after the held ones (``CausalSelfAttnProcessor._spans``)
instead of concatenating a copy of the whole cache per layer per forward.
The values are the same, so the frames must be the same bit for bit, through
the window filling, evicting, a re-cache and a reset.
"""

from __future__ import annotations

import pytest
import torch

from rtvideo.workers.pipelines.causal_wan import build
from rtvideo.workers.pipelines.kv_cache import SessionKVCache
from rtvideo.workers.pipelines.wan_attention import CausalSelfAttnProcessor

from .test_causal_wan import open_session, release, run_chunk


@pytest.fixture(scope="module")
def pipeline():
    return build("tiny", device="cpu", warm_up_chunks=0, sink_frames=3, window_frames=6)


def _stream(pipeline, sid: str, prompt_change: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Six chunks (the window fills at the second, then evicts), a new prompt at
    the fifth: every chunk's frames and clean latent, and the cache's stores."""
    state = open_session(pipeline, sid, seed=5, prompt_change=prompt_change, width=32, height=32)
    outputs = []
    for chunk in range(6):
        frames, clean = run_chunk(pipeline, state, prompt="a blue heron" if chunk == 4 else None)
        outputs += [torch.frombuffer(bytearray(frames.payload), dtype=torch.uint8), clean]
    stores = [t.clone() for layer in state.kv.layers for t in state.kv.read(layer)]
    release(pipeline, state)
    return outputs, stores


@pytest.mark.parametrize("prompt_change", ["soft", "recache", "reset"])
def test_spans_make_the_concatenated_frames_bit_for_bit(pipeline, monkeypatch, prompt_change):
    taken = []
    real = CausalSelfAttnProcessor._spans
    monkeypatch.setattr(CausalSelfAttnProcessor, "_spans", lambda self, *a: taken.append(r := real(self, *a)) or r)
    spans, spans_stores = _stream(pipeline, f"spans-{prompt_change}", prompt_change)
    assert any(r is not None for r in taken), "the span path never ran"
    monkeypatch.setattr(CausalSelfAttnProcessor, "_spans", lambda self, *a: None)
    concatenated, stores = _stream(pipeline, f"cat-{prompt_change}", prompt_change)
    assert all(torch.equal(a, b) for a, b in zip(spans, concatenated, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(spans_stores, stores, strict=True))


def test_a_sessions_key_buffers_keep_their_address_from_chunk_to_chunk(pipeline):
    """What a captured step relies on: the roped-key buffers and the value store
    of a session stay put while it streams, and go when it is released."""
    state = open_session(pipeline, "address", width=32, height=32)
    roped = pipeline.context.roped
    addresses = set()
    for _ in range(4):
        run_chunk(pipeline, state)
        serial = roped.refresh(state.kv, 4, 4)
        addresses.add((serial, roped.workspace(state.kv, 0, 4, 4).data_ptr(), state.kv.values[0].data_ptr()))
    assert len(addresses) == 1
    release(pipeline, state)
    assert state.kv.uid not in roped.entries


def _cache(tail_frames: int, batch: int = 1) -> SessionKVCache:
    return SessionKVCache(
        layers=1, sink_frames=1, window_frames=2, tokens_per_frame=2, heads=1, head_dim=2,
        batch=batch, dtype=torch.float32, device=torch.device("cpu"), tail_frames=tail_frames,
    )  # fmt: skip


def _commit(cache: SessionKVCache, value: float) -> None:
    chunk = torch.full((1, 2, 1, 2), value)
    cache.stage(0, chunk, chunk)
    cache.commit(1)


def test_values_with_writes_the_chunk_after_the_held_frames_and_a_commit_overwrites_it():
    cache = _cache(tail_frames=1)
    for value in (1.0, 2.0, 3.0):
        _commit(cache, value)  # full: sink 1, window 2 and 3
    chunk = torch.full((1, 2, 1, 2), 9.0)
    span = cache.values_with(0, chunk)
    assert span.shape[1] == 8 and span[0, :, 0, 0].tolist() == [1, 1, 2, 2, 3, 3, 9, 9]
    assert cache.read(0)[1][0, :, 0, 0].tolist() == [1, 1, 2, 2, 3, 3]  # what is held is untouched
    _commit(cache, 4.0)  # evicts 2: sink 1, window 3 and 4
    assert cache.read(0)[1][0, :, 0, 0].tolist() == [1, 1, 3, 3, 4, 4]


def test_values_with_declines_what_does_not_fit_one_span():
    full = _cache(tail_frames=0)
    for value in (1.0, 2.0, 3.0):
        _commit(full, value)
    assert full.values_with(0, torch.zeros(1, 2, 1, 2)) is None  # no tail while full
    assert _cache(tail_frames=1, batch=2).values_with(0, torch.zeros(1, 2, 1, 2)) is None  # two rows
    assert _cache(tail_frames=1).values_with(0, torch.zeros(1, 4, 1, 2)) is not None  # empty: room in the window
    with pytest.raises(ValueError, match="tail_frames"):
        _cache(tail_frames=-1)


def test_a_chunk_staged_from_the_tail_of_a_full_cache_commits_as_a_chunk_staged_from_outside():
    """What a captured commit pass does: it writes the chunk's keys and values
    after the held frames (``tail``) and stages those views; the window's shift
    must not overwrite them before they are written in."""
    from_tail, staged = _cache(tail_frames=1), _cache(tail_frames=1)
    for value in (1.0, 2.0, 3.0):
        _commit(from_tail, value)
        _commit(staged, value)
    keys, values = from_tail.tail(0, 2)
    keys.fill_(8.0)
    values.fill_(9.0)
    from_tail.stage(0, keys, values)
    from_tail.commit(1)
    staged.stage(0, torch.full((1, 2, 1, 2), 8.0), torch.full((1, 2, 1, 2), 9.0))
    staged.commit(1)
    assert [t[0, :, 0, 0].tolist() for t in from_tail.read(0)] == [[1, 1, 3, 3, 8, 8], [1, 1, 3, 3, 9, 9]]
    assert all(torch.equal(a, b) for a, b in zip(from_tail.read(0), staged.read(0), strict=True))
    with pytest.raises(ValueError, match=r"4 tokens after 3 held frames overrun the store's 8 \(tail_frames 1\)"):
        from_tail.tail(0, 4)
