"""A later pipeline rank drops the VAE's encoder (``own_blocks``): the first rank
takes a session's input frames. Tiny preset, CPU, two ranks of one block each."""

from __future__ import annotations

import gc
import weakref

import msgspec
import numpy as np
import pytest
import torch

from rtvideo.engine.messages import StartSession, VideoInput
from rtvideo.workers.pipelines.causal_wan import CausalWanPipeline, build


def split(first: CausalWanPipeline, later: CausalWanPipeline) -> tuple[CausalWanPipeline, CausalWanPipeline]:
    """Two ranks of the tiny preset's two blocks: 0-0 and 1-1."""
    first.own_blocks(range(0, 1), most_per_rank=1)
    later.own_blocks(range(1, 2), most_per_rank=1)
    return first, later


@pytest.fixture(scope="module")
def ranks() -> tuple[CausalWanPipeline, CausalWanPipeline]:
    return split(*(build("tiny", device="cpu", warm_up_chunks=0) for _ in range(2)))


def video_start(sid: str, strength: float) -> StartSession:
    given = VideoInput(strength=strength, format="raw", width=64, height=64, fps=16.0)
    return StartSession(session_id=sid, prompt="a watercolour fox", seed=7, input=given)


def weight_bytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


def test_a_later_rank_frees_the_vae_encoders_weights_and_still_decodes(ranks):
    pipeline = build("tiny", device="cpu", warm_up_chunks=0)
    vae = pipeline.vae
    before = weight_bytes(vae)
    encoder_bytes = weight_bytes(vae.encoder) + weight_bytes(vae.quant_conv)
    assert encoder_bytes > 0
    gone = [weakref.ref(vae.encoder), weakref.ref(vae.quant_conv)]
    decoder_keys = {k for k in vae.state_dict() if not k.startswith(("encoder.", "quant_conv."))}

    pipeline.own_blocks(range(1, 2), most_per_rank=1)
    gc.collect()

    assert pipeline.encoder is None and pipeline.encoder_dropped
    assert vae.encoder is None and vae.quant_conv is None
    assert all(ref() is None for ref in gone)  # nothing else held them: the memory is free
    assert weight_bytes(vae) == before - encoder_bytes
    assert set(vae.state_dict()) == decoder_keys
    assert pipeline.vae is vae and vae.post_quant_conv is not None and vae.decoder is not None

    # Decoding reads none of it: the streaming and one-shot decodes are the first rank's, bit for bit.
    first = ranks[0]  # the same weights, its encoder kept
    assert first.vae.encoder is not None
    latents = torch.randn(1, 16, 2, 2, 2, generator=torch.Generator().manual_seed(3))
    made = [d.decode(latents, d.new_cache(), first=True) for d in (first.decoder, pipeline.decoder)]
    assert torch.equal(made[0], made[1])
    once = [d.reference_decode(latents) for d in (first.decoder, pipeline.decoder)]
    assert torch.equal(once[0], once[1])


def test_the_first_rank_keeps_its_encoder(ranks):
    first, _ = ranks
    assert first.encoder is not None and not first.encoder_dropped and first.vae.encoder is not None


def test_an_input_session_on_a_later_rank_holds_and_counts_no_encoder(ranks):
    first, later = ranks
    for strength in (0.5, 0.0):
        start = video_start(f"in-{strength}", strength)
        mine, theirs = first.describe(start), later.describe(start)
        assert msgspec.structs.replace(theirs, state_bytes=mine.state_bytes) == mine  # the same geometry
        assert theirs.state_bytes < mine.state_bytes  # less the encoder's cache and the input latents
        assert mine.state_bytes - theirs.state_bytes >= first.encoder.cache_bytes(8, 8)
        opened = {}
        for pipeline in (first, later):
            prompt = pipeline.encode_prompt(start.prompt) if pipeline is first else None
            opened[pipeline] = pipeline.open(start, pipeline.describe(start), prompt)
        assert opened[first].input.encode and any(slot is None for slot in opened[first].input.encoder_cache)
        assert opened[later].input.encoder_cache == [] and not opened[later].input.encode
        assert opened[later].timesteps == opened[first].timesteps
        for pipeline, state in opened.items():
            pipeline.release(state)
    text = StartSession(session_id="text", prompt="p")
    assert first.describe(text) == later.describe(text)  # text to video: nothing differs


def test_take_input_on_a_later_rank_is_refused_naming_its_blocks(ranks):
    _, later = ranks
    start = video_start("later", 0.5)
    state = later.open(start, later.describe(start), None)
    frames = np.zeros((9, 64, 64, 3), dtype=np.uint8)
    with pytest.raises(RuntimeError, match=r"this pipeline rank runs blocks 1-1 of 2 .* go to the first rank"):
        later.take_input(state, 0, frames)
    assert state.input.next_chunk == 0 and not state.input.latents
    later.release(state)


def test_a_vae_without_an_encoder_is_refused_an_input_on_every_rank(monkeypatch):
    """A pipeline built as one whose VAE has no encoder (``encoder`` None before
    ``own_blocks``): the first rank refuses an input session as on one rank,
    and the later rank, with nothing to drop, answers the same."""
    first, later = (build("tiny", device="cpu", warm_up_chunks=0) for _ in range(2))
    for pipeline in (first, later):
        monkeypatch.setattr(pipeline, "encoder", None)
    split(first, later)
    assert not later.encoder_dropped and later.vae.encoder is not None  # nothing dropped
    for pipeline in (first, later):
        with pytest.raises(ValueError, match="input: the 'tiny' model's VAE has no encoder to take video frames"):
            pipeline.describe(video_start("none", 0.5))
