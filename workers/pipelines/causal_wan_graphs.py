"""The causal Wan pipeline's captured steps: which forwards go through ``StepGraphs``.

Worker process. ``CapturedSteps`` is the part of ``CausalWanPipeline`` that
routes a forward with static shapes and buffers through the pipeline's
``step_graphs`` (``workers.pipelines.step_graphs``: a CUDA graph captured on
a key's second use and replayed, or with ``cuda_graphs: "eager"`` the same
static-buffer path run eagerly) instead of running it eagerly:

- ``_capturable``: whether a denoise forward qualifies (one row, every block
  on this rank, the session's window full, no chunk in flight before it,
  nothing staged for a commit);
- ``_captured_step``: that forward, its held keys roped for the cache's
  version before the replay (the graph reads them and does not rope them),
  its latent, timestep and text copied in, its prediction copied out.

Everything else runs eagerly; the frames are the same either way (bit for
bit on a CPU, where the replay is eager: ``tests/model/test_captured_step_graphs.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from workers.pipelines.base import BatchRow, StepBatch, abandon_point
from workers.pipelines.causal_wan_state import CausalWanSession
from workers.pipelines.step_graphs import StepGraphs, StepKey

if TYPE_CHECKING:
    from workers.pipelines.wan_attention import ForwardContext


class CapturedSteps:
    """Needs ``step_graphs`` (None: every forward eager), ``context`` (the
    attention's ``ForwardContext``), ``num_blocks``, ``split``, ``dtype``,
    ``commit_from_last_step`` and ``_run`` (a whole eager pass) of the pipeline."""

    step_graphs: StepGraphs | None
    context: ForwardContext
    num_blocks: int
    split: bool
    dtype: torch.dtype
    commit_from_last_step: bool
    _run: Callable[..., torch.Tensor]

    def _capturable(self, batch: StepBatch, sessions: Sequence[CausalWanSession], blocks: range) -> bool:
        """Whether this denoise forward has static shapes and buffers: captured
        steps are on, one row, every block on this rank, the session's window
        full (the span attended and the RoPE positions fixed), no chunk in
        flight before it (stream batch) and nothing staged (the last step
        under ``commit_from_last_step``). The window filling, batched rows,
        pipeline ranks and commits run eagerly."""
        if self.step_graphs is None or len(batch.rows) != 1 or self.split or blocks != range(self.num_blocks):
            return False
        session, row = sessions[0], batch.rows[0]
        staged = self.commit_from_last_step and row.step == len(session.timesteps) - 1
        return session.kv.frames == session.kv.capacity and session.lookahead == 1 and not staged

    def _captured_step(self, row: BatchRow, session: CausalWanSession) -> torch.Tensor:
        """One row's denoise forward through ``step_graphs``: the held keys
        roped for the cache's version first (the graph reads them, and does
        not rope them), then the latent, timestep and text copied into the
        graph's static inputs and its prediction copied out. The replay has no
        block boundaries: a stop is checked once, before it."""
        chunk, kv = session.chunk_at(row), session.kv
        abandon_point()
        serial = self.context.roped.refresh(kv, *chunk.latent.shape[3:])
        key = StepKey(
            kv.uid, serial, kv.frames, tuple(chunk.latent.shape), tuple(chunk.conditioning.shape), str(self.dtype)
        )
        inputs = {
            "latent": chunk.latent,
            "timestep": session.schedule[row.step : row.step + 1],
            "text": chunk.conditioning,
        }
        return self.step_graphs.run(key, inputs, lambda x: self._run((kv,), x["latent"], x["timestep"], x["text"]))
