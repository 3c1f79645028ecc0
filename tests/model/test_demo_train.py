"""The demo model's training loop end to end, on a tiny configuration (seconds):
train, checkpoint, resume, export a model directory, load it through the real
loading path and generate through the real pipeline; and training's forward
equals the served chunk-by-chunk forward."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from diffusers import WanTransformer3DModel

from engine.messages import StartSession
from workers.chunk_driver import ChunkDriver
from workers.demo import scenes
from workers.demo.codec import LinearVideoCodec
from workers.demo.evaluate import evaluate
from workers.demo.objective import TeacherForcing
from workers.demo.train import TINY, Trainer
from workers.pipelines.base import BatchRow, StepBatch
from workers.pipelines.causal_wan import build
from workers.pipelines.presets import load_directory

RED, BLUE = "a red circle moving right", "a blue square moving left"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny run of 3 steps, checkpointed and exported."""
    out = tmp_path_factory.mktemp("demo")
    trainer = Trainer(TINY, out, torch.device("cpu"))
    trainer.start(resume=False)
    trainer.run(steps=3, checkpoint_minutes=60, log_every=1)
    return out, trainer


def test_a_run_writes_a_checkpoint_and_a_servable_model_directory(trained):
    out, trainer = trained
    assert trainer.step == 3
    assert (out / "checkpoint.pt").is_file() and (out / "codec" / "config.json").is_file()
    components = load_directory(out / "model", torch.float32)
    assert isinstance(components.vae, LinearVideoCodec)
    assert components.default_size == (TINY.size, TINY.size)
    assert (components.sink_frames, components.window_frames) == (0, 3 * (TINY.chunks - 1))
    for name, tensor in trainer.transformer.state_dict().items():
        assert torch.equal(components.transformer.state_dict()[name], tensor), name


def test_the_model_directory_generates_chunks_through_the_served_pipeline(trained):
    out, _ = trained
    pipeline = build(model_dir=str(out / "model"), device="cpu")
    driver = ChunkDriver(pipeline)
    driver.open(StartSession(session_id="s", prompt=RED))
    first, second = driver.run_chunk("s"), driver.run_chunk("s", prompt=BLUE)
    assert (first.num_frames, second.num_frames) == (9, 12)
    assert (first.width, first.height) == (TINY.size, TINY.size)
    assert len(first.payload) == 9 * TINY.size * TINY.size * 3
    driver.release("s")


def test_a_killed_run_resumes_where_its_checkpoint_left_it(trained, tmp_path):
    """Resuming from step 3's checkpoint and training to 5 equals an uninterrupted run to 5."""
    out, _ = trained
    resumed_dir = tmp_path / "resumed"
    resumed_dir.mkdir()
    for name in ("checkpoint.pt", "train.json"):
        (resumed_dir / name).write_bytes((out / name).read_bytes())
    LinearVideoCodec.from_pretrained(out / "codec").save_pretrained(resumed_dir / "codec")
    resumed = Trainer(TINY, resumed_dir, torch.device("cpu"))
    resumed.start(resume=True)
    assert resumed.step == 3
    resumed.run(steps=5, checkpoint_minutes=60, log_every=1)

    straight = Trainer(TINY, tmp_path / "straight", torch.device("cpu"))
    straight.start(resume=False)
    straight.run(steps=5, checkpoint_minutes=60, log_every=1)
    for name, tensor in straight.transformer.state_dict().items():
        assert torch.allclose(resumed.transformer.state_dict()[name], tensor, atol=1e-6), name


def test_resume_refuses_another_config(trained):
    out, _ = trained
    with pytest.raises(SystemExit, match="another config"):
        Trainer(dataclasses.replace(TINY, lr=1.0), out, torch.device("cpu")).start(resume=True)


def test_training_predicts_what_the_served_pipeline_predicts_chunk_by_chunk(trained):
    """Chunk 0 committed under one caption, chunk 1 denoised under another through
    the KV cache (the served stages), equals chunk 1's prediction in training's one
    block-causal forward over [clean 0, noisy 0, noisy 1] with per-chunk captions."""
    out, _ = trained
    pipeline = build(model_dir=str(out / "model"), device="cpu")
    driver = ChunkDriver(pipeline)
    [state] = driver.open(StartSession(session_id="s", prompt=RED))
    driver.run_chunk("s")
    clean0 = state.cached_chunks[-1].clone()
    pipeline.boundary(state, 1, prompt=pipeline.encode_prompt(BLUE))
    noisy1 = state.chunks[1].latent.clone()
    with torch.no_grad():
        [served] = pipeline.forward(StepBatch((BatchRow("s", 1, 0),)), [state])

    model = WanTransformer3DModel.from_pretrained(out / "model" / "transformer")
    teacher = TeacherForcing(model, scenes.LATENT_FRAMES_PER_CHUNK)
    text = torch.cat([pipeline.encode_prompt(RED), pipeline.encode_prompt(BLUE)], dim=1)

    def predict(captions: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return teacher.predict(
                clean=torch.cat([clean0, torch.zeros_like(clean0)], dim=2),
                noisy=torch.cat([torch.randn_like(clean0), noisy1], dim=2),
                timesteps=torch.tensor([[500.0, state.timesteps[0]]]),
                text=text,
                caption_of_chunk=torch.tensor([captions]),
                text_length=TINY.text_length,
            )[:, :, 3:]

    assert (predict([0, 1]) - served).abs().max().item() <= 1e-4
    assert (predict([0, 0]) - served).abs().max().item() > 1e-3  # the chunk's own caption is what counts
    driver.release("s")


def test_the_evaluation_judges_every_chunk_the_served_pipeline_makes(trained):
    """``rtvideo eval-demo``'s path on the exported directory: switched and long
    streams, several sessions a forward; every figure a fraction, every bar judged."""
    out, _ = trained
    summary = evaluate(str(out / "model"), trials=3, chunks=2, switch_at=1, long_streams=1, long_chunks=4, rows=2)
    assert summary["chunks_judged"] == 3 * 2 + 4 and summary["trained_steps"] == 3
    for name in ("colour", "shape", "direction", "switch", "presence", "steady", "long_colour"):
        assert 0.0 <= summary[name] <= 1.0, name
    assert all(bar["passes"] in (True, False) for bar in summary["bars"].values())
    assert summary["long_window"] == [3, 3]
