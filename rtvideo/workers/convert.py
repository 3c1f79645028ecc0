"""``rtvideo convert``: a Self-Forcing / CausVid checkpoint into a diffusers ``transformer/`` folder,
and a tiny decoder's weights into ``tiny_decoder/``.

Runs in the process of its command (the CLI imports it for ``convert`` only). The checkpoint is
read with ``weights_only=True`` (no code is unpickled). Steps: take the
generator (``generator_ema`` by default), strip wrapper prefixes (``model.``,
``_orig_mod.``, FSDP's), rename from the original Wan layout with diffusers'
own ``convert_wan_transformer_to_diffusers`` (which also swaps norm2/norm3),
load into a ``WanTransformer3DModel`` of the given configuration strictly —
any missing or unexpected key is an error that names it — and save it.
It also records the attention span the generator was trained with
(``sink_frames``, ``window_frames``; Self-Forcing's by default) in the
directory's ``rtvideo.json``, keeping any other key already there.

With ``--tiny-decoder FILE`` it also (or only) copies a tiny decoder's
weights (the ``taew2_1`` file, ``rtvideo.workers.pipelines.tiny_decoder``) into the
directory: the decoder's tensors, checked against its layout, saved where a
model directory's tiny decoder is read from, so ``--decoder tiny`` (or a
session's ``decoder``) can use them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from diffusers import WanTransformer3DModel
from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

from rtvideo.engine.progress import Progress
from rtvideo.workers.pipelines.presets import (
    SELF_FORCING_SINK_FRAMES,
    SELF_FORCING_WINDOW_FRAMES,
    TINY_TRANSFORMER,
    WAN_1_3B_TRANSFORMER,
    write_rtvideo_json,
)

CONFIGS = {"wan2.1-1.3b": WAN_1_3B_TRANSFORMER, "tiny": TINY_TRANSFORMER}
CONVERT_STAGES = 4
"""``convert``'s stages, for its progress: read, rename, load, save."""
PREFIXES = ("_fsdp_wrapped_module.", "_orig_mod.", "module.", "model.")


