"""Our block forward and its fused elementwise groups
(``rtvideo.workers.pipelines.wan_block_forward``; the pipeline option ``fused_elementwise``).

- ``block_forward`` with the eager groups is diffusers' ``WanTransformerBlock.forward``
  bit for bit (random-weight tiny blocks, fp32 and bf16, with and without the
  cross-attention norm, a modulation per row and per token), and the pipeline's blocks run it (hooks included).
- ``fused_elementwise: true`` compiles the groups with inductor (C++ on this
  CPU) and tracks the eager frames within a tight tolerance: not bit for bit,
  because inductor's layer norm reduces in another order (its Welford loop)
  than ATen's kernel, an ulp or so of fp32 per norm; the groups that only add
  and multiply are bit for bit, the RoPE rotation of the queries and keys
  too. Every compile here is of the tiny preset's 16x16 shapes (one row of 3
  tokens, 24 wide), shared by the tests of this file: five graphs, about 10 s
  on 2 cores with a cold compile cache, most of it inductor's first start.
- Under captured steps (``cuda_graphs: "eager"``) nothing is compiled inside a
  capture or a replay: the capture comes on a key's second use, the first
  compiled what it needs.
- The option refused: a value not true or false, beside ``compile``, and
  where inductor cannot make its kernels, naming the option and the device.
"""

from __future__ import annotations

import sys

import pytest
import torch
from diffusers.models.transformers.transformer_wan import WanTransformer3DModel, WanTransformerBlock
from torch._dynamo.utils import counters

from rtvideo.engine.messages import StartSession
from rtvideo.workers.chunk_driver import ChunkDriver
from rtvideo.workers.pipelines import wan_block_forward
from rtvideo.workers.pipelines.causal_wan import build
from rtvideo.workers.pipelines.causal_wan_weights import cast
from rtvideo.workers.pipelines.presets import TINY_TRANSFORMER
from rtvideo.workers.pipelines.wan_block_forward import EAGER, block_forward, fused_ops, fused_refusal

SIZE = {"width": 16, "height": 16}  # one token a latent frame: the smallest compile
SPAN = {"sink_frames": 3, "window_frames": 3}  # full after two chunks


def _compiled_graphs() -> int:
    return counters["stats"]["unique_graphs"]


def _tiny_model(dtype: torch.dtype, cross_attn_norm: bool) -> WanTransformer3DModel:
    torch.manual_seed(5)
    model = WanTransformer3DModel(**dict(TINY_TRANSFORMER, cross_attn_norm=cross_attn_norm))
    with torch.no_grad():  # the table is zeros in a fresh block; random, so the modulation is not trivial
        for block in model.blocks:
            block.scale_shift_table.normal_()
    return cast(model, torch.device("cpu"), dtype).eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("cross_attn_norm", "per_token"),
    [(True, False), (False, False), (True, True)],
    ids=["cross-norm", "no-cross-norm", "per-token-modulation"],
)
def test_block_forward_is_diffusers_block_forward_bit_for_bit(dtype, cross_attn_norm, per_token):
    model = _tiny_model(dtype, cross_attn_norm)
    generator = torch.Generator().manual_seed(7)
    rows, tokens, width = 2, 12, model.config.num_attention_heads * model.config.attention_head_dim
    hidden = torch.randn(rows, tokens, width, generator=generator).to(dtype)
    text = torch.randn(rows, 9, width, generator=generator).to(dtype)
    shape = (rows, tokens, 6, width) if per_token else (rows, 6, width)
    modulation = torch.randn(shape, generator=generator).to(dtype)
    rotary = model.rope(torch.zeros(rows, 16, 3, 4, 4))
    assert isinstance(model.blocks[0].norm2, torch.nn.Identity) is not cross_attn_norm
    with torch.no_grad():
        for block in model.blocks:
            expected = WanTransformerBlock.forward(block, hidden, text, modulation, rotary)
            got = block_forward(block, hidden, text, modulation, rotary)
            assert got.dtype == dtype and torch.equal(got, expected)
            hidden = expected


def test_the_pipelines_blocks_run_our_forward_through_their_module_call(monkeypatch):
    """The pipeline installs ``block_forward`` on its blocks: diffusers' class
    forward never runs, and the blocks' hooks still do (``run_blocks`` calls
    each block as a module)."""
    pipeline = build("tiny", device="cpu", warm_up_chunks=0)
    called = []
    for block in pipeline.transformer.blocks:
        block.register_forward_pre_hook(lambda module, _: called.append(module))

    def not_diffusers(*_):
        raise AssertionError("diffusers' block forward ran")

    monkeypatch.setattr(WanTransformerBlock, "forward", not_diffusers)
    _chunks(pipeline, "ours", 1)
    assert called[:2] == list(pipeline.transformer.blocks)
    assert pipeline.transformer.blocks[0].forward.__func__ is block_forward


