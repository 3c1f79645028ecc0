"""The causal Wan pipeline on the tiny preset, in process (fp32, CPU)."""

from __future__ import annotations

import dataclasses
import json
from weakref import WeakKeyDictionary

import pytest
import torch

from rtvideo.engine.messages import StartSession
from rtvideo.workers.chunk_driver import ChunkDriver
from rtvideo.workers.pipelines.base import BatchRow, StepBatch
from rtvideo.workers.pipelines.causal_wan import CausalWanPipeline, build, self_forcing_timesteps
from rtvideo.workers.pipelines.causal_wan_state import CausalWanSession
from rtvideo.workers.pipelines.presets import build_tiny, load_directory, save_directory, write_rtvideo_json
from rtvideo.workers.pipelines.wan_block_forward import apply_rope


@pytest.fixture(scope="module")
def pipeline() -> CausalWanPipeline:
    return build("tiny", device="cpu")


_drivers: WeakKeyDictionary = WeakKeyDictionary()


def driver_for(pipeline) -> ChunkDriver:
    """The chunk driver (``rtvideo.workers.chunk_driver``: the worker's path) of ``pipeline``'s test sessions."""
    if pipeline not in _drivers:
        _drivers[pipeline] = ChunkDriver(pipeline)
    return _drivers[pipeline]


def open_session(pipeline, sid: str = "s", **start) -> CausalWanSession:
    start = StartSession(session_id=sid, **{"prompt": "a red fox", **start})
    [state] = driver_for(pipeline).open(start)
    return state


def run_chunk(pipeline, state: CausalWanSession, prompt: str | None = None, transition: int = 0):
    """The session's next chunk (with an interaction at its boundary if ``prompt``
    is given): its frames and its clean latent (the chunk committed last)."""
    out = driver_for(pipeline).run_chunk(state.session_id, prompt, transition)
    return out, state.cached_chunks[-1].clone()


def release(pipeline, state: CausalWanSession) -> None:
    driver_for(pipeline).release(state.session_id)


def test_schedule_matches_self_forcing():
    assert self_forcing_timesteps(4) == pytest.approx([1000.0, 937.5, 833.3333, 625.0], abs=1e-3)
    assert len(self_forcing_timesteps(1)) == 1
    with pytest.raises(ValueError, match="num_inference_steps"):
        self_forcing_timesteps(5)


def test_geometry_first_chunk_9_frames_then_12(pipeline):
    state = open_session(pipeline, num_chunks=3)
    frames = [run_chunk(pipeline, state)[0].num_frames for _ in range(3)]
    assert frames == [9, 12, 12]
    assert state.geometry.first_chunk_frames == 9 and state.geometry.frames_per_chunk == 12


def cached_and_block_causal(pipeline, t: float = 937.5, seed: int = 0):
    """Chunk 0 committed at t=0, then chunk 1 at ``t`` through the cache; and one
    forward over both chunks with a block-causal mask and per-token timesteps.
    Returns ((cached chunk 0, cached chunk 1), (full chunk 0, full chunk 1)),
    on the pipeline's device in its dtype. The chunks are drawn on the CPU."""
    model, device = pipeline.transformer, pipeline.device
    state = open_session(pipeline, f"block-causal-{seed}")
    conditioning, shape = state.prompt.target, state.latent_shape
    generator = torch.Generator().manual_seed(seed)
    chunk0, chunk1 = (torch.randn(shape, generator=generator).to(device, pipeline.dtype) for _ in range(2))
    with torch.no_grad():
        out0 = pipeline._run((state.kv,), chunk0, [0.0], conditioning, commit=True)
        out1 = pipeline._run((state.kv,), chunk1, [t], conditioning)

        both = torch.cat([chunk0, chunk1], dim=2)
        per_frame = shape[3] * shape[4] // 4  # tokens per latent frame after the 1x2x2 patch
        tokens = 2 * shape[2] * per_frame
        chunk_of = torch.arange(tokens, device=device) // (shape[2] * per_frame)
        mask = chunk_of[None, :] <= chunk_of[:, None]
        timesteps = torch.where(chunk_of == 0, 0.0, t)[None, :]
        pipeline.context.mask = mask
        try:
            full = model(both, timesteps, encoder_hidden_states=conditioning, return_dict=False)[0]
        finally:
            pipeline.context.mask = None
    release(pipeline, state)
    return (out0, out1), (full[:, :, : shape[2]], full[:, :, shape[2] :])


