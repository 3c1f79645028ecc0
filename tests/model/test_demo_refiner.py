"""The demo codec's causal refiner (``rtvideo.workers.demo.codec``, trained by
``rtvideo.training.demo.refine``): a streamed decode through the served pipeline's
``StreamingDecoder`` equals a one-shot decode, an untrained refiner decodes as
the linear inverse does, and training puts back the motion inside a latent
frame that the linear inverse loses."""

from __future__ import annotations

import collections
import json
import shutil

import numpy as np
import pytest
import torch

from rtvideo.training.demo import metrics
from rtvideo.training.demo.metrics import _distance, circular_centroid, foreground
from rtvideo.training.demo.refine import main as refine_main
from rtvideo.training.demo.refine import refined_copy, streamed_decode, train
from rtvideo.workers.demo import WEIGHTS
from rtvideo.workers.demo.codec import LinearVideoCodec
from rtvideo.workers.pipelines.vae_stream import StreamingDecoder


@pytest.fixture(scope="module")
def linear() -> LinearVideoCodec:
    codec = LinearVideoCodec.from_pretrained(WEIGHTS, subfolder="vae", torch_dtype=torch.float32, local_files_only=True)
    return refined_copy(codec, 0)  # the linear inverse, whatever the shipped directory holds


def stream(chunks: int = 3) -> tuple[np.ndarray, torch.Tensor]:
    """A ground-truth stream of a moving object: frames uint8, and as [1, 3, F, H, W] in [-1, 1]."""
    [trial] = metrics.long_trials(1, chunks)
    frames = np.concatenate(metrics.ground_truth(trial, 64))
    return frames, torch.from_numpy(frames).float().permute(3, 0, 1, 2)[None] / 127.5 - 1


def to_uint8(pixels: torch.Tensor) -> np.ndarray:
    return ((pixels[0].permute(1, 2, 3, 0).clamp(-1, 1).numpy() + 1) * 127.5).round().astype(np.uint8)


def motion_by_phase(frames: np.ndarray) -> dict[int, float]:
    """Mean centroid displacement (px) of the frame pairs by their place in the latent
    frames: 0 for the pair that crosses from one latent frame to the next."""
    centres = [circular_centroid(mask) for mask in foreground(frames)]
    phases = collections.defaultdict(list)
    for f in range(1, len(centres)):
        phases[(f - 1) % 4].append(_distance(centres[f - 1], centres[f], 64, 64))
    return {phase: float(np.mean(d)) for phase, d in phases.items()}


def test_a_streamed_decode_with_the_refiner_equals_a_one_shot_decode(linear):
    codec = refined_copy(linear, 16)
    torch.manual_seed(0)
    for parameter in codec.decoder.refiner.parameters():  # a refiner that changes every block
        parameter.data.normal_(0, 0.05)
    _, pixels = stream()
    with torch.no_grad():
        latents = codec.encode_frames(pixels, first=True)  # 9 latent frames: 3 chunks
        whole = codec.decode(latents * codec.decoder.std.view(1, -1, 1, 1, 1), return_dict=False)[0]
        served = StreamingDecoder(codec)
        cache = served.new_cache()
        assert len(cache) == 1 and served.cache_bytes(8, 8) == 16 * 8 * 8 * 4  # one latent frame of the refiner
        parts = [served.decode(latents[:, :, i : i + 3], cache, first=i == 0) for i in range(0, 9, 3)]
    assert torch.allclose(torch.cat(parts, dim=2), whole, atol=1e-5)
    assert not torch.allclose(whole, linear.decode(latents * codec.decoder.std.view(1, -1, 1, 1, 1))["sample"])


def test_an_untrained_refiner_decodes_as_the_linear_inverse(linear):
    _, pixels = stream(1)
    fresh = refined_copy(linear, 8)
    with torch.no_grad():
        latents = linear.encode_frames(pixels, first=True)
        assert torch.equal(streamed_decode(fresh, latents, True), streamed_decode(linear, latents, True))


def test_training_puts_back_the_motion_inside_a_latent_frame(linear):
    """The scenes move the object 1 px a frame. The linear inverse moves it about
    half that inside a latent frame and jumps the rest at the next; a briefly
    trained refiner (a test's budget: 100 small steps) already decodes the stream
    closer to its frames, with a smaller jump and more motion inside the latent
    frames (the shipped one, trained for longer: docs/DEMO_MODEL.md)."""
    frames, pixels = stream(4)
    with torch.no_grad():
        latents = linear.encode_frames(pixels, first=True)
        plain = streamed_decode(linear, latents, True).clamp(-1, 1)
    refined, _ = train(linear, steps=100, width=64, batch=4, lr=3e-3, log_every=0)
    with torch.no_grad():
        better = streamed_decode(refined, latents, True).clamp(-1, 1)
    assert motion_by_phase(frames) == pytest.approx({0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0})
    before, after = motion_by_phase(to_uint8(plain)), motion_by_phase(to_uint8(better))
    assert before[0] > 2.0 and np.mean([before[1], before[2], before[3]]) < 0.7  # damped, then the jump
    assert after[0] < before[0] - 0.15
    assert np.mean([after[1], after[2], after[3]]) > np.mean([before[1], before[2], before[3]])
    assert ((better - pixels) ** 2).mean() < 0.9 * ((plain - pixels) ** 2).mean()


def test_the_command_writes_a_refined_decoder_the_serving_loader_reads(tmp_path):
    model = tmp_path / "model"
    shutil.copytree(WEIGHTS, model)
    assert refine_main(["--model", str(model), "--steps", "2", "--width", "8"]) == 0
    recorded = json.loads((model / "rtvideo.json").read_text())["demo"]["decoder"]
    assert (recorded["refiner_width"], recorded["steps"]) == (8, 2)
    from rtvideo.workers.pipelines.causal_wan import build

    pipeline = build(model_dir=str(model), device="cpu")
    assert pipeline.vae.decoder.refiner is not None and pipeline.vae.config.refiner_width == 8