def _groups_inputs():
    """The groups' inputs at the pipeline's 16x16 shapes: one row, 3 tokens, 24 wide,
    the modulation's six parts views of one [1, 6, 24] tensor, as ``block_forward`` makes them;
    the rotation's: queries of 2 heads of 12, fp32 tables (its ``out`` is ``_call``'s)."""
    generator = torch.Generator().manual_seed(11)
    x, y = (3 * torch.randn(1, 3, 24, generator=generator) for _ in range(2))
    scale, shift, gate = (1 + torch.randn(1, 6, 24, generator=generator)).chunk(6, dim=1)[:3]
    weight, bias = torch.randn(24, generator=generator), torch.randn(24, generator=generator)
    cos, sin = (torch.randn(1, 3, 1, 12, generator=generator) for _ in range(2))
    return {
        "modulate": (x, None, None, 1e-6, scale, shift),
        "gated_residual_norm": (x, y, gate, weight, bias, 1e-6),
        "residual_modulate": (x, y, None, None, 1e-6, scale, shift),
        "gated_residual": (x, y, gate),
        "rope": (x.view(1, 3, 2, 12), cos, sin),
    }


def _call(ops, name: str, args: tuple):
    """``ops``' group ``name`` on ``args``; the rotation into a new tensor of its own."""
    if name == "rope":
        return ops.rope(*args, torch.empty_like(args[0]))
    return getattr(ops, name)(*args)


@torch.no_grad()  # as the pipeline runs them: one compile serves this test and the next
def test_each_fused_group_is_eager_to_an_ulp_and_the_elementwise_only_one_bit_for_bit():
    fused = fused_ops()
    for name, args in _groups_inputs().items():
        got, expected = _call(fused, name, args), _call(EAGER, name, args)
        got, expected = (got, expected) if isinstance(got, tuple) else ((got,), (expected,))
        for g, e in zip(got, expected, strict=True):
            assert g.dtype == e.dtype == torch.float32 and g.shape == e.shape
            # the norm's reduction order: an ulp or so of fp32 (values here are O(10): 1e-5 is ~10 ulps)
            torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-5)
    x, y, gate = _groups_inputs()["gated_residual"]
    assert torch.equal(fused.gated_residual(x, y, gate), EAGER.gated_residual(x, y, gate))
    x, y = _groups_inputs()["residual_modulate"][:2]
    assert torch.equal(fused.residual_modulate(*_groups_inputs()["residual_modulate"])[0], x + y)
    rope = _groups_inputs()["rope"]
    assert torch.equal(_call(fused, "rope", rope), wan_block_forward.apply_rope(*rope))


@torch.no_grad()
def test_a_group_compiles_once_for_one_row_and_once_for_several_whatever_the_size():
    """The rows and tokens are marked dynamic before each call (``any_size``):
    a new session size or batch width compiles nothing (the tracing checked
    without code generation, ``aot_eager``; a function of this test's own, so
    no other test's compiles are counted)."""

    def group(x, y, gate):
        return wan_block_forward.gated_residual(x, y, gate)

    compiled = wan_block_forward.any_size(torch.compile(group, fullgraph=True, backend="aot_eager"))
    compiles = []
    for rows, tokens in [(1, 3), (1, 12), (1, 40), (2, 12), (4, 5), (3, 40)]:
        x, y, gate = torch.randn(rows, tokens, 8), torch.randn(rows, tokens, 8), torch.randn(rows, 1, 8)
        before = _compiled_graphs()
        assert torch.equal(compiled(x, y, gate), EAGER.gated_residual(x, y, gate))
        compiles.append(_compiled_graphs() - before)
    assert compiles == [1, 0, 0, 1, 0, 0]  # one row, then several: each serves every size after