def test_cached_chunks_equal_one_block_causal_forward(pipeline):
    """Chunk 0 committed at t=0, then chunk 1 at t through the cache, equals one
    forward over both chunks with a block-causal mask and per-token timesteps."""
    (out0, out1), (full0, full1) = cached_and_block_causal(pipeline)
    assert torch.allclose(full0, out0, atol=1e-5, rtol=0)
    assert (full1 - out1).abs().max().item() <= 1e-5


def test_streaming_decode_equals_one_shot_decode(pipeline):
    torch.manual_seed(1)
    latents = torch.randn(1, 16, 9, 8, 8)
    cache = pipeline.decoder.new_cache()
    parts = [pipeline.decoder.decode(latents[:, :, i : i + 3], cache, first=i == 0) for i in (0, 3, 6)]
    assert [p.shape[2] for p in parts] == [9, 12, 12]
    with torch.no_grad():
        whole = pipeline.decoder.reference_decode(latents)
    assert (torch.cat(parts, dim=2) - whole).abs().max().item() <= 1e-6


def test_the_decoder_split_anywhere_gives_the_whole_decoders_frames_bit_for_bit(pipeline):
    """The decoder in two parts (``decode_front`` on one copy of the cache,
    ``decode_back`` on another, as two ranks hold them), chunk after chunk:
    every split gives the frames of the whole decoder, bit for bit, and the
    two parts fill disjoint slots of their caches (each rank holds only its own)."""
    decoder = pipeline.decoder
    assert decoder.stages == 13  # input and middle, four up-sampling blocks' 11 residual blocks and up-samplers, head
    torch.manual_seed(2)
    latents = torch.randn(1, 16, 7, 8, 8)
    pieces = [(latents[:, :, :1], True), (latents[:, :, 1:4], False), (latents[:, :, 4:], False)]
    cache = decoder.new_cache()
    whole = [decoder.decode(piece, cache, first=first) for piece, first in pieces]
    for split in range(1, decoder.stages):
        front, back = decoder.new_cache(), decoder.new_cache()
        made = []
        for piece, _ in pieces:
            parts = list(decoder.decode_front(piece, front, split))
            assert len(parts) == piece.shape[2]
            made.append(torch.cat([decoder.decode_back(part, back, split) for part in parts], dim=2))
        assert all(torch.equal(a, b) for a, b in zip(whole, made, strict=True)), f"split {split} differs"
        held = [{i for i, entry in enumerate(c) if entry is not None} for c in (front, back)]
        assert held[0] and held[1] and not held[0] & held[1] and max(held[0]) < min(held[1])
    with pytest.raises(ValueError, match="a decoder split must be 1..12 stages in front, got 13"):
        next(decoder.decode_front(latents[:, :, :1], decoder.new_cache(), 13))
    seconds = decoder.stage_seconds(3, 4, 4)
    assert len(seconds) == decoder.stages and all(s > 0 for s in seconds)


