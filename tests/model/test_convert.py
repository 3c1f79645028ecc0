"""``rtvideo convert`` on a synthetic checkpoint in the Self-Forcing layout."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from diffusers import WanTransformer3DModel

from rtvideo.workers.convert import convert
from rtvideo.workers.pipelines.presets import TINY_TRANSFORMER

ROOT = Path(__file__).resolve().parents[2]

# diffusers name -> original Wan name, applied in order (the inverse of diffusers' conversion).
TO_ORIGINAL = [
    ("condition_embedder.time_embedder.linear_1", "time_embedding.0"),
    ("condition_embedder.time_embedder.linear_2", "time_embedding.2"),
    ("condition_embedder.text_embedder.linear_1", "text_embedding.0"),
    ("condition_embedder.text_embedder.linear_2", "text_embedding.2"),
    ("condition_embedder.time_proj", "time_projection.1"),
    ("attn1", "self_attn"),
    ("attn2", "cross_attn"),
    (".to_out.0.", ".o."),
    (".to_q.", ".q."),
    (".to_k.", ".k."),
    (".to_v.", ".v."),
    ("ffn.net.0.proj", "ffn.0"),
    ("ffn.net.2", "ffn.2"),
    ("norm2", "norm__swap"),
    ("norm3", "norm2"),
    ("norm__swap", "norm3"),
]


def original_layout(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in state.items():
        if key == "scale_shift_table":
            key = "head.modulation"
        elif key.startswith("proj_out"):
            key = key.replace("proj_out", "head.head")
        else:
            key = key.replace("scale_shift_table", "modulation")
            for new, old in TO_ORIGINAL:
                key = key.replace(new, old)
        out[f"model.{key}"] = value.clone()
    return out


def test_a_self_forcing_checkpoint_converts_and_loads_strictly(tmp_path):
    torch.manual_seed(0)
    reference = WanTransformer3DModel(**TINY_TRANSFORMER)
    original = original_layout(reference.state_dict())
    assert any(k.startswith("model.blocks.0.self_attn.q.") for k in original)
    torch.save({"generator": original, "generator_ema": original}, tmp_path / "self_forcing_dmd.pt")

    target = convert(tmp_path / "self_forcing_dmd.pt", tmp_path / "model", config="tiny")
    loaded = WanTransformer3DModel.from_pretrained(target)
    for name, tensor in reference.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_a_mismatched_checkpoint_is_refused_naming_keys(tmp_path):
    reference = WanTransformer3DModel(**TINY_TRANSFORMER)
    original = original_layout(reference.state_dict())
    original.pop("model.head.modulation")
    torch.save({"generator_ema": original}, tmp_path / "broken.pt")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "rtvideo.cli",
            "convert",
            str(tmp_path / "broken.pt"),
            str(tmp_path / "out"),
            "--config",
            "tiny",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "scale_shift_table" in result.stderr and "missing" in result.stderr


def test_a_checkpoint_without_ema_weights_takes_its_generator(tmp_path):
    torch.manual_seed(1)
    reference = WanTransformer3DModel(**TINY_TRANSFORMER)
    torch.save({"generator": original_layout(reference.state_dict())}, tmp_path / "causvid.pt")
    loaded = WanTransformer3DModel.from_pretrained(convert(tmp_path / "causvid.pt", tmp_path / "model", config="tiny"))
    assert all(torch.equal(loaded.state_dict()[n], t) for n, t in reference.state_dict().items())
    torch.save({"critic": original_layout(reference.state_dict())}, tmp_path / "critic.pt")
    with pytest.raises(ValueError, match="no 'generator_ema' or 'generator' entry; it has: critic"):
        convert(tmp_path / "critic.pt", tmp_path / "other", config="tiny")
    with pytest.raises(ValueError, match="no 'ema' entry"):
        convert(tmp_path / "causvid.pt", tmp_path / "other", config="tiny", key="ema")


def test_convert_records_the_trained_attention_span_in_rtvideo_json(tmp_path):
    """Self-Forcing's span (3 sinks + a window of 15) unless told; keys already there are kept."""
    torch.manual_seed(2)
    original = original_layout(WanTransformer3DModel(**TINY_TRANSFORMER).state_dict())
    torch.save({"generator_ema": original}, tmp_path / "self_forcing_dmd.pt")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "rtvideo.json").write_text(json.dumps({"text_length": 512, "default_size": [832, 480]}))
    convert(tmp_path / "self_forcing_dmd.pt", tmp_path / "model", config="tiny")
    written = json.loads((tmp_path / "model" / "rtvideo.json").read_text())
    assert written == {"text_length": 512, "default_size": [832, 480], "sink_frames": 3, "window_frames": 15}

    result = subprocess.run(
        [sys.executable, "-m", "rtvideo.cli", "convert", str(tmp_path / "self_forcing_dmd.pt"), str(tmp_path / "other")]
        + ["--config", "tiny", "--sink-frames", "0", "--window-frames", "12"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    written = json.loads((tmp_path / "other" / "rtvideo.json").read_text())
    assert (written["sink_frames"], written["window_frames"]) == (0, 12)
    with pytest.raises(ValueError, match="window_frames >= 1"):
        convert(tmp_path / "self_forcing_dmd.pt", tmp_path / "third", config="tiny", window_frames=0)


def test_a_tiny_decoders_weights_go_into_the_model_directory_where_the_pipeline_finds_them(tmp_path, capsys):
    """``rtvideo convert --tiny-decoder FILE MODEL_DIR``: the decoder's tensors of
    a published weights file land in ``tiny_decoder/``, a model directory built
    from it offers sessions the tiny decoder, and a file that is not one is
    refused naming it."""
    from safetensors.torch import save_file

    from rtvideo.workers.pipelines.causal_wan import build
    from rtvideo.workers.pipelines.presets import build_tiny, save_directory
    from rtvideo.workers.pipelines.tiny_decoder import WEIGHTS_NAME, random_tiny_decoder

    network = random_tiny_decoder(torch.device("cpu"), torch.float32, seed=4).network
    published = {"decoder." + key.removeprefix("layers."): t for key, t in network.state_dict().items()}
    save_file({**published, "encoder.0.weight": torch.zeros(64, 3, 3, 3)}, str(tmp_path / "taew2_1.safetensors"))
    model = tmp_path / "model"
    save_directory(build_tiny(), model)

    def run(*args: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "rtvideo.cli", "convert", *args]
        return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)

    result = run("--tiny-decoder", str(tmp_path / "taew2_1.safetensors"), str(model))
    assert result.returncode == 0, result.stderr
    assert (model / WEIGHTS_NAME).is_file() and str(model / WEIGHTS_NAME) in result.stdout
    pipeline = build(model_dir=str(model), device="cpu", decoder="tiny")
    loaded = pipeline.decoders["tiny"].network.state_dict()
    assert all(torch.equal(loaded[key], tensor) for key, tensor in network.state_dict().items())

    def run_here(*args: str) -> tuple[int, str]:  # the refusals, in this process (a subprocess: seconds of imports)
        from rtvideo.cli.main import main

        try:
            code = main(["convert", *args])
        except SystemExit as exit:
            code = exit.code
        return code, capsys.readouterr().err

    (tmp_path / "notes.txt").write_text("hello")
    code, said = run_here("--tiny-decoder", str(tmp_path / "notes.txt"), str(model))
    assert code == 2 and "notes.txt' could not be read" in said
    code, said = run_here(str(model))
    assert code == 2
    assert "give CHECKPOINT MODEL_DIR, or MODEL_DIR with --tiny-decoder FILE" in said
