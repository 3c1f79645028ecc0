"""``rtvideo train-demo``: train the demo model, resumably, into a servable model directory.

Runs in the process of its command (the CLI imports it for ``train-demo`` only), on a CPU or a GPU.
Everything is a function of the seed: the codec is fitted to clips
of the seed's ``CODEC_FIT`` stream, step ``s`` trains on clips ``clip_for(seed, s * batch
+ i)`` with noise and noise levels drawn from a generator seeded by (seed, s),
so a resumed run sees exactly the data an uninterrupted one would.

``OUT`` holds:

- ``checkpoint.pt``: transformer, text encoder, optimizer, step, RNG states
  and the training config, written atomically (a temporary file, then
  ``os.replace``) every ``--checkpoint-minutes`` and at the end;
- ``model/``: a model directory ``rtvideo serve --model OUT/model`` loads
  (``transformer/``, ``vae/`` (the ``LinearVideoCodec``), ``text_encoder/``,
  ``tokenizer/``, ``rtvideo.json``), replaced at every checkpoint;
- ``train.json``: the config, checked against ``--resume``'s; ``codec/``: the
  codec fitted at the start (a resumed run reads it back), or the one of the
  run ``--init-from`` named: a run initialised from another's weights starts
  from its transformer, text encoder and codec (its latent space), with a new
  optimizer, at step 0; ``init.json`` records that run and its step, and the
  exported ``trained_steps`` count both runs' steps.

The recipe, beyond teacher forcing: clips of ``chunks`` chunks attend through
a rolling window of ``window_chunks`` (the served cache's), and in
``self_context`` of the clips the chunks attended to are the model's own
(``TeacherForcing.denoise`` at the served sampler's last noise level), since
a served chunk only ever attends to chunks the model made.

The log (stdout) has one JSON line every ``--log-every`` steps: the step, the
mean loss since the last line, seconds per step.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from diffusers import WanTransformer3DModel
from transformers import ByT5Tokenizer, UMT5EncoderModel

from rtvideo.engine.progress import Progress
from rtvideo.training.demo import scenes
from rtvideo.training.demo.config import BEFORE_FIELD, TINY, TrainConfig
from rtvideo.training.demo.objective import TeacherForcing
from rtvideo.workers.demo.codec import LinearVideoCodec
from rtvideo.workers.pipelines.causal_wan import self_forcing_timesteps
from rtvideo.workers.pipelines.presets import Components, save_directory, write_rtvideo_json


def _to_pixels(frames: np.ndarray) -> torch.Tensor:
    """uint8 ``[frames, H, W, 3]`` -> float ``[1, 3, frames, H, W]`` in [-1, 1]."""
    return torch.from_numpy(frames).float().permute(3, 0, 1, 2).unsqueeze(0) / 127.5 - 1.0


def fit_codec(config: TrainConfig) -> LinearVideoCodec:
    """The codec, fitted to ``codec_fit_clips`` clips of the seed's ``CODEC_FIT`` stream."""
    codec = LinearVideoCodec(z_dim=config.latent_channels, spatial=8, temporal=scenes.TEMPORAL_RATIO)
    groups = []
    for i in range(config.codec_fit_clips):
        clip = scenes.clip_for(config.seed, i, config.size, config.size, config.chunks, stream=scenes.CODEC_FIT)
        pixels = _to_pixels(scenes.render(clip, config.size, config.size))
        if clip.first_chunk == 0:
            pixels = torch.cat([pixels[:, :, :1].expand(-1, -1, scenes.TEMPORAL_RATIO - 1, -1, -1), pixels], dim=2)
        t = scenes.TEMPORAL_RATIO
        groups.append(pixels.unflatten(2, (-1, t)).permute(0, 2, 1, 3, 4, 5).flatten(0, 1))
    codec.fit(torch.cat(groups))
    return codec


@dataclass
class Batch:
    latents: torch.Tensor  # [batch, C, 3N, h, w], whitened
    captions: list[tuple[int, int]]  # per clip: (caption index of its first chunk, of its last)
    caption_of_chunk: torch.Tensor  # [batch, N]: 0 = the first caption, 1 = the last
    weight: torch.Tensor  # [batch, N]: 0 for a clip's first chunk when the clip does not begin a stream


