"""The causal Wan pipeline's captured steps: which forwards go through
``StepGraphs``, and the caches kept so that their graphs outlive a session.

Worker process. ``CapturedSteps`` is the part of ``CausalWanPipeline`` that
routes a forward with static shapes and buffers through the pipeline's
``step_graphs`` (``workers.pipelines.step_graphs``: a CUDA graph captured on
a key's second use and replayed, or with ``cuda_graphs: "eager"`` the same
static-buffer path run eagerly) instead of running it eagerly:

- ``_capturable`` / ``_captured_step``: a denoise forward of one row, every
  block on this rank, over a full window (the span attended and the RoPE
  positions fixed), no chunk in flight before it (stream batch) and nothing
  staged for a commit (the last step under ``commit_from_last_step``). The
  held keys are roped for the cache's version before the replay (the graph
  reads them and does not rope them); latent, timestep and text are copied
  in, the prediction copied out.
- ``_commit_capturable`` / ``_captured_commit``: a chunk's commit pass under
  the same conditions (and not ``commit_from_last_step``, which has no
  pass), under its own key (``kind="commit"``). The graph computes every
  layer's keys and values of the clean chunk and hands them out; writing
  them into the cache (the window's shift, the cache's counts) runs eagerly
  after the replay, as the eager commit writes them.

Everything else runs eagerly; the frames are the same either way (bit for
bit on a CPU, where the replay is eager: ``tests/model/test_captured_step_graphs.py``).

A graph holds the addresses of its session's KV stores and roped-key
buffers. So that the graphs outlive the session, a released session's cache
and its roped-key buffers go to ``KeptCaches`` (``kept_caches`` of them at
most, and at most that many caches of the default size in bytes), and the
next session of the same layout (size, layers, dtype) takes them over
(``_session_cache``: recycled, holding nothing; same addresses, so the same
keys and graphs). The graphs of a cache let go for good are forgotten. The
memory budget reserves what the kept caches may still take (``kept_room``):
admission counts a session's own cache in its ``state_bytes``, and an idle
kept cache in that reservation. ``capture_chunks``: the chunks a session of
one row runs before both of its graphs are captured (the warm-up runs them
at the default size, ``workers.warmup``, so the first session of that size
replays from its first full-window chunk).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from workers.pipelines.base import BatchRow, StepBatch, abandon_point
from workers.pipelines.causal_wan_state import CausalWanChunk, CausalWanSession
from workers.pipelines.kv_cache import SessionKVCache
from workers.pipelines.step_graphs import StepGraphs, StepKey

if TYPE_CHECKING:
    from workers.pipelines.wan_attention import ForwardContext, _RopedEntry


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

    def _capturable(self, batch: StepBatch, sessions: Sequence[CausalWanSession], blocks: range) -> bool:
        """Whether this denoise forward has static shapes and buffers (the
        module's docstring). The window filling, batched rows, pipeline ranks
        and stream batch run eagerly."""
        if self.step_graphs is None or len(batch.rows) != 1 or self.split or blocks != range(self.num_blocks):
            return False
        session, row = sessions[0], batch.rows[0]
        staged = self.commit_from_last_step and row.step == len(session.timesteps) - 1
        return session.kv.frames == session.kv.capacity and session.lookahead == 1 and not staged

    def _captured_step(self, row: BatchRow, session: CausalWanSession) -> torch.Tensor:
        """One row's denoise forward through ``step_graphs``. The replay has no
        block boundaries: a stop is checked once, before it."""
        chunk = session.chunk_at(row)
        inputs = {
            "latent": chunk.latent,
            "timestep": session.schedule[row.step : row.step + 1],
            "text": chunk.conditioning,
        }
        kv = session.kv
        return self._through_graphs(
            session, "denoise", inputs, lambda x: self._run((kv,), x["latent"], x["timestep"], x["text"])
        )

    def _commit_capturable(self, session: CausalWanSession, blocks: range) -> bool:
        """Whether this commit pass has static shapes and buffers: as a denoise
        forward's (``_capturable``), and a pass to run (not ``commit_from_last_step``)."""
        if self.step_graphs is None or self.split or blocks != range(self.num_blocks) or self.commit_from_last_step:
            return False
        return session.kv.frames == session.kv.capacity and session.lookahead == 1

    def _captured_commit(self, session: CausalWanSession, chunk_index: int, chunk: CausalWanChunk) -> None:
        """The chunk's commit pass through ``step_graphs``: its keys and values
        come out of the graph (not copied: they go into the cache at once) and
        are written into the session's cache eagerly."""
        kv = session.kv

        def commit_pass(x: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
            activations = self._embed((kv,), x["latent"], self._t_zero, x["text"], (chunk_index,))
            self._blocks((kv,), activations, range(self.num_blocks), commit=True, chunks=(chunk_index,), write=False)
            return tuple(t for pair in kv.take_staged() for t in pair)

        inputs = {"latent": chunk.clean, "text": chunk.conditioning}
        staged = self._through_graphs(session, "commit", inputs, commit_pass, copy=False)
        for layer, at in zip(kv.layers, range(0, len(staged), 2), strict=True):
            kv.stage(layer, staged[at], staged[at + 1])
        kv.commit(chunk.clean.shape[2])
        kv.drop_provisional(chunk_index)

    def _through_graphs(
        self,
        session: CausalWanSession,
        kind: str,
        inputs: dict[str, torch.Tensor],
        forward: Callable[[Mapping[str, torch.Tensor]], Any],
        copy: bool = True,
    ) -> Any:
        """``forward(inputs)`` through ``step_graphs`` under the session's key for
        ``kind``: the held keys roped for the cache's version first."""
        kv, latent, text = session.kv, inputs["latent"], inputs["text"]
        abandon_point()
        serial = self.context.roped.refresh(kv, *latent.shape[3:])
        key = StepKey(kv.uid, serial, kv.frames, tuple(latent.shape), tuple(text.shape), str(self.dtype), kind)
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