def test_split_decodes_of_several_streams_batch_with_each_streams_frames_and_caches(pipeline):
    """Three streams' chunks through the split decoder as one batch
    (``decode_front_rows`` on rank 0's copies of their caches, ``decode_back``
    on a stacked copy of the others', ``unstack`` once through), chunk after
    chunk: each stream's frames and both copies of its cache are bit for bit
    those of decoding it alone. A batch given up part-way (its front not run
    to the end, its back not unstacked) leaves every cache as it was."""
    decoder = pipeline.decoder
    split = 7
    torch.manual_seed(3)
    streams = [torch.randn(1, 16, 7, 8, 8) for _ in range(3)]
    pieces = [(slice(0, 1), True), (slice(1, 4), False), (slice(4, 7), False)]
    alone_front = [decoder.new_cache() for _ in streams]
    alone_back = [decoder.new_cache() for _ in streams]
    fronts = [decoder.new_cache() for _ in streams]
    backs = [decoder.new_cache() for _ in streams]
    for piece, _ in pieces:
        alone = []
        for latents, front, back in zip(streams, alone_front, alone_back, strict=True):
            parts = list(decoder.decode_front(latents[:, :, piece], front, split))
            alone.append(torch.cat([decoder.decode_back(part, back, split) for part in parts], dim=2))
        before = [list(cache) for cache in fronts + backs]
        abandoned = decoder.decode_front_rows([latents[:, :, piece] for latents in streams], fronts, split)
        part = next(abandoned)
        decoder.decode_back(part, decoder.stacked(backs), split)
        abandoned.close()  # given up after one frame: nothing kept
        kept = zip(before, fronts + backs, strict=True)
        assert all(a is b for was, cache in kept for a, b in zip(was, cache, strict=True))
        work = decoder.stacked(backs)
        pixels = [
            decoder.decode_back(part, work, split)
            for part in decoder.decode_front_rows([latents[:, :, piece] for latents in streams], fronts, split)
        ]
        decoder.unstack(work, backs)
        batched = torch.cat(pixels, dim=2).split(1)
        assert all(torch.equal(a, b) for a, b in zip(alone, batched, strict=True))
        for mine, theirs in zip(fronts + backs, alone_front + alone_back, strict=True):
            assert decoder.cache_shape(mine) == decoder.cache_shape(theirs)
            assert all(
                torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b for a, b in zip(mine, theirs, strict=True)
            )
    with pytest.raises(ValueError, match="decode_front_rows takes latents of one shape"):
        next(decoder.decode_front_rows([streams[0][:, :, :1], streams[1][:, :, 1:3]], fronts[:2], split))
    # A stream at its first frame beside streams past it: their caches cannot stack, for a front or a back.
    fresh = decoder.new_cache()
    mixed = [latents[:, :, :1] for latents in streams]
    with pytest.raises(ValueError, match="a batch's 2 streams hold decoder features of different shapes"):
        next(decoder.decode_front_rows(mixed[:2], [fronts[0], fresh], split))
    with pytest.raises(ValueError, match="a batch's 3 streams hold decoder features of different shapes"):
        decoder.stacked([*backs[:2], fresh])
    with pytest.raises(ValueError, match="a batch's 2 streams hold decoder features of different shapes"):
        decoder.decode_rows(mixed[:2], [fresh, fronts[1]], first=False)
    with pytest.raises(ValueError, match="needs one cache at least"):
        decoder.stacked([])


def test_a_400_chunk_stream_keeps_constant_memory_and_valid_positions(pipeline):
    state = open_session(pipeline, width=16, height=16, num_inference_steps=1)
    kv = state.kv
    allocated = kv.nbytes()
    table = pipeline.rope.max_seq_len
    held_at = {}
    for chunk in range(400):  # 1200 latent frames: past the 1024-frame RoPE table
        run_chunk(pipeline, state)
        if chunk + 1 in (20, 200):
            held_at[chunk + 1] = (kv.nbytes(), kv.frames, _tensor_bytes(state))
    assert kv.committed_frames > table  # absolute frame count is past the RoPE table
    assert kv.nbytes() == allocated
    assert held_at[20] == held_at[200]
    assert kv.frames == pipeline.sink_frames + pipeline.window_frames


