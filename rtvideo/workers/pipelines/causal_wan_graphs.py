"""The causal Wan pipeline's captured steps: which forwards go through
``StepGraphs``, and the caches kept so that their graphs outlive a session.

Worker process. ``CapturedSteps`` is the part of ``CausalWanPipeline`` that
routes a forward with static shapes and buffers through the pipeline's
``step_graphs`` (``rtvideo.workers.pipelines.step_graphs``: a CUDA graph captured on
a key's second use and replayed, or with ``cuda_graphs: "eager"`` the same
static-buffer path run eagerly) instead of running it eagerly:

- ``_capturable`` / ``_captured_step``: a denoise forward of one row or of
  several (sessions of one size batched), every block on this rank, every
  row's window full (the span attended and the RoPE positions fixed), no
  chunk in flight before another (stream batch) and nothing staged for a
  commit (the last step under ``commit_from_last_step``). The held keys are
  roped for each cache's version before the replay (the graph reads them and
  does not rope them); latents, timesteps and texts are copied in, the
  predictions copied out. The rows go in by cache, so the same sessions
  batched in another order replay the same graph.
- ``_commit_capturable`` / ``_captured_commits``: the commit pass of one
  chunk, or of one chunk each of several sessions (``commit_batch``), under
  the same conditions (and not ``commit_from_last_step``, which has no
  pass), under its own key (``kind="commit"``). The graph computes every
  layer's keys and values of the clean chunks and writes them into each
  cache's stores after the frames held (the chunk's room in a full window:
  no output of its own to pin); committing them from there (the window's
  shift, the caches' counts) runs eagerly after the replay, as the eager
  commit writes them.

Everything else runs eagerly; the frames are the same either way (bit for
bit on a CPU, where the replay is eager: ``tests/model/test_captured_step_graphs.py``).

A graph holds the addresses of its session's KV stores and roped-key
buffers (a batch's graph, those of each of its rows). So that the graphs
outlive the session, a released session's cache and its roped-key buffers
go to ``KeptCaches`` (``kept_caches`` of them at
most, and at most that many caches of the default size in bytes), and the
next session of the same layout (size, layers, dtype) takes them over
(``_session_cache``: recycled, holding nothing; same addresses, so the same
keys and graphs). The graphs of a cache let go for good are forgotten. The
memory budget reserves what the kept caches may still take (``kept_room``):
admission counts a session's own cache in its ``state_bytes``, and an idle
kept cache in that reservation. ``capture_chunks``: the chunks a session of
one row runs before both of its graphs are captured (the warm-up runs them
at the default size, ``rtvideo.workers.warmup``, so the first session of that size
replays from its first full-window chunk).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from rtvideo.workers.pipelines.base import StepBatch, abandon_point
from rtvideo.workers.pipelines.causal_wan_state import CausalWanChunk, CausalWanSession
from rtvideo.workers.pipelines.kv_cache import SessionKVCache
from rtvideo.workers.pipelines.step_graphs import StepGraphs, StepKey

if TYPE_CHECKING:
    from rtvideo.workers.pipelines.wan_attention import ForwardContext, _RopedEntry


@dataclass
class _Kept:
    cache: SessionKVCache
    roped: _RopedEntry
    nbytes: int


class KeptCaches:
    """Released sessions' KV caches with their roped-key buffers, for the next
    session of the same layout: at most ``most`` caches and ``most_bytes``
    bytes (a cache that does not fit alone is not kept; otherwise the least
    recently kept go first). ``take`` hands out the most recently kept."""

    def __init__(self, most: int, most_bytes: int) -> None:
        if most < 0 or most_bytes < 0:
            raise ValueError(f"need most >= 0 and most_bytes >= 0, got {most} and {most_bytes}")
        self.most, self.most_bytes = most, most_bytes
        self.kept: list[_Kept] = []  # least recently kept first
        self.taken = 0  # caches taken over by a new session since start

    @property
    def nbytes(self) -> int:
        return sum(kept.nbytes for kept in self.kept)

    def room(self) -> int:
        """The bytes the kept caches may still take beyond what they hold."""
        return max(0, self.most_bytes - self.nbytes)

    def put(self, cache: SessionKVCache, roped: _RopedEntry) -> list[SessionKVCache]:
        """Keep ``cache`` and its roped keys; returns the caches let go for good
        (``cache`` itself when it does not fit, else the oldest kept to make room)."""
        kept = _Kept(cache, roped, cache.nbytes() + roped.nbytes())
        if self.most == 0 or kept.nbytes > self.most_bytes:
            return [cache]
        self.kept.append(kept)
        gone = []
        while len(self.kept) > self.most or self.nbytes > self.most_bytes:
            gone.append(self.kept.pop(0).cache)
        return gone

    def take(self, layout: tuple) -> tuple[SessionKVCache, _RopedEntry] | None:
        """The most recently kept cache of ``layout`` (``SessionKVCache.layout``), no longer kept; None: none."""
        for index in range(len(self.kept) - 1, -1, -1):
            if self.kept[index].cache.layout == layout:
                kept = self.kept.pop(index)
                self.taken += 1
                return kept.cache, kept.roped
        return None

    def figures(self) -> dict[str, int]:
        return {"kept_caches": len(self.kept), "kept_bytes": self.nbytes, "caches_taken_over": self.taken}


class CapturedSteps:
    """Needs ``step_graphs`` (None: every forward eager), ``kept`` (None: no
    cache kept), ``context`` (the attention's ``ForwardContext``),
    ``num_blocks``, ``split``, ``dtype``, ``device``, ``commit_from_last_step``,
    the span (``sink_frames``, ``window_frames``, ``latent_frames``),
    ``_t_zero``, ``_run``, ``_embed`` and ``_blocks`` of the pipeline."""

    step_graphs: StepGraphs | None
    kept: KeptCaches | None
    context: ForwardContext
    num_blocks: int
    split: bool
    dtype: torch.dtype
    device: torch.device
    commit_from_last_step: bool
    sink_frames: int
    window_frames: int
    latent_frames: int
    _t_zero: torch.Tensor
    _run: Callable[..., torch.Tensor]
    _embed: Callable[..., Any]
    _blocks: Callable[..., Any]

    # -- routing ---------------------------------------------------------------------

    def _steady(self, sessions: Sequence[CausalWanSession], blocks: range) -> bool:
        """Whether a pass over ``sessions`` (one row each) has static shapes and
        buffers: captured steps, every block on this one rank, one latent shape,
        every window full, no chunk in flight before another (stream batch), and
        no more rows than the roped keys hold at once (each row's buffers stay)."""
        if self.step_graphs is None or self.split or blocks != range(self.num_blocks):
            return False
        if len(sessions) > self.context.roped.capacity or len({s.latent_shape for s in sessions}) != 1:
            return False
        return all(s.kv.frames == s.kv.capacity and s.lookahead == 1 for s in sessions)

    def _capturable(self, batch: StepBatch, sessions: Sequence[CausalWanSession], blocks: range) -> bool:
        """Whether this denoise forward goes through the captured steps (the
        module's docstring): ``_steady``, and no row's last step staging its
        keys and values for the commit (``commit_from_last_step``). The window
        filling, sessions of several sizes, pipeline ranks and stream batch run
        eagerly."""
        if not self._steady(sessions, blocks):
            return False
        last = [len(s.timesteps) - 1 for s in sessions]
        return not (self.commit_from_last_step and any(r.step == n for r, n in zip(batch.rows, last, strict=True)))

    def _captured_step(self, batch: StepBatch, sessions: Sequence[CausalWanSession]) -> list[torch.Tensor]:
        """The rows' denoise forward through ``step_graphs``, one prediction per
        row in the batch's order. The rows go in by cache (the same sessions
        batched in any order are one key). The replay has no block boundaries:
        a stop is checked once, before it."""
        order = sorted(range(len(sessions)), key=lambda i: sessions[i].kv.uid)
        ordered = [sessions[i] for i in order]
        chunks = [sessions[i].chunk_at(batch.rows[i]) for i in order]
        steps = [batch.rows[i].step for i in order]
        inputs = {
            "latent": torch.cat([chunk.latent for chunk in chunks]),
            "timestep": torch.cat([s.schedule[step : step + 1] for s, step in zip(ordered, steps, strict=True)]),
            "text": torch.cat([chunk.conditioning for chunk in chunks]),
        }
        caches = tuple(s.kv for s in ordered)
        out = self._through_graphs(
            ordered, "denoise", inputs, lambda x: self._run(caches, x["latent"], x["timestep"], x["text"])
        )
        predictions: list[torch.Tensor] = [None] * len(sessions)  # type: ignore[list-item]
        for i, prediction in zip(order, out.split(1), strict=True):
            predictions[i] = prediction
        return predictions

    def _commit_capturable(self, sessions: Sequence[CausalWanSession], blocks: range) -> bool:
        """Whether these sessions' commit pass goes through the captured steps:
        ``_steady``, and a pass to run (not ``commit_from_last_step``)."""
        return not self.commit_from_last_step and self._steady(sessions, blocks)

    def _captured_commits(
        self, sessions: Sequence[CausalWanSession], chunk_indices: Sequence[int], chunks: Sequence[CausalWanChunk]
    ) -> None:
        """The chunks' commit pass (one chunk of each session) through
        ``step_graphs``. The graph writes every layer's keys and values into
        each session's stores, after the frames held (``SessionKVCache.tail``:
        a full window's cache has a chunk's room there), and they are staged
        from there: the graph holds no output, so a commit graph pins no
        memory of its own. The caller commits them (``_take_staged``)."""
        order = sorted(range(len(sessions)), key=lambda i: sessions[i].kv.uid)
        caches = tuple(sessions[i].kv for i in order)
        at = tuple(chunk_indices[i] for i in order)

        def commit_pass(x: Mapping[str, torch.Tensor]) -> tuple[()]:
            activations = self._embed(caches, x["latent"], self._t_zero, x["text"], at)
            self._blocks(caches, activations, range(self.num_blocks), commit=True, chunks=at, write=False)
            for kv in caches:
                for layer, (keys, values) in zip(kv.layers, kv.take_staged(), strict=True):
                    tail_keys, tail_values = kv.tail(layer, keys.shape[1])
                    tail_keys.copy_(keys)
                    tail_values.copy_(values)
            return ()

        inputs = {
            "latent": torch.cat([chunks[i].clean for i in order]),
            "text": torch.cat([chunks[i].conditioning for i in order]),
        }
        self._through_graphs([sessions[i] for i in order], "commit", inputs, commit_pass, copy=False)
        tokens = inputs["latent"].shape[2] * caches[0].tokens_per_frame
        for kv in caches:
            for layer in kv.layers:
                kv.stage(layer, *kv.tail(layer, tokens))

    def _through_graphs(
        self,
        sessions: Sequence[CausalWanSession],
        kind: str,
        inputs: dict[str, torch.Tensor],
        forward: Callable[[Mapping[str, torch.Tensor]], Any],
        copy: bool = True,
    ) -> Any:
        """``forward(inputs)`` through ``step_graphs`` under the key of these
        sessions (one row each, in order) for ``kind``: each one's held keys
        roped for its cache's version first."""
        latent, text = inputs["latent"], inputs["text"]
        abandon_point()
        serials = tuple(self.context.roped.refresh(s.kv, *latent.shape[3:]) for s in sessions)
        key = StepKey(
            tuple(s.kv.uid for s in sessions),
            serials,
            tuple(s.kv.frames for s in sessions),
            tuple(latent.shape),
            tuple(text.shape),
            str(self.dtype),
            kind,
        )
        return self.step_graphs.run(key, inputs, forward, copy=copy)

    # -- caches that outlive their session --------------------------------------------

    @property
    def capture_chunks(self) -> int:
        """Chunks a one-row session runs until its denoise and commit graphs are
        both captured (0 without captured steps): the chunks that fill the
        window, then one whose denoise steps capture (the second use of its key)
        and whose commit is the commit key's first use, then one more."""
        if self.step_graphs is None:
            return 0
        return (self.sink_frames + self.window_frames) // self.latent_frames + 2

    def _session_cache(self, **spec: Any) -> SessionKVCache:
        """A new session's cache of ``spec`` (``SessionKVCache``'s arguments): a
        kept one of that layout when there is one (recycled, its roped-key
        buffers held again), else a new one."""
        taken = None if self.kept is None else self.kept.take(SessionKVCache.layout_of(**spec))
        if taken is None:
            return SessionKVCache(**spec)
        cache, roped = taken
        cache.recycle()
        self.context.roped.adopt(roped)
        return cache

    def _let_go(self, session: CausalWanSession) -> None:
        """A released session's cache: kept with its roped keys and graphs
        (the session left holding an empty cache), or forgotten."""
        kv = session.kv
        roped = self.context.roped.forget(kv)
        if self.step_graphs is None:
            return
        if self.kept is None or self.split or roped is None or not kv.keys:  # no graph to keep, or no buffers
            self.step_graphs.forget(kv.uid)
            return
        for gone in self.kept.put(kv, roped):
            self.step_graphs.forget(gone.uid)
            if gone is not kv:
                gone.free()
        if any(kept.cache is kv for kept in self.kept.kept):
            session.kv = SessionKVCache.empty(self.device)

    def kept_room(self) -> int:
        """Bytes the kept caches may still take (the memory budget reserves them)."""
        return 0 if self.kept is None or self.split else self.kept.room()

    def graph_figures(self) -> dict[str, int] | None:
        """``StepGraphs.figures()`` and ``KeptCaches.figures()``; None without captured steps."""
        if self.step_graphs is None:
            return None
        return self.step_graphs.figures() | (self.kept.figures() if self.kept is not None else {})
