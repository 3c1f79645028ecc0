"""Model components: the ``tiny`` preset, loading a model directory, saving one.

Worker process (and ``rtvideo convert``). Nothing here ever touches the
network: the tiny preset is random weights from a fixed seed with a byte-level
tokenizer, and a model directory is read with ``local_files_only``.

A model directory has the Wan2.1 diffusers layout: ``transformer/`` (the
causal generator, converted by ``rtvideo convert``), ``vae/``,
``text_encoder/`` (UMT5) and ``tokenizer/``, and optionally ``rtvideo.json``
with what the layout has no place for: ``text_length``, ``default_size`` and
the attention span the generator was trained with, ``sink_frames`` and
``window_frames`` (Self-Forcing's when absent), and a demo model's ``demo``
(its trained steps, and the prompts it knows: ``demo_prompts``, which the
worker passes on for clients to suggest, and which the pipeline conditions
any other prompt as the nearest of: ``conditioning.nearest_known``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from diffusers import AutoencoderKLWan, WanTransformer3DModel
from transformers import AutoTokenizer, ByT5Tokenizer, UMT5Config, UMT5EncoderModel
from transformers.utils import logging as hf_logging

from rtvideo.engine.config import MODEL_DIR_PARTS
from rtvideo.engine.limits import MAX_SEED

COMPONENTS = MODEL_DIR_PARTS  # the folders a model directory needs (the API process checks them at start too)

# Self-Forcing's attention span, the one it is trained on, in latent frames: a chunk attends to 21, its own 3 and
# the 18 the KV cache holds, which are 3 sinks (the stream's first frames) and a rolling window of the 15 latest.
SELF_FORCING_SINK_FRAMES = 3
SELF_FORCING_WINDOW_FRAMES = 15

TINY_TRANSFORMER = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=2,
    attention_head_dim=12,
    in_channels=16,
    out_channels=16,
    text_dim=32,
    freq_dim=32,
    ffn_dim=48,
    num_layers=2,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    eps=1e-6,
    image_dim=None,
    added_kv_proj_dim=None,
    rope_max_seq_len=1024,
)
TINY_VAE = dict(base_dim=4, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=1, temperal_downsample=[False, True, True])
TINY_TEXT = dict(
    vocab_size=384,
    d_model=32,
    d_kv=8,
    d_ff=64,
    num_layers=2,
    num_heads=4,
    relative_attention_num_buckets=8,
    feed_forward_proj="gated-gelu",
)

# The Wan2.1-T2V-1.3B transformer (for random-weight GPU measurements).
WAN_1_3B_TRANSFORMER = dict(
    TINY_TRANSFORMER,
    num_attention_heads=12,
    attention_head_dim=128,
    text_dim=4096,
    freq_dim=256,
    ffn_dim=8960,
    num_layers=30,
)


@dataclass
class Components:
    transformer: WanTransformer3DModel
    vae: AutoencoderKLWan  # or the demo model's LinearVideoCodec (same decode interface)
    text_encoder: UMT5EncoderModel
    tokenizer: Any
    text_length: int  # tokens per prompt (padded)
    default_size: tuple[int, int]  # width, height
    # The KV cache a chunk attends to besides itself, in latent frames: the span the weights were trained with.
    sink_frames: int = SELF_FORCING_SINK_FRAMES
    window_frames: int = SELF_FORCING_WINDOW_FRAMES
    tiny_decoder: str | None = None  # the tiny decoder's weights file, where the directory has one
    known_prompts: tuple[str, ...] = ()  # a demo model's prompts (demo_prompts): any other is drawn as the nearest


def build_tiny(seed: int = 0) -> Components:
    """The tiny preset: random weights from ``seed`` (0 to 2^63 - 1); builds in well
    under a second on a CPU."""
    if not 0 <= seed <= MAX_SEED:
        raise ValueError(f"seed must be between 0 and {MAX_SEED}, got {seed}")
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        transformer = WanTransformer3DModel(**TINY_TRANSFORMER)
        vae = AutoencoderKLWan(**TINY_VAE)
        text_encoder = UMT5EncoderModel(UMT5Config(**TINY_TEXT))
    finally:
        torch.random.set_rng_state(generator_state)
    return Components(
        transformer,
        vae,
        text_encoder,
        ByT5Tokenizer(),
        text_length=64,
        default_size=(64, 64),
        sink_frames=SELF_FORCING_SINK_FRAMES,
        window_frames=SELF_FORCING_WINDOW_FRAMES,
    )


def load_directory(path: str | Path, dtype: torch.dtype) -> Components:
    """Load a model directory offline; ``ValueError`` names what is missing or broken."""
    root = Path(path)
    if not root.is_dir():
        raise ValueError(f"model directory {str(root)!r} does not exist")
    missing = [name for name in COMPONENTS if not (root / name).is_dir()]
    if missing:
        raise ValueError(f"model directory {str(root)!r} lacks {', '.join(f'{m}/' for m in missing)}")
    for name in ("transformer", "vae", "text_encoder"):
        if not (root / name / "config.json").is_file():
            raise ValueError(f"model directory {str(root)!r}: {name}/config.json is missing")
    # No "Loading weights" bar: a worker's log is not a terminal, and the bar's
    # tqdm lock is a multiprocessing semaphore that a worker (which ends with
    # os._exit) would leave for the resource tracker to report as leaked.
    hf_logging.disable_progress_bar()
    try:
        transformer = WanTransformer3DModel.from_pretrained(
            root, subfolder="transformer", torch_dtype=dtype, local_files_only=True
        )
        vae = _vae_class(root).from_pretrained(root, subfolder="vae", torch_dtype=torch.float32, local_files_only=True)
        text_encoder = UMT5EncoderModel.from_pretrained(
            root, subfolder="text_encoder", torch_dtype=dtype, local_files_only=True
        )
        tokenizer = AutoTokenizer.from_pretrained(root, subfolder="tokenizer", local_files_only=True)
    except (OSError, ValueError, KeyError) as error:
        raise ValueError(f"model directory {str(root)!r} could not be loaded: {error}") from error
    extra = _read_rtvideo_json(root)
    known = demo_prompts(root)  # checked while loading, so a malformed list fails the build and says why
    return Components(
        transformer,
        vae,
        text_encoder,
        tokenizer,
        text_length=int(extra.get("text_length", 512)),
        default_size=tuple(extra.get("default_size", (832, 480))),
        sink_frames=_frames(extra, "sink_frames", SELF_FORCING_SINK_FRAMES, root),
        window_frames=_frames(extra, "window_frames", SELF_FORCING_WINDOW_FRAMES, root),
        tiny_decoder=_tiny_decoder_file(extra, root),
        known_prompts=known,
    )


def _tiny_decoder_file(extra: dict, root: Path) -> str | None:
    """The tiny decoder's weights of a model directory: ``rtvideo.json``'s
    ``tiny_decoder`` (a path, relative to the directory or absolute), else
    ``tiny_decoder/`` as ``rtvideo convert --tiny-decoder`` writes it, else None."""
    from rtvideo.workers.pipelines.tiny_decoder import WEIGHTS_NAME

    named = extra.get("tiny_decoder")
    if named is None:
        default = root / WEIGHTS_NAME
        return str(default) if default.is_file() else None
    if not isinstance(named, str):
        raise ValueError(f"{root / 'rtvideo.json'}: tiny_decoder must be a path, got {named!r}")
    path = root / named
    if not path.is_file():
        raise ValueError(f"{root / 'rtvideo.json'}: tiny_decoder {named!r}: no such file ({path})")
    return str(path)


def _vae_class(root: Path) -> type:
    """The class ``vae/config.json`` names: the demo model's ``LinearVideoCodec``
    (which presents the decode interface of ``AutoencoderKLWan``), else ``AutoencoderKLWan``."""
    try:
        name = json.loads((root / "vae" / "config.json").read_text()).get("_class_name")
    except json.JSONDecodeError as error:
        raise ValueError(f"model directory {str(root)!r}: vae/config.json is not valid JSON: {error}") from error
    if name == "LinearVideoCodec":
        from rtvideo.workers.demo.codec import LinearVideoCodec

        return LinearVideoCodec
    return AutoencoderKLWan


def save_directory(components: Components, path: str | Path) -> None:
    """Write ``components`` as a model directory ``load_directory`` reads back."""
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    components.transformer.save_pretrained(root / "transformer")
    components.vae.save_pretrained(root / "vae")
    drawing = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # transformers draws "Writing model shards" whatever stderr is
    try:
        components.text_encoder.save_pretrained(root / "text_encoder")
    finally:
        if drawing:
            hf_logging.enable_progress_bar()
    components.tokenizer.save_pretrained(root / "tokenizer")
    write_rtvideo_json(
        root,
        text_length=components.text_length,
        default_size=list(components.default_size),
        sink_frames=components.sink_frames,
        window_frames=components.window_frames,
    )


def write_rtvideo_json(root: str | Path, **settings: Any) -> Path:
    """Set ``settings`` in ``root/rtvideo.json``, keeping the keys it already has."""
    file = Path(root) / "rtvideo.json"
    merged = {**_read_rtvideo_json(Path(root)), **settings}
    file.write_text(json.dumps(merged, indent=2) + "\n")
    return file


def demo_prompts(path: str | Path) -> tuple[str, ...]:
    """The prompts a model directory says its model knows (``rtvideo.json``'s
    ``demo.prompts``, which ``rtvideo train-demo`` writes), for clients to
    suggest; () when it names none. ``ValueError`` when they are not strings."""
    root = Path(path)
    prompts = _read_rtvideo_json(root).get("demo", {}).get("prompts", [])
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise ValueError(f"{root / 'rtvideo.json'}: demo.prompts must be a list of strings")
    return tuple(prompts)


def _read_rtvideo_json(root: Path) -> dict:
    file = root / "rtvideo.json"
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{file} is not valid JSON: {error}") from error
    if not isinstance(data, dict):
        raise ValueError(f"{file} must hold a JSON object")
    return data


def _frames(extra: dict, key: str, default: int, root: Path) -> int:
    value = extra.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{root / 'rtvideo.json'}: {key} must be a whole number of latent frames, got {value!r}")
    return value