def _tensor_bytes(value, skip: tuple[str, ...] = ()) -> int:
    """Bytes of the tensors in ``value``: a tensor, or walked through, the fields of
    a dataclass (but those named in ``skip``: a session's ``vae_cache``), a dict's
    values, a list's items (a chunk record, the cached chunks); other objects (the
    KV cache, the prompt blend) are not walked."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if dataclasses.is_dataclass(value):
        return sum(_tensor_bytes(getattr(value, f.name)) for f in dataclasses.fields(value) if f.name not in skip)
    if isinstance(value, dict):
        return sum(_tensor_bytes(item) for item in value.values())
    if isinstance(value, list | tuple):
        return sum(_tensor_bytes(item) for item in value)
    return 0


def test_same_seed_same_frames_and_interleaved_sessions_equal_alone(pipeline):
    alone_a = open_session(pipeline, "a", seed=11)
    frames_a = [run_chunk(pipeline, alone_a)[0].payload for _ in range(3)]
    alone_b = open_session(pipeline, "b", prompt="a blue whale", seed=12)
    frames_b = [run_chunk(pipeline, alone_b)[0].payload for _ in range(3)]

    a, b = open_session(pipeline, "a2", seed=11), open_session(pipeline, "b2", prompt="a blue whale", seed=12)
    together_a, together_b = [], []
    for _ in range(3):
        together_a.append(run_chunk(pipeline, a)[0].payload)
        together_b.append(run_chunk(pipeline, b)[0].payload)
    assert together_a == frames_a and together_b == frames_b
    assert frames_a != frames_b


def test_release_frees_everything(pipeline):
    state = open_session(pipeline, "gone")
    run_chunk(pipeline, state)
    assert "gone" in pipeline.held_sessions()
    release(pipeline, state)
    assert "gone" not in pipeline.held_sessions() and "gone" not in driver_for(pipeline).runner.states
    assert not state.chunks and state.kv.nbytes() == 0 and state.prompt.target is None
    assert _tensor_bytes(state) == 0


def test_hard_reset_equals_a_fresh_session_with_the_new_prompt(pipeline):
    k = 2
    state = open_session(pipeline, "r", prompt_change="reset", seed=5)
    for _ in range(k):
        run_chunk(pipeline, state)
    _, reset_clean = run_chunk(pipeline, state, prompt="a storm at sea")
    fresh = open_session(pipeline, "f", prompt="a storm at sea", seed=5)
    _, fresh_clean = run_chunk(pipeline, fresh)
    assert torch.equal(reset_clean, fresh_clean)


def test_soft_and_recache_keep_history_and_differ_from_each_other(pipeline):
    results = {}
    for mode in ("soft", "recache", "reset"):
        state = open_session(pipeline, mode, prompt_change=mode, seed=9)
        for _ in range(2):
            run_chunk(pipeline, state)
        frames_before = state.kv.frames
        _, clean = run_chunk(pipeline, state, prompt="a storm at sea")
        results[mode] = clean
        expected_frames = frames_before + 3 if mode != "reset" else 3
        assert state.kv.frames == expected_frames
    assert not torch.equal(results["soft"], results["recache"])
    assert not torch.equal(results["soft"], results["reset"])
    assert not torch.equal(results["recache"], results["reset"])


def test_transition_blends_the_text_embeddings(pipeline, monkeypatch):
    state = open_session(pipeline, "t")
    run_chunk(pipeline, state)
    old, new = pipeline.encode_prompt("a red fox"), pipeline.encode_prompt("a storm")
    prepared = []  # each chunk's conditioning, as its boundary prepared it
    boundary = pipeline.boundary

    def spy(session, chunk_index, *args):
        boundary(session, chunk_index, *args)
        prepared.append(session.chunks[chunk_index].conditioning)

    monkeypatch.setattr(pipeline, "boundary", spy)
    run_chunk(pipeline, state, "a storm", 3)
    for _ in range(3):
        run_chunk(pipeline, state)
    for j in range(3):
        weight = (j + 1) / 3
        assert torch.allclose(prepared[j], (1 - weight) * old + weight * new)
    assert torch.equal(prepared[3], new) and len(prepared) == 4


def test_prompt_encodings_are_cached(pipeline):
    first = pipeline.encode_prompt("cache me")
    assert pipeline.encode_prompt("cache me") is first


def test_save_and_load_a_model_directory_offline_gives_the_same_frames(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    save_directory(build_tiny(), tmp_path / "model")
    loaded = build(model_dir=str(tmp_path / "model"), device="cpu")
    fresh = build("tiny", device="cpu")
    assert loaded.warm_up_chunks == 0 and fresh.warm_up_chunks == 2  # a model directory on a CPU: no warm-up
    assert build(model_dir=str(tmp_path / "model"), device="cpu", warm_up_chunks=1).warm_up_chunks == 1
    a, b = open_session(loaded, seed=3), open_session(fresh, seed=3)
    assert [run_chunk(loaded, a)[0].payload for _ in range(2)] == [run_chunk(fresh, b)[0].payload for _ in range(2)]


def test_a_loaded_model_computes_from_aligned_memory_of_its_own_on_a_cpu(tmp_path):
    """``from_pretrained`` leaves tensors as views into the mapped safetensors
    files at offsets only 4- or 8-byte aligned, and a one-row ``Linear`` (the
    timestep embedding) sums in another order from a misaligned weight: that
    made a loaded directory's frames one grey level off the preset's. The
    pipeline copies such tensors into memory of their own, tied weights kept tied."""
    from rtvideo.workers.pipelines.causal_wan import _own_aligned_memory

    save_directory(build_tiny(), tmp_path / "model")
    raw = load_directory(tmp_path / "model", torch.float32)
    loaded = build(model_dir=str(tmp_path / "model"), device="cpu")
    for model in (loaded.transformer, loaded.vae, loaded.text_encoder):
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            assert tensor.data_ptr() % 64 == 0, name
    assert loaded.text_encoder.shared.weight is loaded.text_encoder.encoder.embed_tokens.weight
    for name, tensor in raw.transformer.state_dict().items():
        assert torch.equal(loaded.transformer.state_dict()[name], tensor), name

    linear = torch.nn.Linear(8, 4)
    storage = torch.zeros(linear.weight.numel() + 2)
    storage[2:] = linear.weight.detach().flatten()
    expected = linear.weight.detach().clone()
    linear.weight.data = storage[2:].view(4, 8)  # 8 bytes past an aligned start
    shared = torch.nn.Sequential(linear, linear)
    assert linear.weight.data_ptr() % 64 == 8
    assert _own_aligned_memory(shared) == 1
    assert linear.weight.data_ptr() % 64 == 0 and torch.equal(linear.weight, expected)
    assert shared[0].weight is shared[1].weight
    assert _own_aligned_memory(shared) == 0


def test_the_default_attention_span_is_the_weights_trained_span(tmp_path, monkeypatch):
    """Self-Forcing attends to 21 latent frames, its chunk's 3 and 18 cached (3
    sinks + a window of 15): the default of the preset and of a model
    directory (its rtvideo.json says so; one without the keys gets it too)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    preset = build("tiny", device="cpu", warm_up_chunks=0)
    assert (preset.sink_frames, preset.window_frames) == (3, 15)

    from rtvideo.workers.pipelines import wan_attention

    state = open_session(preset, "span", width=16, height=16, num_inference_steps=1)
    for _ in range(8):  # 24 latent frames: the window has rolled
        run_chunk(preset, state)
    kv = state.kv
    assert kv.frames == 18
    attended = []  # key tokens of every self-attention call
    real = wan_attention.dispatch_attention_fn
    spy = lambda q, k, *a, **kw: attended.append(k.shape[1]) or real(q, k, *a, **kw)  # noqa: E731
    monkeypatch.setattr(wan_attention, "dispatch_attention_fn", spy)
    offsets = []  # the chunk's RoPE position: cache-relative, after the 18 held frames, not the absolute 24
    hook = preset.rope.register_forward_hook(lambda module, args, out: offsets.append(module.frame_offsets))
    run_chunk(preset, state)
    hook.remove()
    monkeypatch.setattr(wan_attention, "dispatch_attention_fn", real)
    assert attended and set(attended) == {21 * kv.tokens_per_frame}
    assert set(offsets) == {(18,)} and kv.committed_frames == 27
    release(preset, state)

    model = tmp_path / "model"
    save_directory(build_tiny(), model)
    written = json.loads((model / "rtvideo.json").read_text())
    assert (written["sink_frames"], written["window_frames"]) == (3, 15)
    components = load_directory(model, torch.float32)
    assert (components.sink_frames, components.window_frames) == (3, 15)
    loaded = build(model_dir=str(model), device="cpu")
    assert (loaded.sink_frames, loaded.window_frames) == (3, 15)

    write_rtvideo_json(model, sink_frames=6, window_frames=12)  # weights trained on another span
    other = build(model_dir=str(model), device="cpu")
    assert (other.sink_frames, other.window_frames) == (6, 12)
    assert json.loads((model / "rtvideo.json").read_text())["text_length"] == 64  # other keys kept

    (model / "rtvideo.json").write_text(json.dumps({"text_length": 64, "default_size": [64, 64]}))
    unsaid = build(model_dir=str(model), device="cpu")
    assert (unsaid.sink_frames, unsaid.window_frames) == (3, 15)

    # Pipeline options still override either.
    assert build("tiny", device="cpu", sink_frames=0, window_frames=18).window_frames == 18
    overridden = build(model_dir=str(model), device="cpu", sink_frames=3, window_frames=18)
    assert (overridden.sink_frames, overridden.window_frames) == (3, 18)
    assert open_session(overridden, "wide").kv.capacity == 21