def make_batch(config: TrainConfig, codec: LinearVideoCodec, step: int) -> Batch:
    """Step ``step``'s clips, rendered and encoded."""
    latents, captions, which, weight = [], [], [], []
    for i in range(config.batch):
        clip = scenes.clip_for(
            config.seed,
            step * config.batch + i,
            config.size,
            config.size,
            config.chunks,
            switch_probability=config.switch_probability,
            stream_start_probability=config.stream_start_probability,
        )
        pixels = _to_pixels(scenes.render(clip, config.size, config.size))
        latents.append(codec.encode_frames(pixels, first=clip.first_chunk == 0))
        first, last = clip.attributes[0], clip.attributes[-1]
        captions.append((scenes.CAPTIONS.index(first.caption), scenes.CAPTIONS.index(last.caption)))
        which.append([0 if a == first else 1 for a in clip.attributes])
        weight.append([0.0 if c == 0 and clip.first_chunk > 0 else 1.0 for c in range(config.chunks)])
    return Batch(torch.cat(latents), captions, torch.tensor(which), torch.tensor(weight))


def draw_noise(config: TrainConfig, step: int, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """(noise ``shape``, timesteps ``[batch, N]``) of step ``step``, from a generator seeded by (seed, step)."""
    generator = torch.Generator().manual_seed(config.seed * 1_000_003 + step)
    noise = torch.randn(shape, generator=generator)
    schedule = torch.tensor(self_forcing_timesteps(4))
    pick = schedule[torch.randint(len(schedule), (config.batch, config.chunks), generator=generator)]
    u = torch.rand((config.batch, config.chunks), generator=generator).clamp_min(1e-3)
    uniform = 1000.0 * 5.0 * u / (1.0 + 4.0 * u)  # the serving schedule's shift
    use_schedule = torch.rand((config.batch, config.chunks), generator=generator) < config.schedule_probability
    return noise, torch.where(use_schedule, pick, uniform)


def draw_self_context(config: TrainConfig, step: int, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """(which clips of step ``step`` attend to the model's own chunks ``[batch]`` bool, the
    noise those are denoised from ``shape``), from a generator of their own (seed, step)."""
    offset = 500_000_000_000  # keeps these seeds apart from ``draw_noise``'s (seed * 1_000_003 + step)
    generator = torch.Generator().manual_seed(config.seed * 1_000_003 + step + offset)
    chosen = torch.rand(config.batch, generator=generator) < config.self_context
    return chosen, torch.randn(shape, generator=generator)


class Trainer:
    """The models, the optimizer and the step; ``run`` trains, checkpoints and exports."""

    def __init__(self, config: TrainConfig, out: Path, device: torch.device) -> None:
        self.config, self.out, self.device = config, out, device
        torch.manual_seed(config.seed)
        self.transformer = WanTransformer3DModel(**config.transformer_config()).to(device)
        self.text_encoder = UMT5EncoderModel(config.text_config()).to(device)
        self.tokenizer = ByT5Tokenizer()
        self.teacher = TeacherForcing(self.transformer, scenes.LATENT_FRAMES_PER_CHUNK, config.window_chunks)
        parameters = [*self.transformer.parameters(), *self.text_encoder.parameters()]
        self.optimizer = torch.optim.AdamW(parameters, lr=config.lr, betas=(0.9, 0.99), weight_decay=0.0)
        tokens = self.tokenizer(
            list(scenes.CAPTIONS),
            padding="max_length",
            max_length=config.text_length,
            truncation=True,
            add_special_tokens=True,
            return_attention_mask=True,
            return_tensors="pt",
        )  # as the pipeline's encode_prompt tokenizes a prompt
        self.ids, self.mask = tokens.input_ids.to(device), tokens.attention_mask.to(device)
        self.step = 0
        self.codec: LinearVideoCodec | None = None
        self.init: dict | None = None  # ``init.json``: the run this one was initialised from, and its step

    # -- state ---------------------------------------------------------------------------

    def start(self, resume: bool, init_from: Path | None = None) -> None:
        """Fit the codec and begin, or load ``checkpoint.pt`` (``resume``); a new run
        with ``init_from`` (another run's OUT) starts from that run's weights and codec."""
        checkpoint = self.out / "checkpoint.pt"
        saved = self.out / "train.json"
        if resume and checkpoint.is_file():
            recorded = {**BEFORE_FIELD, **json.loads(saved.read_text())}
            if recorded != dataclasses.asdict(self.config):
                raise SystemExit(f"{saved} records another config; resume with the same options")
            state = torch.load(checkpoint, map_location="cpu", weights_only=False)
            self.transformer.load_state_dict(state["transformer"])
            self.text_encoder.load_state_dict(state["text_encoder"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.step = state["step"]
            torch.set_rng_state(state["torch_rng"])
            np.random.set_state(state["numpy_rng"])
            self.codec = LinearVideoCodec.from_pretrained(self.out / "codec")
            if (self.out / "init.json").is_file():
                self.init = json.loads((self.out / "init.json").read_text())
            return
        if checkpoint.is_file():
            raise SystemExit(f"{checkpoint} exists: pass --resume to continue it, or choose another --out")
        self.out.mkdir(parents=True, exist_ok=True)
        saved.write_text(json.dumps(dataclasses.asdict(self.config), indent=2) + "\n")
        if init_from is not None:
            self.initialise_from(init_from)
        else:
            self.codec = fit_codec(self.config)  # on the CPU, where the clips are rendered and encoded
        self.codec.save_pretrained(self.out / "codec")

    def initialise_from(self, source: Path) -> None:
        """Take the transformer, text encoder and codec of the run in ``source`` (an OUT
        directory: its ``checkpoint.pt`` and ``codec/``), or of a model directory a run
        wrote (its ``transformer/``, ``text_encoder/``, ``vae/``: a snapshot kept
        without the optimizer); the shapes must match."""
        if (source / "checkpoint.pt").is_file():
            state = torch.load(source / "checkpoint.pt", map_location="cpu", weights_only=False)
            self.transformer.load_state_dict(state["transformer"])
            self.text_encoder.load_state_dict(state["text_encoder"])
            self.codec = LinearVideoCodec.from_pretrained(source / "codec")
            step = int(state["step"])
        else:
            from rtvideo.workers.pipelines.presets import load_directory

            components = load_directory(source, torch.float32)
            self.transformer.load_state_dict(components.transformer.state_dict())
            self.text_encoder.load_state_dict(components.text_encoder.state_dict())
            self.codec = components.vae
            step = int(json.loads((source / "rtvideo.json").read_text())["demo"]["trained_steps"])
        self.init = {"from": str(source.resolve()), "step": step}
        (self.out / "init.json").write_text(json.dumps(self.init, indent=2) + "\n")

    def save(self) -> None:
        """Write ``checkpoint.pt`` atomically, then replace ``model/``."""
        state = {
            "transformer": self.transformer.state_dict(),
            "text_encoder": self.text_encoder.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "step": self.step,
            "torch_rng": torch.get_rng_state(),
            "numpy_rng": np.random.get_state(),
            "config": dataclasses.asdict(self.config),
        }
        temporary = self.out / "checkpoint.pt.tmp"
        torch.save(state, temporary)
        os.replace(temporary, self.out / "checkpoint.pt")
        self.export(self.out / "model")

    def export(self, target: Path) -> None:
        """Write the servable model directory ``target`` (built aside, then swapped in)."""
        building, old = target.with_name(target.name + ".tmp"), target.with_name(target.name + ".old")
        shutil.rmtree(building, ignore_errors=True)
        components = Components(
            self.transformer,
            self.codec,
            self.text_encoder,
            self.tokenizer,
            text_length=self.config.text_length,
            default_size=(self.config.size, self.config.size),
            sink_frames=0,  # no sinks: the cache holds the chunks just before, as in training
            window_frames=scenes.LATENT_FRAMES_PER_CHUNK * self.config.window_chunks,
        )
        save_directory(components, building)
        steps = self.step + (self.init["step"] if self.init else 0)
        demo = {"trained_steps": steps, "prompts": list(scenes.CAPTIONS)}
        if self.init:
            demo["initialised_from"] = self.init
        write_rtvideo_json(building, demo=demo)
        shutil.rmtree(old, ignore_errors=True)
        if target.exists():
            os.replace(target, old)
        os.replace(building, target)
        shutil.rmtree(old, ignore_errors=True)

    # -- training ------------------------------------------------------------------------

    def encode_captions(self) -> torch.Tensor:
        """Every caption's embeddings ``[captions, L, text_dim]``, padding rows zeroed (as served)."""
        hidden = self.text_encoder(self.ids, self.mask).last_hidden_state
        return hidden * self.mask.unsqueeze(-1)

    def train_step(self) -> float:
        config = self.config
        batch = make_batch(config, self.codec, self.step)
        clean = batch.latents.to(self.device)
        noise, timesteps = draw_noise(config, self.step, tuple(clean.shape))
        embeds = self.encode_captions()
        pairs = torch.tensor(batch.captions, device=self.device)  # [batch, 2]
        text = embeds[pairs].flatten(1, 2)  # [batch, 2L, text_dim]
        caption_of_chunk, weight = batch.caption_of_chunk.to(self.device), batch.weight.to(self.device)
        for group in self.optimizer.param_groups:
            group["lr"] = config.lr * min(1.0, (self.step + 1) / config.warmup_steps)
        context = self.own_context(clean, text, caption_of_chunk, weight)
        loss = self.teacher.loss(
            clean,
            noise.to(self.device),
            timesteps.to(self.device),
            text,
            caption_of_chunk,
            config.text_length,
            weight,
            context=context,
        )
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        parameters = [*self.transformer.parameters(), *self.text_encoder.parameters()]
        torch.nn.utils.clip_grad_norm_(parameters, config.grad_clip)
        self.optimizer.step()
        self.step += 1
        return float(loss.detach())

    def own_context(
        self, clean: torch.Tensor, text: torch.Tensor, caption_of_chunk: torch.Tensor, weight: torch.Tensor
    ) -> torch.Tensor:
        """The chunks this step's clips attend to: in the clips ``draw_self_context`` picks,
        each chunk the model denoised from the served sampler's last noise level,
        attending to ground truth (not a clip's first chunk when the clip does not
        begin a stream: nothing before it says where its object is); elsewhere, the
        ground truth."""
        chosen, noise = draw_self_context(self.config, self.step, tuple(clean.shape))
        rows = chosen.nonzero().flatten().tolist()
        if not rows:
            return clean
        level = self_forcing_timesteps(4)[-1]
        made = self.teacher.denoise(
            clean[rows],
            noise[rows].to(self.device),
            level,
            text[rows].detach(),
            caption_of_chunk[rows],
            self.config.text_length,
        )
        keep = (weight[rows] == 0).repeat_interleave(scenes.LATENT_FRAMES_PER_CHUNK, dim=1)[:, None, :, None, None]
        context = clean.clone()
        context[rows] = torch.where(keep, clean[rows], made)
        return context

    def run(self, steps: int, checkpoint_minutes: float, log_every: int, progress: Progress | None = None) -> None:
        """Train until step ``steps``; checkpoint every ``checkpoint_minutes``, at the end
        and on SIGTERM / SIGINT (then return). ``progress`` counts the steps; the
        log's lines go through it."""
        progress = progress or Progress.silent()
        progress.expect(steps, done=self.step)
        stop = []
        previous = {s: signal.signal(s, lambda *_: stop.append(True)) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            last_save = time.monotonic()
            losses, since = [], time.monotonic()
            while self.step < steps and not stop:
                losses.append(self.train_step())
                progress.advance()
                if self.step % log_every == 0 or self.step == steps:
                    now = time.monotonic()
                    line = {"step": self.step, "loss": round(float(np.mean(losses)), 5)}
                    line["s_per_step"] = round((now - since) / len(losses), 3)
                    progress.print(json.dumps(line))
                    progress.describe(f"loss {line['loss']}")
                    losses, since = [], now
                if time.monotonic() - last_save >= checkpoint_minutes * 60:
                    progress.describe("saving a checkpoint")
                    self.save()
                    progress.print(json.dumps({"checkpoint": self.step}))
                    last_save = time.monotonic()
            progress.describe("saving a checkpoint")
            self.save()
            progress.print(json.dumps({"checkpoint": self.step, "stopped": bool(stop)}))
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rtvideo train-demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="checkpoints and the model directory (OUT/model)")
    parser.add_argument("--steps", type=int, default=200_000, help="train until this step (default 200000)")
    parser.add_argument("--resume", action="store_true", help="continue OUT/checkpoint.pt")
    parser.add_argument(
        "--init-from", type=Path, default=None, help="a new run starts from this run's (OUT's) weights and codec"
    )
    parser.add_argument("--checkpoint-minutes", type=float, default=5.0)
    parser.add_argument("--log-every", type=int, default=20)
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--tiny", action="store_true", help="the seconds-long test configuration")
    for field in dataclasses.fields(TrainConfig):
        flag = f"--{field.name.replace('_', '-')}"
        parser.add_argument(flag, type=type(field.default), default=None, help=f"(default {field.default})")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    base = TINY if args.tiny else TrainConfig()
    overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)}
    config = dataclasses.replace(base, **{k: v for k, v in overrides.items() if v is not None})
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    with Progress("train-demo", args.steps, unit="step") as progress:
        progress.describe("building the models")
        trainer = Trainer(config, Path(args.out), device)
        progress.describe("fitting the codec, or loading the run to resume")
        trainer.start(args.resume, args.init_from)
        start = {"start_step": trainer.step, "device": str(device), "config": dataclasses.asdict(config)}
        progress.print(json.dumps(start))
        progress.describe("")
        trainer.run(args.steps, args.checkpoint_minutes, args.log_every, progress)
    return 0


if __name__ == "__main__":
    sys.exit(main())
