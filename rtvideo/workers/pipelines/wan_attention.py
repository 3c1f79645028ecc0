"""Block-causal self-attention with a KV cache for diffusers' ``WanTransformer3DModel``.

Worker process. No fork of the transformer: two swaps after loading.

- ``OffsetRotaryPosEmbed`` replaces ``model.rope``. Its ``frame_offsets`` (one,
  or one per batch row) shift the temporal positions of the tokens being
  computed, so each chunk sits after the frames in its cache. Its buffers are
  not saved with the weights.
- ``CausalSelfAttnProcessor`` goes on every block's ``attn1``. It computes
  query, key and value as diffusers' ``WanAttnProcessor`` does, then attends
  from the chunk's queries to [cached keys, chunk keys]: a chunk sees itself
  and the frames before it, never after (block-causal). With stream batch,
  [cached keys, provisional keys of the chunks in flight before it, chunk
  keys] (``SessionKVCache.read_provisional``). Cached keys are kept
  un-roped and roped at cache-relative positions 0 .. n-1 by ``RopedKeys``,
  once per layer per cache version: the steps of a chunk and its commit
  forward all read the same cache, so they share one roping.

Per-call settings travel in a ``ForwardContext`` shared by the processors of
one model, because diffusers does not forward ``attention_kwargs`` to them.
The pipeline sets it before each forward (one loop thread, one forward at a
time). A forward may carry several sessions' chunks as batch rows, each with
its own cache (``ForwardContext.caches``, one per row) and its own RoPE
frame offset; rows whose caches hold as many frames attend in one call, the
others one row at a time. Without caches the processors attend within the
call's tokens, with an optional mask (used to build the block-causal
reference in tests).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.transformers.transformer_wan import (
    WanRotaryPosEmbed,
    WanTransformer3DModel,
    _get_qkv_projections,
)

from rtvideo.workers.pipelines.attention_backend import attend
from rtvideo.workers.pipelines.kv_cache import SessionKVCache
from rtvideo.workers.pipelines.wan_block_forward import mark_any_size, rope_into


class RopedKeys:
    """The cached keys of recent cache versions, roped at cache-relative positions.

    One per model, shared by all sessions: it holds the roped keys of the
    ``capacity`` caches read most recently, each for one version, and
    recomputes a layer's only for a cache it does not hold, or a new version
    of one (after a commit or a reset). Between two commits a session runs
    every denoise step and the commit forward of one chunk over the same
    cache, so those forwards rope the cache once instead of once each; with
    batched rows, ``capacity`` is the batch width so the rows do not evict
    each other. Keys of a cache that has moved on to a newer version can never
    be read again and are dropped at the next read, so one session stepping
    at a time holds one session's roped keys. ``forget`` drops a cache's keys
    when its session is released. With ``keep_stale`` (captured chunk steps:
    a graph reads a session's buffers, named by their ``serial``), a cache's
    buffers stay until the ``capacity`` bound drops them, so sessions taking
    turns keep theirs, and their graphs, from chunk to chunk.
    """

    def __init__(self, rope: OffsetRotaryPosEmbed, capacity: int = 1, keep_stale: bool = False) -> None:
        self.rope = rope
        self.rotate = rope_into  # the rotation itself, for these keys and the processors' (``ElementwiseOps.rope``)
        self.capacity = capacity
        self.keep_stale = keep_stale
        self.entries: OrderedDict[int, _RopedEntry] = OrderedDict()  # by cache uid, least recent first

    def get(self, cache: SessionKVCache, layer: int, height: int, width: int) -> torch.Tensor:
        """Layer ``layer``'s held keys of ``cache``, roped at positions 0 .. frames-1:
        the head of ``workspace(...)``."""
        return self.workspace(cache, layer, height, width)[:, : cache.frames * cache.tokens_per_frame]

    def workspace(self, cache: SessionKVCache, layer: int, height: int, width: int) -> torch.Tensor:
        """Layer ``layer``'s roped-key buffer for ``cache``: as many tokens as the
        cache's store, its held keys roped in the head (computed once per cache
        version), the rest free for the chunk being computed. The same tensor for
        a cache from version to version while the cache stays among the
        ``capacity`` most recently read (a captured chunk step reads it there)."""
        entry = self.entries.get(cache.uid)
        if not self.keep_stale:
            for uid in [uid for uid, held in self.entries.items() if uid != cache.uid and held.stale]:
                del self.entries[uid]  # stale: that cache committed or reset since
        if entry is None:
            entry = self.entries[cache.uid] = _RopedEntry(cache, cache.version)
        elif entry.version != cache.version:  # moved on: the same buffers, roped afresh
            entry.version, entry.filled, entry.cos_sin = cache.version, set(), None
        self.entries.move_to_end(cache.uid)
        while len(self.entries) > self.capacity:
            self.entries.popitem(last=False)
        buffer = entry.buffers.get(layer)
        if buffer is None:
            store = cache.keys[layer]
            buffer = entry.buffers[layer] = torch.empty_like(store)
        if layer not in entry.filled:
            if cache.frames:
                if entry.cos_sin is None:
                    entry.cos_sin = self.rope.at(cache.frames, height, width, 0)
                held_keys, _ = cache.read(layer)
                self.rotate(held_keys, *entry.cos_sin, buffer[:, : held_keys.shape[1]])
            entry.filled.add(layer)
        return buffer

    def rotated(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """``x`` (queries or keys) roped by ``rotate`` into a new tensor."""
        return self.rotate(x, *cos_sin, torch.empty_like(x))

    def refresh(self, cache: SessionKVCache, height: int, width: int) -> int:
        """Rope every layer's held keys of ``cache`` for its current version now
        (once per version, as a read would); returns the serial of its buffers,
        which stays the same while they do (a captured step reads them)."""
        for layer in cache.layers:
            self.workspace(cache, layer, height, width)
        return self.entries[cache.uid].serial

    def forget(self, cache: SessionKVCache) -> _RopedEntry | None:
        """Drop what is held for ``cache`` (its session is being released);
        returns it (None when nothing was), to be ``adopt``ed again with the
        cache (a released session's cache kept for the next session)."""
        return self.entries.pop(cache.uid, None)

    def adopt(self, entry: _RopedEntry) -> None:
        """Hold ``entry`` (what ``forget`` gave back) for its cache again: the
        same buffers, so the same ``serial``; roped afresh at its next read."""
        entry.version, entry.filled, entry.cos_sin = -1, set(), None
        self.entries[entry.cache.uid] = entry
        self.entries.move_to_end(entry.cache.uid)
        while len(self.entries) > self.capacity:
            self.entries.popitem(last=False)


_serials = itertools.count()


@dataclass
class _RopedEntry:
    cache: SessionKVCache
    version: int  # the cache version the filled layers were roped from
    buffers: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> roped keys, then room for a chunk
    filled: set[int] = field(default_factory=set)  # layers whose held keys are roped for ``version``
    cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None
    serial: int = field(default_factory=lambda: next(_serials))  # names these buffers for their lifetime

    def nbytes(self) -> int:
        return sum(buffer.numel() * buffer.element_size() for buffer in self.buffers.values())

    @property
    def stale(self) -> bool:
        """The cache has committed or reset since: these keys can never be read again."""
        return self.version != self.cache.version


@dataclass
class ForwardContext:
    """What the processors of one model need for the current forward."""

    roped: RopedKeys
    caches: tuple[SessionKVCache, ...] = ()  # one per batch row: the sessions whose chunks are computed
    chunks: tuple[int, ...] = ()  # one per batch row: the index of the chunk it computes
    provisional: tuple[bool, ...] = ()  # per batch row: keep its keys and values provisionally (stream batch)
    commit: bool = False  # stage this forward's keys and values, each row's into its own cache
    staged: tuple[bool, ...] = ()  # per batch row: stage its keys and values as its chunk's (commit from last step)
    grid: tuple[int, int] = (0, 0)  # the call's latent height and width (for the cache's RoPE)
    mask: torch.Tensor | None = None  # boolean [tokens, tokens], True = may attend (no-cache calls only)


class OffsetRotaryPosEmbed(WanRotaryPosEmbed):
    """Wan's 3-D RoPE with the temporal positions shifted by ``frame_offsets``:
    one offset for every row, or one per batch row."""

    frame_offsets: tuple[int, ...] = (0,)

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        frames, height, width = hidden_states.shape[2:]
        if len(set(self.frame_offsets)) == 1:
            return self.at(frames, height, width, self.frame_offsets[0])
        if len(self.frame_offsets) != hidden_states.shape[0]:
            raise ValueError(f"{len(self.frame_offsets)} frame offsets for {hidden_states.shape[0]} rows")
        tables = [self.at(frames, height, width, offset) for offset in self.frame_offsets]
        return torch.cat([cos for cos, _ in tables]), torch.cat([sin for _, sin in tables])

    def at(self, frames: int, height: int, width: int, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[1, tokens, 1, head_dim]`` for ``frames`` latent frames from ``offset``."""
        p_t, p_h, p_w = self.patch_size
        ppf, pph, ppw = frames // p_t, height // p_h, width // p_w
        if offset + ppf > self.max_seq_len:
            raise ValueError(f"frame position {offset + ppf} is past the RoPE table ({self.max_seq_len})")
        sizes = [self.t_dim, self.h_dim, self.w_dim]
        parts = []
        for table in (self.freqs_cos, self.freqs_sin):
            t, h, w = table.split(sizes, dim=1)
            grid = torch.cat(
                [
                    t[offset : offset + ppf].view(ppf, 1, 1, -1).expand(ppf, pph, ppw, -1),
                    h[:pph].view(1, pph, 1, -1).expand(ppf, pph, ppw, -1),
                    w[:ppw].view(1, 1, ppw, -1).expand(ppf, pph, ppw, -1),
                ],
                dim=-1,
            )
            parts.append(grid.reshape(1, ppf * pph * ppw, 1, -1))
        return parts[0], parts[1]


class CausalSelfAttnProcessor:
    """``attn1`` of block ``layer``: attends over the session's cache and the chunk."""

    _attention_backend = None  # diffusers' backend: None, torch's choice
    kernel = None  # the option ``attention``: one of torch's kernels, called directly (``attention_backend``)
    _parallel_config = None

    def __init__(self, context: ForwardContext, layer: int) -> None:
        self.context = context
        self.layer = layer

    @torch.compiler.disable  # per-session Python state (caches, offsets): always eager, even in a compiled block
    def __call__(
        self,
        attn,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        ctx = self.context
        query, key, value = _get_qkv_projections(attn, hidden_states, None)
        query = attn.norm_q(query).unflatten(2, (attn.heads, -1))
        key = attn.norm_k(key).unflatten(2, (attn.heads, -1))
        value = value.unflatten(2, (attn.heads, -1))
        if not ctx.caches:
            if rotary_emb is not None:
                query, key = ctx.roped.rotated(query, rotary_emb), ctx.roped.rotated(key, rotary_emb)
            return self._out(attn, self._attend(query, key, value, ctx.mask))
        if ctx.commit:
            if len(ctx.caches) == 1:
                ctx.caches[0].stage(self.layer, key, value)
            else:  # a batched commit: each row into its own session's cache
                for row, cache in enumerate(ctx.caches):
                    cache.stage(self.layer, key[row : row + 1], value[row : row + 1])
        rows = len(ctx.caches)
        for row, keep in enumerate(ctx.staged):
            if keep:  # this denoise pass's keys and values are what the chunk's commit will write
                row_key, row_value = key[row : row + 1], value[row : row + 1]
                if rows > 1:
                    row_key, row_value = row_key.clone(), row_value.clone()
                ctx.caches[row].stage(self.layer, row_key, row_value)
        for row, keep in enumerate(ctx.provisional):
            if keep:
                row_key, row_value = key[row : row + 1], value[row : row + 1]
                if rows > 1:  # not a view that would hold the whole batch's keys
                    row_key, row_value = row_key.clone(), row_value.clone()
                ctx.caches[row].stage_provisional(ctx.chunks[row], self.layer, row_key, row_value)
        query = ctx.roped.rotated(query, rotary_emb)
        if rows == 1 and (spans := self._spans(key, value, rotary_emb)) is not None:
            return self._out(attn, self._attend(query, *spans, None))
        key = ctx.roped.rotated(key, rotary_emb)
        keys, values = [], []
        for row, cache in enumerate(ctx.caches):
            row_keys, row_values = [], []
            if cache.frames:
                _, held_values = cache.read(self.layer)
                row_keys.append(ctx.roped.get(cache, self.layer, *ctx.grid))
                row_values.append(held_values)
            pending = cache.read_provisional(ctx.chunks[row], self.layer) if ctx.chunks else None
            if pending is not None:
                pending_keys, pending_values = pending
                frames = pending_keys.shape[1] // cache.tokens_per_frame
                row_keys.append(ctx.roped.rotated(pending_keys, ctx.roped.rope.at(frames, *ctx.grid, cache.frames)))
                row_values.append(pending_values)
            row_key, row_value = key[row : row + 1], value[row : row + 1]
            if row_keys:
                row_key = torch.cat([*row_keys, row_key], dim=1)
                row_value = torch.cat([*row_values, row_value], dim=1)
            keys.append(row_key)
            values.append(row_value)
        if len({k.shape[1] for k in keys}) == 1:  # equal lengths: one call for every row
            out = self._attend(query, torch.cat(keys), torch.cat(values), None)
        else:
            rows = zip(keys, values, strict=True)
            out = torch.cat([self._attend(query[r : r + 1], k, v, None) for r, (k, v) in enumerate(rows)])
        return self._out(attn, out)

    def _spans(
        self, key: torch.Tensor, value: torch.Tensor, rotary_emb: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """One row over a cache that holds frames and no chunk in flight before it:
        [held, chunk] keys and values as spans of the cache's buffers, the chunk's
        (roped) keys and its values written in place after the held ones (the
        same values a concatenation makes, without the copy of the whole cache
        per layer per forward, at addresses that stay put). None: concatenate."""
        ctx = self.context
        cache = ctx.caches[0]
        if not cache.frames or (ctx.chunks and cache.read_provisional(ctx.chunks[0], self.layer) is not None):
            return None
        values = cache.values_with(self.layer, value)
        if values is None:
            return None
        keys = ctx.roped.workspace(cache, self.layer, *ctx.grid)[:, : values.shape[1]]
        ctx.roped.rotate(key, *rotary_emb, keys[:, cache.frames * cache.tokens_per_frame :])
        return keys, values

    def _attend(self, query, key, value, mask) -> torch.Tensor:
        if self.kernel is not None and mask is None:
            return attend(self.kernel, query, key, value).flatten(2, 3).type_as(query)
        out = dispatch_attention_fn(
            query,
            key,
            value,
            attn_mask=mask,
            dropout_p=0.0,
            is_causal=False,
            backend=self._attention_backend,
            parallel_config=None,
        )
        return out.flatten(2, 3).type_as(query)

    @staticmethod
    def _out(attn, out: torch.Tensor) -> torch.Tensor:
        """The output projection. Its rows and tokens are marked dynamic: a
        compiled block (the option ``compile``) resumes from this eager call
        with it, and so compiles that part once for every session size."""
        out = attn.to_out[1](attn.to_out[0](out))
        mark_any_size(out, 0, 1)
        return out


def make_causal(model: WanTransformer3DModel, rows: int = 1) -> ForwardContext:
    """Swap in the offset RoPE and the causal processors, for forwards of up to
    ``rows`` batch rows; returns their shared context."""
    old = model.rope
    rope = OffsetRotaryPosEmbed(old.attention_head_dim, old.patch_size, old.max_seq_len)
    model.rope = rope.to(old.freqs_cos.device)
    context = ForwardContext(roped=RopedKeys(model.rope, capacity=rows))
    for layer, block in enumerate(model.blocks):
        block.attn1.set_processor(CausalSelfAttnProcessor(context, layer))
    return context