@pytest.mark.parametrize(
    ("options", "refusal"),
    [
        ({"latent_frames_per_chunk": 0}, r"^latent_frames_per_chunk must be >= 1, got 0$"),
        ({"latent_frames_per_chunk": -1}, r"^latent_frames_per_chunk must be >= 1, got -1$"),
        (
            {"latent_frames_per_chunk": 5},
            r"^sink_frames \(3\) and window_frames \(15\) must be multiples of latent_frames_per_chunk \(5\)$",
        ),
        ({"sink_frames": 0, "window_frames": 0}, r"window_frames >= latent_frames_per_chunk \(3\), got 0 and 0$"),
        ({"sink_frames": -1}, r"^need sink_frames >= 0 and window_frames >= .* got -1 and 15$"),
        ({"seed": 2**70}, r"^seed must be between 0 and 9223372036854775807, got 1180591620717411303424$"),
        ({"seed": -1}, r"^seed must be between 0 and"),
        ({"vae_dtype": "x"}, r"^vae_dtype must be auto, bfloat16 or float32, got 'x'$"),
        ({"compile": "yes"}, r"^pipeline option compile: Expected `bool`, got `str` \('yes'\)$"),
        ({"fused_elementwise": 1}, r"^pipeline option fused_elementwise: Expected `bool`, got `int` \(1\)$"),
        ({"window_frames": 9.0}, r"^pipeline option window_frames: Expected `int \| null`, got `float` \(9.0\)$"),
        ({"fps": "16"}, r"^pipeline option fps: Expected `float`, got `str` \('16'\)$"),
        ({"name": "x"}, r"^pipeline option name: set by the model's preset or directory, not an option$"),
        ({"warm_up_chunks": -1}, r"^warm_up_chunks must be >= 0, got -1$"),
    ],
)
def test_options_out_of_range_are_refused_naming_the_option_and_its_value(options, refusal):
    with pytest.raises(ValueError, match=refusal):
        build("tiny", device="cpu", **options)


