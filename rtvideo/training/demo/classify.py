"""Read a demo clip back: the main object's colour, shape and motion direction, from raw RGB.

Pure numpy; the evaluation's judge of generated chunks, tested on
ground-truth clips from ``scenes``. Frames are ``[frames, height, width, 3]``
uint8 (what the served pipeline returns). The frame is a torus (the object
wraps around its edges), so positions are circular means.

- foreground: pixels whose brightest channel stands ``FOREGROUND_LEVEL``
  grey levels above the background's;
- colour: the dominant colour, the palette colour most foreground pixels of
  the clip are a blend of with the background (``dominant_colour``: each pixel
  votes for the colour whose background-to-colour segment passes nearest to
  it). Not the palette colour nearest the mean foreground: a generated object
  is often dimmer than the palette, and a dim yellow is nearer red than
  yellow, a dim white nearer blue;
- shape: each frame's foreground, rolled so its centroid sits at the frame's
  centre, against each shape's mask placed likewise, at a few sizes (a
  decoded or generated object may look smaller or larger): the best mean IoU wins;
- direction: the centroid's displacement summed over consecutive frames
  (each step taken the short way round): the larger axis, and its sign
  (image y grows downwards);
- ``presence``: the fraction of frames with a visible object (flicker).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from rtvideo.training.demo.scenes import BACKGROUND, COLOURS, SHAPES, Attributes, shape_alpha

FOREGROUND_LEVEL = 60  # grey levels above the background's brightest channel
MIN_PIXELS = 4  # fewer foreground pixels than this: no object in the frame
TEMPLATE_SCALES = (0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.2)  # shape templates are tried at these sizes


@dataclass(frozen=True)
class Reading:
    """What a clip shows; ``attributes`` is None when no frame shows an object."""

    attributes: Attributes | None
    presence: float  # frames with an object / frames
    displacement: tuple[float, float]  # (dx, dy) pixels over the clip


def foreground(frames: np.ndarray) -> np.ndarray:
    """Boolean ``[frames, height, width]``: the object's pixels."""
    return frames.max(axis=-1).astype(np.int16) > max(BACKGROUND) + FOREGROUND_LEVEL


def circular_centroid(mask: np.ndarray) -> tuple[float, float] | None:
    """The (x, y) circular mean of a 2-D mask's pixels, or None if it is (nearly) empty."""
    if mask.sum() < MIN_PIXELS:
        return None
    height, width = mask.shape
    ys, xs = np.nonzero(mask)
    centre = []
    for values, size in ((xs, width), (ys, height)):
        angle = 2 * np.pi * values / size
        mean = np.arctan2(np.sin(angle).mean(), np.cos(angle).mean())
        centre.append((mean % (2 * np.pi)) * size / (2 * np.pi))
    return centre[0], centre[1]


def _wrapped(delta: float, size: int) -> float:
    return (delta + size / 2) % size - size / 2


def _centred(mask: np.ndarray, centre: tuple[float, float]) -> np.ndarray:
    height, width = mask.shape
    shift = (int(round(height // 2 - centre[1])), int(round(width // 2 - centre[0])))
    return np.roll(mask, shift, axis=(0, 1))


@functools.lru_cache(maxsize=256)
def _template(shape: str, height: int, width: int, scale: float) -> np.ndarray:
    """``shape``'s mask at ``scale``, its centroid at the frame's centre."""
    mask = shape_alpha(shape, height, width, scale) >= 0.5
    return _centred(mask, circular_centroid(mask))


def _shape_of(masks: list[np.ndarray], centres: list[tuple[float, float]]) -> str:
    height, width = masks[0].shape
    seen = np.stack([_centred(mask, centre) for mask, centre in zip(masks, centres, strict=True)])
    scores = {}
    for shape in SHAPES:
        best = 0.0
        for scale in TEMPLATE_SCALES:
            template = _template(shape, height, width, scale)
            ious = (seen & template).sum(axis=(1, 2)) / np.maximum(1, (seen | template).sum(axis=(1, 2)))
            best = max(best, float(ious.mean()))
        scores[shape] = best
    return max(scores, key=scores.get)


def dominant_colour(frames: np.ndarray, masks: np.ndarray | None = None) -> str | None:
    """The palette colour most foreground pixels of ``frames`` (``masks``: their
    ``foreground``) are a blend of with the background, or None when none is foreground."""
    pixels = frames[foreground(frames) if masks is None else masks].astype(np.float64)
    if not len(pixels):
        return None
    background = np.asarray(BACKGROUND, dtype=np.float64)
    offsets = pixels - background
    residuals = []
    for rgb in COLOURS.values():
        towards = np.asarray(rgb, dtype=np.float64) - background
        alpha = np.clip(offsets @ towards / (towards @ towards), 0.0, 1.0)
        residuals.append(((offsets - alpha[:, None] * towards) ** 2).sum(axis=1))
    votes = np.bincount(np.argmin(np.stack(residuals), axis=0), minlength=len(COLOURS))
    return list(COLOURS)[int(np.argmax(votes))]


def _direction_of(displacement: tuple[float, float]) -> str:
    dx, dy = displacement
    if abs(dx) >= abs(dy):
        return "right" if dx >= 0 else "left"
    return "down" if dy >= 0 else "up"


def classify(frames: np.ndarray) -> Reading:
    """Read the main object of ``frames`` ``[frames, height, width, 3]`` uint8."""
    if frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"frames must be [frames, height, width, 3], got {frames.shape}")
    height, width = frames.shape[1:3]
    masks = foreground(frames)
    centres = [circular_centroid(mask) for mask in masks]
    seen = [i for i, centre in enumerate(centres) if centre is not None]
    presence = len(seen) / len(frames)
    if not seen:
        return Reading(None, 0.0, (0.0, 0.0))
    dx = dy = 0.0
    for a, b in zip(seen, seen[1:], strict=False):
        dx += _wrapped(centres[b][0] - centres[a][0], width)
        dy += _wrapped(centres[b][1] - centres[a][1], height)
    shape = _shape_of([masks[i] for i in seen], [centres[i] for i in seen])
    attributes = Attributes(dominant_colour(frames, masks), shape, _direction_of((dx, dy)))
    return Reading(attributes, presence, (dx, dy))