def strip_prefixes(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in state_dict.items():
        changed = True
        while changed:
            changed = False
            for prefix in PREFIXES:
                if key.startswith(prefix):
                    key, changed = key[len(prefix) :], True
            key = key.replace("._fsdp_wrapped_module.", ".").replace("._orig_mod.", ".")
        out[key] = value
    return out


def convert(
    checkpoint: str | Path,
    out_dir: str | Path,
    config: str = "wan2.1-1.3b",
    key: str | None = None,
    sink_frames: int = SELF_FORCING_SINK_FRAMES,
    window_frames: int = SELF_FORCING_WINDOW_FRAMES,
    progress: Progress | None = None,
) -> Path:
    """Convert ``checkpoint`` and save ``out_dir/transformer``; ``ValueError`` says what is wrong.
    ``key`` names the generator entry; by default ``generator_ema``, else
    ``generator`` (a checkpoint saved without EMA weights, as CausVid's are).
    ``sink_frames`` and ``window_frames`` (latent frames the KV cache holds
    besides the chunk) go into ``out_dir/rtvideo.json``. ``progress`` advances
    by one at each of ``CONVERT_STAGES`` stages (read, rename, load, save)."""
    progress = progress or Progress.silent()
    if sink_frames < 0 or window_frames < 1:
        raise ValueError(f"need sink_frames >= 0 and window_frames >= 1, got {sink_frames} and {window_frames}")
    path = Path(checkpoint)
    if not path.is_file():
        raise ValueError(f"checkpoint {str(path)!r} does not exist")
    settings = CONFIGS.get(config)
    if settings is None:
        config_file = Path(config)
        if not config_file.is_file():
            raise ValueError(f"config must be one of {', '.join(CONFIGS)} or a config.json path, got {config!r}")
        settings = json.loads(config_file.read_text())
    progress.describe(f"reading {path.name}")
    loaded = torch.load(path, map_location="cpu", weights_only=True)
    progress.advance()
    if not isinstance(loaded, dict):
        raise ValueError(f"{path} does not hold a state dict")
    candidates = [key] if key is not None else ["generator_ema", "generator"]
    found = next((name for name in candidates if name in loaded), None)
    if found is not None:
        state = loaded[found]
    elif all(isinstance(v, torch.Tensor) for v in loaded.values()):
        state = loaded  # a bare generator state dict
    else:
        wanted = " or ".join(repr(name) for name in candidates)
        raise ValueError(f"{path} has no {wanted} entry; it has: {', '.join(sorted(map(str, loaded)))}")
    progress.describe("renaming its keys")
    converted = convert_wan_transformer_to_diffusers(strip_prefixes(dict(state)))
    progress.advance()
    progress.describe("loading the transformer")
    model = WanTransformer3DModel(**{k: v for k, v in settings.items() if not k.startswith("_")})
    result = model.load_state_dict(converted, strict=False)
    progress.advance()
    if result.missing_keys or result.unexpected_keys:
        raise ValueError(
            f"the checkpoint does not match the {config} transformer: "
            f"missing {result.missing_keys[:8]}, unexpected {result.unexpected_keys[:8]}"
        )
    progress.describe("saving it")
    target = Path(out_dir) / "transformer"
    model.save_pretrained(target)
    write_rtvideo_json(out_dir, sink_frames=sink_frames, window_frames=window_frames)
    progress.advance()
    return target


def convert_tiny_decoder(weights: str | Path, out_dir: str | Path) -> Path:
    """Save the tiny decoder of ``weights`` as ``out_dir``'s (``WEIGHTS_NAME``);
    ``ValueError`` (``TinyDecoderWeightsError``) names a file that is not one."""
    from safetensors.torch import save_file

    from rtvideo.workers.pipelines.tiny_decoder import WEIGHTS_NAME, read_decoder_weights

    tensors = read_decoder_weights(weights)
    if not Path(out_dir).is_dir():
        raise ValueError(f"model directory {str(out_dir)!r} does not exist")
    target = Path(out_dir) / WEIGHTS_NAME
    target.parent.mkdir(parents=True, exist_ok=True)
    published = {"decoder." + key.removeprefix("layers."): t.contiguous() for key, t in tensors.items()}
    save_file(published, str(target), metadata={"format": "pt", "source": Path(weights).name})
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="rtvideo convert",
        description=__doc__.splitlines()[0],
        usage="rtvideo convert [CHECKPOINT] MODEL_DIR [--tiny-decoder FILE] [options]",
    )
    parser.add_argument(
        "paths",
        nargs="+",
        metavar="CHECKPOINT MODEL_DIR",
        help="a Self-Forcing .pt checkpoint and the model directory to write transformer/ into "
        "(with --tiny-decoder, the checkpoint may be left out)",
    )
    parser.add_argument(
        "--tiny-decoder",
        metavar="FILE",
        default=None,
        help="also write a tiny decoder's weights (taew2_1.safetensors or .pth) into MODEL_DIR/tiny_decoder/",
    )
    parser.add_argument("--config", default="wan2.1-1.3b", help=f"{' | '.join(CONFIGS)} | path to a config.json")
    parser.add_argument("--key", default=None, help="which generator to take (default: generator_ema, else generator)")
    parser.add_argument(
        "--sink-frames",
        type=int,
        default=SELF_FORCING_SINK_FRAMES,
        help=f"latent frames kept as attention sinks (default {SELF_FORCING_SINK_FRAMES}, Self-Forcing's)",
    )
    parser.add_argument(
        "--window-frames",
        type=int,
        default=SELF_FORCING_WINDOW_FRAMES,
        help=f"latent frames of the rolling window (default {SELF_FORCING_WINDOW_FRAMES}, Self-Forcing's)",
    )
    args = parser.parse_args(argv)
    wanted = 1 if args.tiny_decoder is not None else 2
    if len(args.paths) not in (wanted, 2):
        parser.error("give CHECKPOINT MODEL_DIR, or MODEL_DIR with --tiny-decoder FILE")
    *checkpoint, out_dir = args.paths
    stages = CONVERT_STAGES * len(checkpoint) + (args.tiny_decoder is not None)
    try:
        with Progress("convert", stages, unit="stage") as progress:
            if checkpoint:
                target = convert(
                    checkpoint[0], out_dir, args.config, args.key, args.sink_frames, args.window_frames, progress
                )
                progress.print(f"wrote {target}")
            if args.tiny_decoder is not None:
                progress.describe("the tiny decoder")
                progress.print(f"wrote {convert_tiny_decoder(args.tiny_decoder, out_dir)}")
                progress.advance()
    except ValueError as error:
        print(f"rtvideo convert: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