@pytest.mark.parametrize("bad", ["15", -3, 1.5, True])
def test_a_bad_span_in_rtvideo_json_is_named(tmp_path, bad):
    save_directory(build_tiny(), tmp_path / "model")
    write_rtvideo_json(tmp_path / "model", window_frames=bad)
    with pytest.raises(ValueError, match="window_frames must be a whole number"):
        load_directory(tmp_path / "model", torch.float32)


@pytest.mark.parametrize("missing", ["transformer", "vae", "text_encoder", "tokenizer"])
def test_a_broken_model_directory_names_what_is_missing(tmp_path, missing):
    save_directory(build_tiny(), tmp_path / "model")
    import shutil

    shutil.rmtree(tmp_path / "model" / missing)
    with pytest.raises(ValueError, match=f"{missing}/"):
        load_directory(tmp_path / "model", torch.float32)
    with pytest.raises(ValueError, match="does not exist"):
        load_directory(tmp_path / "nowhere", torch.float32)


def test_rope_helper_matches_diffusers_rotation():
    x = torch.randn(1, 4, 2, 12)
    cos, sin = torch.randn(1, 4, 1, 12), torch.randn(1, 4, 1, 12)
    out = apply_rope(x, cos, sin)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    assert torch.allclose(out[..., 0::2], x1 * cos[..., 0::2] - x2 * sin[..., 1::2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("channel_first,images,bias", [(True, True, False), (True, False, False), (False, False, True)])
def test_fast_vae_norm_equals_diffusers_norm(dtype, channel_first, images, bias):
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanRMS_norm

    from rtvideo.workers.pipelines.cpu_kernels import FastRMSNorm, use_fast_cpu_kernels

    torch.manual_seed(0)
    reference = WanRMS_norm(8, channel_first=channel_first, images=images, bias=bias)
    with torch.no_grad():
        for parameter in reference.parameters():
            parameter.uniform_(-2, 2)
    fast = WanRMS_norm(8, channel_first=channel_first, images=images, bias=bias)
    fast.load_state_dict(reference.state_dict())
    reference, holder = reference.to(dtype), torch.nn.Sequential(fast).to(dtype)
    assert use_fast_cpu_kernels(holder) == 1 and type(holder[0]) is FastRMSNorm
    shape = (2, 8, 3, 5, 7) if channel_first and not images else (2, 8, 5, 7) if channel_first else (2, 3, 5, 8)
    x = (torch.randn(shape) * 3).to(dtype)
    x[0, ..., 0] = 0.0  # an all-zero vector: both clamp instead of dividing by zero
    with torch.no_grad():
        expected, got = reference(x), holder(x)
    assert got.dtype == expected.dtype == dtype
    tolerance = 1e-6 if dtype == torch.float32 else 8e-3  # bf16: one rounding step of the largest values
    assert (got.float() - expected.float()).abs().max().item() <= tolerance * expected.float().abs().max().item()


def test_the_cache_is_roped_once_per_layer_per_chunk(pipeline, monkeypatch):
    state = open_session(pipeline, "roped")
    for _ in range(2):
        run_chunk(pipeline, state)
    kv = state.kv
    held_tokens = kv.frames * kv.tokens_per_frame  # 6 frames: unlike a chunk's 3
    calls = []
    real = pipeline.context.roped.rotate
    spy = lambda x, *cs: calls.append(x.shape[1]) or real(x, *cs)  # noqa: E731
    monkeypatch.setattr(pipeline.context.roped, "rotate", spy)
    run_chunk(pipeline, state)  # 4 denoise forwards and the commit forward, all over the same cache
    assert calls.count(held_tokens) == len(pipeline.transformer.blocks)
    assert kv.uid in pipeline.context.roped.entries
    release(pipeline, state)
    assert kv.uid not in pipeline.context.roped.entries


def test_sessions_interleaved_step_by_step_equal_each_alone(pipeline):
    """Every forward switches sessions: nothing roped for one cache leaks into the other."""
    alone = {}
    for sid, seed in (("x", 31), ("y", 32)):
        state = open_session(pipeline, sid, seed=seed, prompt=f"prompt {sid}")
        alone[sid] = [run_chunk(pipeline, state)[1] for _ in range(3)]
        release(pipeline, state)
    one_row = ChunkDriver(pipeline, max_rows=1)  # one row a forward: the sessions take turns, step by step
    states = dict(
        zip(
            ("x", "y"),
            one_row.open(
                *(StartSession(session_id=s + "2", prompt=f"prompt {s}", seed=n) for s, n in (("x", 31), ("y", 32)))
            ),
            strict=True,
        )
    )
    forwards = []
    real = pipeline.forward
    pipeline.forward = lambda batch, sessions: (
        forwards.append([r.session_id for r in batch.rows]) or real(batch, sessions)
    )
    together = {"x": [], "y": []}
    try:
        for _ in range(3):
            one_row.run(["x2", "y2"])
            for sid, state in states.items():
                together[sid].append(state.cached_chunks[-1].clone())
    finally:
        del pipeline.forward
    assert forwards == [["x2"], ["y2"]] * 12
    for sid in ("x", "y"):
        assert all(torch.equal(a, b) for a, b in zip(alone[sid], together[sid], strict=True))
    one_row.release("x2", "y2")


@pytest.mark.parametrize("stride", [1, 2])
def test_onednn_causal_conv_equals_diffusers_conv(stride):
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d

    from rtvideo.workers.pipelines.cpu_kernels import OneDnnCausalConv3d, use_fast_cpu_kernels

    torch.manual_seed(0)
    reference = WanCausalConv3d(4, 6, 3, stride=stride, padding=1)
    fast = WanCausalConv3d(4, 6, 3, stride=stride, padding=1)
    fast.load_state_dict(reference.state_dict())
    holder = torch.nn.Sequential(fast)
    assert use_fast_cpu_kernels(holder) == 1 and type(holder[0]) is OneDnnCausalConv3d
    x, cache = torch.randn(1, 4, 1, 10, 12), torch.randn(1, 4, 2, 10, 12)
    with torch.no_grad():
        for args in ((x,), (x, cache)):
            expected, got = reference(*args), holder[0](*args)
            assert got.shape == expected.shape
            assert (got - expected).abs().max().item() <= 1e-5 * expected.abs().max().item()
        # Other dtypes take torch's own dispatch: bit for bit the reference.
        assert torch.equal(holder.bfloat16()[0](x.bfloat16()), reference.bfloat16()(x.bfloat16()))


def test_a_chunks_noise_is_drawn_and_moved_once_at_its_boundary(pipeline, monkeypatch):
    """No host-to-device copy inside the denoise steps (each would wait for the device)."""
    state = open_session(pipeline, "noise", seed=13)
    pipeline.boundary(state, 0)
    chunk = state.chunks[0]
    assert chunk.noise.shape == (4, *state.latent_shape)

    def no_draws(*_):
        raise AssertionError("noise drawn during the steps")

    monkeypatch.setattr(pipeline, "_noise", no_draws)
    for step in range(4):
        row = BatchRow(state.session_id, 0, step)
        [prediction] = pipeline.forward(StepBatch((row,)), [state])
        pipeline.sampler_step(state, row, prediction)
    assert chunk.noise is None and chunk.latent is None and chunk.clean is not None  # freed once denoised
    monkeypatch.undo()
    pipeline.commit(state, 0)
    pipeline.decode(state, 0)
    release(pipeline, state)


def test_compiled_blocks_make_the_eager_frames():
    """``compile``: each block through torch.compile (self-attention left eager);
    the same chunks to float rounding. The first chunk pays the compilation."""
    eager = build("tiny", device="cpu", warm_up_chunks=0)
    compiled = build("tiny", device="cpu", warm_up_chunks=0, compile=True)
    a = open_session(eager, "eager", width=16, height=16, num_inference_steps=2, seed=17)
    b = open_session(compiled, "compiled", width=16, height=16, num_inference_steps=2, seed=17)
    for _ in range(2):
        _, clean_eager = run_chunk(eager, a)
        _, clean_compiled = run_chunk(compiled, b)
        assert (clean_eager - clean_compiled).abs().max().item() <= 1e-4 * clean_eager.abs().max().item()
    # a session of another size compiles nothing: the blocks' rows and tokens were marked dynamic
    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]
    wide = open_session(compiled, "wide", width=32, height=16, num_inference_steps=2, seed=17)
    run_chunk(compiled, wide)
    assert counters["stats"]["unique_graphs"] == graphs


def test_roped_keys_of_a_cache_that_moved_on_are_dropped(pipeline):
    """One session stepping at a time holds one session's roped keys, whatever the capacity."""
    roped = pipeline.context.roped
    a, b = open_session(pipeline, "ra", seed=1), open_session(pipeline, "rb", seed=2)
    for state in (a, a, b, b):  # the second chunk of each reads its cache
        run_chunk(pipeline, state)
    assert b.kv.uid in roped.entries and a.kv.uid not in roped.entries
    run_chunk(pipeline, a)  # reads a's cache; b's committed since its last read: stale
    assert b.kv.uid not in roped.entries and a.kv.uid in roped.entries
    release(pipeline, a)
    release(pipeline, b)


@pytest.mark.parametrize("width,height", [(64, 64), (48, 32)])
def test_state_bytes_account_for_what_a_full_session_holds(width, height):
    """Admission counts ``geometry.state_bytes``: it must cover a session whose
    window has filled (KV, VAE cache, latents), and not by much. Roped keys are
    a pool of at most max_batch_rows sessions' keys, reserved apart."""
    pipeline = build("tiny", device="cpu", warm_up_chunks=0)
    state = open_session(pipeline, "full", width=width, height=height)
    for _ in range(8):  # 24 latent frames: the 18-frame cache has filled and rolled
        run_chunk(pipeline, state)
    pipeline.boundary(state, 8)
    vae = sum(t.numel() * t.element_size() for t in state.vae_cache if isinstance(t, torch.Tensor))
    assert vae == pipeline.decoder.cache_bytes(height // 8, width // 8)
    latents = _tensor_bytes(state, skip=("vae_cache",))
    held = state.kv.nbytes() + vae + latents
    assert held <= state.geometry.state_bytes <= 1.1 * held


def test_state_bytes_count_the_chunks_in_flight_of_stream_batch():
    """With stream batch a session also holds the chunk in flight after the first
    (its noise draws and latent) and the first's provisional keys and values."""
    pipeline = build("tiny", device="cpu", warm_up_chunks=0)
    alone = pipeline.describe(StartSession(session_id="x", prompt="p")).state_bytes
    pipeline.chunks_in_flight = lambda prompt_change: 2 if prompt_change == "soft" else 1
    assert pipeline.describe(StartSession(session_id="x", prompt="p", prompt_change="reset")).state_bytes == alone
    state = open_session(pipeline, "ahead")
    assert state.lookahead == 2 and state.geometry.state_bytes > alone
    for _ in range(8):  # the cache has filled and rolled
        run_chunk(pipeline, state)
    pipeline.boundary(state, 8)
    (prediction,) = pipeline.forward(StepBatch((BatchRow("ahead", 8, 0),)), [state])  # keeps chunk 8's keys
    pipeline.sampler_step(state, BatchRow("ahead", 8, 0), prediction)
    pipeline.boundary(state, 9)  # chunk 9 begins while chunk 8 is in flight
    pipeline.forward(StepBatch((BatchRow("ahead", 9, 0),)), [state])  # attends to chunk 8's provisional keys
    assert state.kv.frames_before(9) == state.kv.frames + pipeline.latent_frames
    vae = sum(t.numel() * t.element_size() for t in state.vae_cache if isinstance(t, torch.Tensor))
    held = state.kv.nbytes() + vae + _tensor_bytes(state, skip=("vae_cache",))
    assert held <= state.geometry.state_bytes <= 1.1 * held


def test_a_negative_prompt_is_refused_not_ignored(pipeline):
    """Self-Forcing samples without classifier-free guidance: a negative prompt could change nothing."""
    with pytest.raises(ValueError, match="^negative_prompt: .*classifier-free guidance"):
        pipeline.describe(StartSession(session_id="s", prompt="a red fox", negative_prompt="blurry"))
    assert pipeline.describe(StartSession(session_id="s", prompt="a red fox", negative_prompt=" ")).width == 64
