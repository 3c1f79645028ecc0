"""The causal Wan pipeline split over pipeline ranks: each rank its own blocks.

Worker process. ``CausalWanRanks`` is the part of ``CausalWanPipeline`` that
a transformer split over ranks needs: ``own_blocks`` keeps one contiguous
block range (the others' weights dropped, sessions opened after it holding
only those blocks' KV cache, the text encoder and the VAE's encoder dropped
after the first rank);
``pack`` / ``unpack`` turn the ``Hidden`` states a range hands on into a
plain description and tensors for the link to the next rank, and back;
``select`` keeps the rows a later rank runs on; ``follow_boundary`` is a
later rank's part of a chunk's boundary. One rank (``split`` false) runs
every block and uses none of this but ``split``.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

from rtvideo.workers.pipelines.base import BatchRow, Hidden, block_range
from rtvideo.workers.pipelines.causal_wan_state import CausalWanSession
from rtvideo.workers.pipelines.vae_encode import drop_encoder
from rtvideo.workers.pipelines.wan_blocks import activation_tensors, activations_from, select_rows


class CausalWanRanks:
    """Needs ``num_blocks``, ``owned`` (the blocks this process runs),
    ``transformer``, ``text_encoder``, ``vae``, ``encoder``,
    ``encoder_dropped``, ``device``, ``kv_layers``,
    ``commit_from_last_step``, ``_held`` and ``_prompts`` of the pipeline."""

    num_blocks: int
    owned: range
    transformer: Any
    text_encoder: Any
    vae: Any
    encoder: Any
    encoder_dropped: bool
    device: torch.device
    kv_layers: int
    commit_from_last_step: bool
    _held: set[str]
    _prompts: OrderedDict[str, torch.Tensor]

    def follow_boundary(self, session: CausalWanSession, chunk_index: int, prompt_changed: bool) -> None:
        """A later pipeline rank's part of a boundary: its blocks' cache follows the
        first rank's (a ``reset`` prompt change empties it). Run before any row of
        the chunk reaches this rank, after every pass of the chunk before it left."""
        if prompt_changed and session.start.prompt_change == "reset":
            session.kv.reset()

    @property
    def split(self) -> bool:
        """Whether this process runs only part of the blocks (a pipeline rank)."""
        return len(self.owned) != self.num_blocks

    def own_blocks(self, blocks: range, most_per_rank: int | None = None) -> None:
        """Keep only ``blocks`` (a contiguous range): the other blocks' weights are
        dropped, sessions opened from now on hold only these blocks' KV cache, and
        a rank after the first drops the text encoder (prompts are encoded on the
        first rank) and the VAE's encoder (``drop_encoder``; the VAE stays, to
        decode): the first rank takes a session's input frames, so there an
        input session holds no encoder cache and counts none (``state_bytes``),
        and ``take_input`` is refused. ``most_per_rank``: the most blocks any
        rank keeps, which is what a session's state costs the fullest GPU
        (``state_bytes``). Called once, before any session opens."""
        blocks = block_range(blocks, self.num_blocks)
        if self.commit_from_last_step and len(blocks) != self.num_blocks:
            raise ValueError(
                "commit_from_last_step: a chunk's commit is a pass of its own across pipeline ranks; "
                "the option runs on one rank (--pp 1)"
            )
        if self.device.type == "cuda":
            self.kv_layers = most_per_rank or len(blocks)
        if self._held:
            raise RuntimeError("own_blocks must be called before any session opens")
        for index in range(self.num_blocks):
            if index not in blocks:
                self.transformer.blocks[index] = torch.nn.Identity()
        if blocks.start > 0:
            self.text_encoder = None
            self._prompts.clear()
            if self.encoder is not None:
                drop_encoder(self.vae)
                self.encoder, self.encoder_dropped = None, True
        self.owned = blocks

    def pack(self, hidden: Hidden) -> tuple[dict, list[torch.Tensor]]:
        """``hidden`` as (a plain description, its tensors), to send to the next rank."""
        groups = hidden.tensors if isinstance(hidden.tensors, list) else [(None, hidden.tensors)]
        meta = {
            "blocks_done": hidden.blocks_done,
            "rows": [list(row) for row in hidden.rows],
            "grouped": isinstance(hidden.tensors, list),
            "groups": [[indices, list(activations.latent_shape)] for indices, activations in groups],
        }
        return meta, [tensor for _, activations in groups for tensor in activation_tensors(activations)]

    def unpack(self, meta: dict, tensors: list[torch.Tensor]) -> Hidden:
        """The ``Hidden`` that ``pack`` described, from the tensors received."""
        per_group = len(tensors) // max(1, len(meta["groups"]))
        groups = []
        for number, (indices, latent_shape) in enumerate(meta["groups"]):
            part = [t.to(self.device) for t in tensors[number * per_group : (number + 1) * per_group]]
            groups.append((indices, activations_from(part, tuple(latent_shape))))
        rows = tuple(BatchRow(str(sid), int(chunk), int(step)) for sid, chunk, step in meta["rows"])
        payload = groups if meta["grouped"] else groups[0][1]
        return Hidden(int(meta["blocks_done"]), rows, payload)

    def select(self, hidden: Hidden, keep: list[int]) -> Hidden:
        """The rows ``keep`` (indices into ``hidden.rows``, in order) of ``hidden``:
        a later rank runs on without rows that failed or are not its to run."""
        new_index = {old: new for new, old in enumerate(keep)}
        rows = tuple(hidden.rows[i] for i in keep)
        if not isinstance(hidden.tensors, list):  # a commit pass: one row
            return Hidden(hidden.blocks_done, rows, hidden.tensors)
        groups = []
        for indices, activations in hidden.tensors:
            kept = [i for i in indices if i in new_index]
            if kept:
                positions = [indices.index(i) for i in kept]
                groups.append(([new_index[i] for i in kept], select_rows(activations, positions)))
        return Hidden(hidden.blocks_done, rows, groups)
