"""The Wan transformer's forward in three parts, so that a range of its blocks
can run on its own.

Worker process. ``WanTransformer3DModel.forward`` (diffusers) embeds, runs
every block and applies the output head in one call. ``embed``,
``run_blocks`` and ``head`` do the same operations in the same order, on the
model's own modules, so a forward split into block ranges computes bit for
bit what the one call computes (tested), and blocks 0..k and k+1..N can run
as two calls that hand ``Activations`` from one to the other (on two ranks,
later). Only what the causal pipeline uses: text-to-video, one timestep per
batch row, no image conditioning.

Each block is called as a module (its hooks run, and ``compile`` compiles
that call), and its forward is ours: the pipeline installs
``wan_block_forward.block_forward`` on every block of its transformer
(``install_block_forward``: diffusers' block forward, bit for bit, with its
elementwise groups named, eager or fused by the option
``fused_elementwise``). A model given no forward of ours runs diffusers'
``WanTransformerBlock.forward``: the same bits, eagerly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from diffusers.models.transformers.transformer_wan import WanTransformer3DModel

from rtvideo.workers.pipelines.base import abandon_point
from rtvideo.workers.pipelines.wan_block_forward import mark_any_size


@dataclass(frozen=True)
class Activations:
    """The state of a forward between two blocks: what the later blocks and the head read."""

    hidden: torch.Tensor  # [rows, tokens, inner_dim]: the tokens, after the blocks run so far
    text: torch.Tensor  # [rows, text_length, inner_dim]: the projected text embeddings (cross-attention)
    modulation: torch.Tensor  # [rows, 6, inner_dim]: the timestep's projection, every block's shift/scale/gate
    temb: torch.Tensor  # [rows, inner_dim]: the timestep embedding (the head's modulation)
    rotary: tuple[torch.Tensor, torch.Tensor]  # RoPE cos, sin of the rows' tokens
    latent_shape: tuple[int, ...]  # [rows, channels, frames, height, width] of the latent embedded


def embed(
    model: WanTransformer3DModel, latent: torch.Tensor, timestep: torch.Tensor, text: torch.Tensor
) -> Activations:
    """Patch-embed ``latent`` [rows, C, F, H, W], embed ``timestep`` [rows] and
    project ``text`` [rows, L, text_dim]; RoPE comes from ``model.rope`` (with
    whatever frame offsets it was given)."""
    rotary = model.rope(latent)
    tokens = model.patch_embedding(latent).flatten(2).transpose(1, 2).contiguous()
    temb, projection, text, _ = model.condition_embedder(timestep, text, None, timestep_seq_len=None)
    return Activations(tokens, text, projection.unflatten(1, (6, -1)), temb, rotary, tuple(latent.shape))


def run_blocks(model: WanTransformer3DModel, activations: Activations, blocks: range) -> Activations:
    """Blocks ``blocks`` of ``model``, in order, from ``activations``, each through
    its module call (``install_block_forward``'s forward, where installed). Before each
    block, ``abandon_point()``: a forward whose rows' sessions all stopped ends
    there (``Abandoned``), so a stop waits at most one block. Compiled blocks
    (the option ``compile``) are given their inputs' rows and tokens marked
    dynamic, so their first compile serves every session size and batch
    width (``mark_any_size``): no compile stalls the worker mid-serving."""
    hidden = activations.hidden
    compiled = len(blocks) > 0 and getattr(model.blocks[blocks.start], "_compiled_call_impl", None) is not None
    if compiled:
        mark_any_size(activations.text, 0)
        mark_any_size(activations.modulation, 0)
        for table in activations.rotary:
            mark_any_size(table, 0, 1)
    for index in blocks:
        abandon_point()
        if compiled:
            mark_any_size(hidden, 0, 1)
        hidden = model.blocks[index](hidden, activations.text, activations.modulation, activations.rotary)
    return replace(activations, hidden=hidden)


def head(model: WanTransformer3DModel, activations: Activations) -> torch.Tensor:
    """The output norm (modulated by the timestep), the projection, and the
    tokens put back into a latent's shape: the prediction, [rows, C, F, H, W]."""
    rows, _, frames, height, width = activations.latent_shape
    p_t, p_h, p_w = model.config.patch_size
    hidden, temb = activations.hidden, activations.temb
    shift, scale = (model.scale_shift_table.to(temb.device) + temb.unsqueeze(1)).chunk(2, dim=1)
    shift, scale = shift.to(hidden.device), scale.to(hidden.device)
    out = (model.norm_out(hidden.float()) * (1 + scale) + shift).type_as(hidden)
    out = model.proj_out(out)
    out = out.reshape(rows, frames // p_t, height // p_h, width // p_w, p_t, p_h, p_w, -1)
    return out.permute(0, 7, 1, 4, 2, 5, 3, 6).flatten(6, 7).flatten(4, 5).flatten(2, 3)


def activation_tensors(activations: Activations) -> list[torch.Tensor]:
    """The tensors of ``activations``, contiguous, in the order ``activations_from``
    takes them: what travels to the next pipeline rank."""
    cos, sin = activations.rotary
    parts = (activations.hidden, activations.text, activations.modulation, activations.temb, cos, sin)
    return [part.contiguous() for part in parts]


def activations_from(tensors: list[torch.Tensor], latent_shape: tuple[int, ...]) -> Activations:
    """``Activations`` again from ``activation_tensors``' list (received from the rank before)."""
    hidden, text, modulation, temb, cos, sin = tensors
    return Activations(hidden, text, modulation, temb, (cos, sin), tuple(latent_shape))


def stack_rows(parts: Sequence[Activations]) -> Activations:
    """One batch of the rows of ``parts`` (each embedded on its own), in order;
    the RoPE tables per row."""
    cos = torch.cat([part.rotary[0] for part in parts])
    sin = torch.cat([part.rotary[1] for part in parts])
    rows = sum(part.latent_shape[0] for part in parts)
    return Activations(
        torch.cat([part.hidden for part in parts]),
        torch.cat([part.text for part in parts]),
        torch.cat([part.modulation for part in parts]),
        torch.cat([part.temb for part in parts]),
        (cos, sin),
        (rows, *parts[0].latent_shape[1:]),
    )


def select_rows(activations: Activations, positions: list[int]) -> Activations:
    """The batch rows ``positions`` of ``activations`` (RoPE tables shared by every
    row stay as they are)."""
    index = torch.tensor(positions, device=activations.hidden.device)
    cos, sin = activations.rotary
    if cos.shape[0] > 1:
        cos, sin = cos.index_select(0, index), sin.index_select(0, index)
    return Activations(
        activations.hidden.index_select(0, index),
        activations.text.index_select(0, index),
        activations.modulation.index_select(0, index),
        activations.temb.index_select(0, index),
        (cos, sin),
        (len(positions), *activations.latent_shape[1:]),
    )
