"""The demo model's training loop end to end, on a tiny configuration (seconds):
train, checkpoint, resume, export a model directory, load it through the real
loading path and generate through the real pipeline; and training's forward
equals the served chunk-by-chunk forward."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from diffusers import WanTransformer3DModel

from rtvideo.engine.messages import StartSession
from rtvideo.training.demo import scenes
from rtvideo.training.demo.evaluate import evaluate
from rtvideo.training.demo.objective import TeacherForcing
from rtvideo.training.demo.train import BEFORE_FIELD, TINY, Trainer, draw_self_context
from rtvideo.workers.chunk_driver import ChunkDriver
from rtvideo.workers.demo.codec import LinearVideoCodec
from rtvideo.workers.pipelines.base import BatchRow, StepBatch
from rtvideo.workers.pipelines.causal_wan import build
from rtvideo.workers.pipelines.presets import load_directory

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
    for name in ("colour", "shape", "direction", "switch", "presence", "steady", "long_colour", "long_shape"):
        assert 0.0 <= summary[name] <= 1.0, name
    assert all(bar["passes"] in (True, False) for bar in summary["bars"].values())
    assert summary["long_window"] == [3, 3]


def test_training_predicts_what_the_served_pipeline_predicts_past_its_rolling_window(trained, tmp_path):
    """A model served with a window of one chunk (``window_chunks=1``: 3 latent frames),
    four chunks in: chunk 3's served prediction (its cache holds chunk 2 alone, whose
    keys were committed attending to chunk 1, and chunk 1's to chunk 0) equals
    training's windowed forward over the whole clip; without the window it differs."""
    out, _ = trained
    pipeline = build(model_dir=str(out / "model"), device="cpu")
    assert pipeline.window_frames == 3 * TINY.window_chunks == 3
    driver = ChunkDriver(pipeline)
    [state] = driver.open(StartSession(session_id="s", prompt=RED))
    committed = []
    for chunk in range(3):
        driver.run_chunk("s", prompt=BLUE if chunk == 2 else None)
        committed.append(state.cached_chunks[-1].clone())
    pipeline.boundary(state, 3)
    noisy3 = state.chunks[3].latent.clone()
    with torch.no_grad():
        [served] = pipeline.forward(StepBatch((BatchRow("s", 3, 0),)), [state])
    driver.release("s")

    model = WanTransformer3DModel.from_pretrained(out / "model" / "transformer")
    text = torch.cat([pipeline.encode_prompt(RED), pipeline.encode_prompt(BLUE)], dim=1)

    def predict(window: int | None) -> torch.Tensor:
        teacher = TeacherForcing(model, scenes.LATENT_FRAMES_PER_CHUNK, window)
        with torch.no_grad():
            return teacher.predict(
                clean=torch.cat([*committed, torch.zeros_like(noisy3)], dim=2),
                noisy=torch.cat([torch.randn_like(noisy3)] * 3 + [noisy3], dim=2),
                timesteps=torch.tensor([[500.0, 500.0, 500.0, state.timesteps[0]]]),
                text=text,
                caption_of_chunk=torch.tensor([[0, 0, 1, 1]]),
                text_length=TINY.text_length,
            )[:, :, 9:]

    assert (predict(1) - served).abs().max().item() <= 1e-4
    assert (predict(None) - served).abs().max().item() > 1e-3  # the window is what makes it equal