@torch.no_grad()
def test_the_rotation_compiles_once_for_any_rows_whatever_the_store():
    """One row's queries and keys, its held keys and the tail of its key buffer
    are views of stores of other lengths, at other offsets (other row strides):
    one compile serves them all, and every batch of rows, with one RoPE table
    or one a row (``rope_any_size``; traced without code generation, ``aot_eager``;
    a function of this test's own, so that no other test's compile of
    ``rope_into`` counts here, nor this one in theirs)."""

    def rotate(x, cos, sin, out):
        return wan_block_forward.rope_into(x, cos, sin, out)

    rope = wan_block_forward.rope_any_size(torch.compile(rotate, fullgraph=True, backend="aot_eager"))
    compiles = []

    def check(x, out, tables=1):
        cos, sin = torch.randn(tables, x.shape[1], 1, 12), torch.randn(tables, x.shape[1], 1, 12)
        before = _compiled_graphs()
        assert rope(x, cos, sin, out) is out
        assert torch.equal(out, wan_block_forward.apply_rope(x, cos, sin))
        compiles.append(_compiled_graphs() - before)

    for tokens, store, at in [(3, 3, 0), (12, 40, 0), (12, 40, 20), (7, 64, 50), (40, 40, 0)]:
        keys = torch.randn(1, store, 2, 12)
        check(keys[:, at : at + tokens], torch.zeros(1, store, 2, 12)[:, at : at + tokens])
    for rows, tokens, tables in [(2, 12, 1), (4, 5, 1), (3, 5, 3)]:  # a table for every row, or one a row
        check(torch.randn(rows, tokens, 2, 12), torch.empty(rows, tokens, 2, 12), tables)
    assert compiles == [1, 0, 0, 0, 0, 0, 0, 0]


def _chunks(pipeline, sid: str, chunks: int) -> list[torch.Tensor]:
    driver = ChunkDriver(pipeline, max_rows=1)
    [state] = driver.open(StartSession(session_id=sid, prompt="a red fox", seed=3, num_inference_steps=2, **SIZE))
    latents = []
    for _ in range(chunks):
        driver.run([sid], 1)
        latents.append(state.cached_chunks[-1].clone())
    driver.release(sid)
    return latents


def test_fused_elementwise_tracks_the_eager_chunks_and_captures_compile_nothing():
    """fp32, the tiny preset at 16x16: the fused pipeline's clean latents against
    the eager one's, chunk by chunk through the window filling and the captured
    steps (``cuda_graphs: "eager"``), no graph compiled inside a capture or a replay."""
    eager = build("tiny", device="cpu", warm_up_chunks=0, **SPAN)
    fused = build("tiny", device="cpu", warm_up_chunks=0, fused_elementwise=True, cuda_graphs="eager", **SPAN)
    assert fused.fused_elementwise is True and eager.fused_elementwise is False
    assert fused.transformer.blocks[1].forward.__func__.keywords == {"ops": fused_ops()}
    inside = []

    class Watched:  # the capture the step graphs use, counting what is compiled inside it
        def __init__(self, capture):
            self.inner = capture

        def capture(self, function):
            replay = self.inner.capture(function)

            def watched():
                before = _compiled_graphs()
                output = replay()
                inside.append(_compiled_graphs() - before)
                return output

            return watched

    fused.step_graphs.capture = Watched(fused.step_graphs.capture)
    before = _compiled_graphs()
    got = _chunks(fused, "fused", 5)
    expected = _chunks(eager, "eager", 5)
    figures = fused.graph_figures()
    assert figures["captures"] == 2 and figures["replays"] > 4  # the denoise forward and the commit, replayed
    assert len(inside) == figures["replays"] and set(inside) == {0}
    assert _compiled_graphs() - before <= 5  # the five groups at one shape, or none where compiled already
    for g, e in zip(got, expected, strict=True):
        difference = (g - e).abs().max().item()
        assert difference <= 1e-5 * e.abs().max().item(), difference


def test_fused_elementwise_is_refused_beside_compile_and_when_not_true_or_false():
    with pytest.raises(ValueError, match="fused_elementwise and compile: compile already runs each whole block"):
        build("tiny", device="cpu", warm_up_chunks=0, fused_elementwise=True, compile=True)
    with pytest.raises(ValueError, match="pipeline option fused_elementwise: Expected `bool`, got `str`"):
        build("tiny", device="cpu", warm_up_chunks=0, fused_elementwise="yes")


def test_fused_elementwise_is_refused_where_inductor_cannot_make_its_kernels(monkeypatch):
    assert fused_refusal(torch.device("cpu")) is None  # this machine has a C++ compiler
    assert fused_refusal(torch.device("mps")) == (
        "fused_elementwise: fused kernels are made for a GPU (cuda) or a CPU; this runs on mps"
    )
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton raises ImportError
    assert fused_refusal(torch.device("cuda:0")) == (
        "fused_elementwise: inductor's GPU kernels need Triton, not installed; this runs on cuda:0"
    )
    monkeypatch.setattr(wan_block_forward.shutil, "which", lambda _: None)
    refusal = r"fused_elementwise: inductor's CPU kernels need a C\+\+ compiler \(g\+\+\), none found; this runs on cpu"
    with pytest.raises(ValueError, match=refusal):
        build("tiny", device="cpu", warm_up_chunks=0, fused_elementwise=True)