def test_the_objective_attends_to_the_context_it_is_given_and_targets_the_clean_chunks(trained):
    """``loss(context=...)``: the clean chunks attended to are ``context``'s, the
    targets ``clean``'s; without it (teacher forcing) the context is ``clean``."""
    _, trainer = trained
    teacher = trainer.teacher
    generator = torch.Generator().manual_seed(1)
    shape = (1, 16, 3 * TINY.chunks, TINY.size // 8, TINY.size // 8)
    clean, noise, context = (torch.randn(shape, generator=generator) for _ in range(3))
    timesteps, captions = torch.tensor([[625.0, 833.0]]), torch.tensor([[0, 1]])
    text = torch.randn(1, 2 * TINY.text_length, TINY.text_dim, generator=generator)
    weight = torch.ones(1, TINY.chunks)
    args = (timesteps, text, captions, TINY.text_length, weight)
    with torch.no_grad():
        forced = teacher.loss(clean, noise, *args)
        assert torch.equal(forced, teacher.loss(clean, noise, *args, context=clean))
        given = teacher.loss(clean, noise, *args, context=context)
        sigma = (timesteps / 1000.0).repeat_interleave(3, dim=1)[:, None, :, None, None]
        noisy = (1 - sigma) * clean + sigma * noise
        prediction = teacher.predict(context, noisy, timesteps, text, captions, TINY.text_length)
    assert torch.allclose(given, ((prediction - (noise - clean)) ** 2).mean(), atol=1e-6)
    assert not torch.allclose(given, forced)


def test_own_context_is_the_models_denoised_chunks_where_drawn_and_ground_truth_elsewhere(trained):
    """The clips ``draw_self_context`` picks attend to ``denoise``'s chunks (the served
    sampler's last level), except a first chunk outside the loss; the others to the
    ground truth."""
    _, trainer = trained
    config = dataclasses.replace(TINY, batch=4, self_context=0.5)
    trainer.config = config
    try:
        step = next(s for s in range(100) if 0 < int(draw_self_context(config, s, (4,))[0].sum()) < 4)
        trainer.step = step
        chosen, noise = draw_self_context(config, step, (4, 16, 6, 4, 4))
        clean = torch.randn(4, 16, 6, 4, 4, generator=torch.Generator().manual_seed(2))
        text = torch.randn(4, 2 * TINY.text_length, TINY.text_dim)
        captions = torch.zeros(4, 2, dtype=torch.long)
        weight = torch.tensor([[0.0, 1.0], [1.0, 1.0], [0.0, 1.0], [1.0, 1.0]])
        context = trainer.own_context(clean, text, captions, weight)
        made = trainer.teacher.denoise(clean, noise, 625.0, text, captions, TINY.text_length)
    finally:
        trainer.config, trainer.step = TINY, 3
    for row in range(4):
        for chunk, frames in enumerate((slice(0, 3), slice(3, 6))):
            expected = made if chosen[row] and weight[row, chunk] > 0 else clean
            assert torch.allclose(context[row, :, frames], expected[row, :, frames], atol=1e-5), (row, chunk)


def test_a_run_initialised_from_another_starts_from_its_weights_and_codec(trained, tmp_path):
    out, source = trained
    trainer = Trainer(TINY, tmp_path / "fine", torch.device("cpu"))
    trainer.start(resume=False, init_from=out)
    for name, tensor in source.transformer.state_dict().items():
        assert torch.equal(trainer.transformer.state_dict()[name], tensor), name
    for name, tensor in source.text_encoder.state_dict().items():
        assert torch.equal(trainer.text_encoder.state_dict()[name], tensor), name
    assert torch.equal(trainer.codec.decoder.basis, LinearVideoCodec.from_pretrained(out / "codec").decoder.basis)
    assert trainer.step == 0 and trainer.init == {"from": str(out.resolve()), "step": 3}
    trainer.run(steps=1, checkpoint_minutes=60, log_every=1)
    demo = json.loads((tmp_path / "fine" / "model" / "rtvideo.json").read_text())["demo"]
    assert demo["trained_steps"] == 3 + 1 and demo["initialised_from"]["step"] == 3

    resumed = Trainer(TINY, tmp_path / "fine", torch.device("cpu"))
    resumed.start(resume=True)
    assert resumed.step == 1 and resumed.init == trainer.init

    snapshot = Trainer(TINY, tmp_path / "from-model", torch.device("cpu"))  # from the servable directory alone
    snapshot.start(resume=False, init_from=out / "model")
    for name, tensor in source.transformer.state_dict().items():
        assert torch.equal(snapshot.transformer.state_dict()[name], tensor), name
    assert torch.equal(snapshot.codec.decoder.basis, trainer.codec.decoder.basis)
    assert snapshot.init["step"] == 3


def test_a_run_recorded_before_the_window_and_self_context_resumes_with_their_old_meaning(trained, tmp_path):
    """A ``train.json`` without ``window_chunks`` / ``self_context`` meant a window of 3
    and teacher forcing only: it resumes with those, and is refused the new defaults."""
    out, _ = trained
    old = dataclasses.replace(TINY, chunks=4, window_chunks=3, self_context=0.0)
    recorded = {k: v for k, v in dataclasses.asdict(old).items() if k not in BEFORE_FIELD}
    (tmp_path / "train.json").write_text(json.dumps(recorded))
    (tmp_path / "checkpoint.pt").write_bytes((out / "checkpoint.pt").read_bytes())
    LinearVideoCodec.from_pretrained(out / "codec").save_pretrained(tmp_path / "codec")
    Trainer(old, tmp_path, torch.device("cpu")).start(resume=True)
    with pytest.raises(SystemExit, match="another config"):
        Trainer(dataclasses.replace(old, self_context=0.5), tmp_path, torch.device("cpu")).start(resume=True)


def test_the_config_refuses_a_window_the_clip_cannot_exercise():
    with pytest.raises(ValueError, match="window_chunks"):
        dataclasses.replace(TINY, window_chunks=TINY.chunks)
    with pytest.raises(ValueError, match="self_context"):
        dataclasses.replace(TINY, self_context=1.5)
