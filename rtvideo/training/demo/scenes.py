"""Synthetic scenes for the demo model: one coloured shape moving over a dark background.

Pure numpy, deterministic: a clip is a function of the ``numpy.random.Generator``
it is drawn with (``clip_for(seed, index)`` seeds one from two integers), and
its frames a function of the clip. The object wraps around the frame's edges
(the frame is a torus), so a stream of any length stays on its caption.

Geometry follows the served pipeline's chunks: a stream's first chunk is
``1 + 4 * 2`` = 9 pixel frames and every later one 12, because the latent
compresses 4x in time and a stream's very first pixel frame is a latent frame
of its own (``LATENT_FRAMES_PER_CHUNK`` = 3). A clip is ``chunks`` consecutive
chunks of a stream, from stream chunk ``first_chunk``; its caption (and the
object's attributes) may switch at a chunk boundary, the object keeping its
position.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (230, 40, 40),
    "green": (40, 200, 60),
    "blue": (50, 90, 240),
    "yellow": (240, 220, 40),
    "white": (240, 240, 240),
}
SHAPES = ("circle", "square", "triangle")
DIRECTIONS: dict[str, tuple[int, int]] = {"right": (1, 0), "left": (-1, 0), "up": (0, -1), "down": (0, 1)}  # px/frame
BACKGROUND = (16, 16, 24)
LATENT_FRAMES_PER_CHUNK = 3
TEMPORAL_RATIO = 4  # pixel frames per latent frame (the stream's first latent frame holds one)
OBJECT_FRACTION = 0.34  # the object's size, as a fraction of the frame's smaller side
SUPERSAMPLE = 4  # per axis, for anti-aliased edges


@dataclass(frozen=True)
class Attributes:
    """What a caption says about the object."""

    colour: str
    shape: str
    direction: str

    @property
    def caption(self) -> str:
        return f"a {self.colour} {self.shape} moving {self.direction}"


ALL_ATTRIBUTES = tuple(Attributes(c, s, d) for c in COLOURS for s in SHAPES for d in DIRECTIONS)
CAPTIONS = tuple(a.caption for a in ALL_ATTRIBUTES)


def parse_caption(text: str) -> Attributes | None:
    """The attributes a demo caption names, or None for any other text."""
    words = text.strip().lower().split()
    if len(words) != 5 or words[0] != "a" or words[3] != "moving":
        return None
    attributes = Attributes(words[1], words[2], words[4])
    return attributes if attributes in ALL_ATTRIBUTES else None


def chunk_frames(stream_chunk: int) -> int:
    """Pixel frames of a stream's chunk: 9 for the first, 12 after."""
    full = LATENT_FRAMES_PER_CHUNK * TEMPORAL_RATIO
    return full - (TEMPORAL_RATIO - 1) if stream_chunk == 0 else full


@dataclass(frozen=True)
class Clip:
    """``len(attributes)`` consecutive chunks of a stream, from stream chunk ``first_chunk``.

    ``attributes[c]`` holds for the clip's chunk ``c``; ``start`` is the
    object's centre (x, y) in pixels at the clip's first frame.
    """

    first_chunk: int
    start: tuple[int, int]
    attributes: tuple[Attributes, ...]

    @property
    def chunks(self) -> int:
        return len(self.attributes)

    def frames_per_chunk(self) -> list[int]:
        return [chunk_frames(self.first_chunk + c) for c in range(self.chunks)]

    def positions(self, height: int, width: int) -> np.ndarray:
        """The object's centre (x, y) at every frame, ``[frames, 2]``, wrapped into the frame."""
        steps = []
        for count, attributes in zip(self.frames_per_chunk(), self.attributes, strict=True):
            steps += [DIRECTIONS[attributes.direction]] * count
        moves = np.asarray(steps, dtype=np.int64)
        moves[0] = 0  # the first frame is at ``start``
        xy = np.asarray(self.start, dtype=np.int64) + np.cumsum(moves, axis=0)
        return xy % np.asarray([width, height])

    def frame_attributes(self) -> list[Attributes]:
        """The attributes at every frame."""
        return [a for count, a in zip(self.frames_per_chunk(), self.attributes, strict=True) for _ in range(count)]


def canonical_start(height: int, width: int) -> tuple[int, int]:
    """Where every stream's object starts: the centre of the frame."""
    return width // 2, height // 2


@functools.lru_cache(maxsize=256)
def shape_alpha(shape: str, height: int, width: int, scale: float = 1.0) -> np.ndarray:
    """Coverage in [0, 1] of ``shape`` centred at (width // 2, height // 2), ``[height, width]``
    float32; ``scale`` times the scenes' object size."""
    size = scale * OBJECT_FRACTION * min(height, width)
    s = SUPERSAMPLE
    ys = (np.arange(height * s) + 0.5) / s - height // 2 - 0.5
    xs = (np.arange(width * s) + 0.5) / s - width // 2 - 0.5
    y, x = np.meshgrid(ys, xs, indexing="ij")
    r = size / 2
    if shape == "circle":
        inside = x * x + y * y <= r * r
    elif shape == "square":
        half = 0.8 * r
        inside = (np.abs(x) <= half) & (np.abs(y) <= half)
    elif shape == "triangle":  # pointing up, base and height ``size``
        top, bottom = -r, r
        inside = (y >= top) & (y <= bottom) & (np.abs(x) <= (y - top) / 2)
    else:
        raise ValueError(f"unknown shape {shape!r}")
    return inside.reshape(height, s, width, s).mean(axis=(1, 3)).astype(np.float32)


def render(clip: Clip, height: int, width: int) -> np.ndarray:
    """The clip's frames, ``[frames, height, width, 3]`` uint8 RGB."""
    positions = clip.positions(height, width)
    centre = np.asarray(canonical_start(height, width))
    background = np.asarray(BACKGROUND, dtype=np.float32)
    frames = np.empty((len(positions), height, width, 3), dtype=np.uint8)
    for index, (xy, attributes) in enumerate(zip(positions, clip.frame_attributes(), strict=True)):
        dx, dy = (xy - centre).tolist()
        alpha = np.roll(shape_alpha(attributes.shape, height, width), (dy, dx), axis=(0, 1))[..., None]
        colour = np.asarray(COLOURS[attributes.colour], dtype=np.float32)
        frames[index] = np.rint(background * (1.0 - alpha) + colour * alpha).astype(np.uint8)
    return frames


def draw_clip(
    rng: np.random.Generator,
    height: int,
    width: int,
    chunks: int,
    switch_probability: float = 0.35,
    stream_start_probability: float = 0.35,
    max_first_chunk: int = 6,
) -> Clip:
    """A random clip: from the stream's start (canonical position) with
    ``stream_start_probability``, else from a later chunk at a random position;
    with ``switch_probability`` the caption switches to another at a random
    chunk boundary inside the clip."""
    if rng.random() < stream_start_probability:
        first, start = 0, canonical_start(height, width)
    else:
        first = int(rng.integers(1, max_first_chunk + 1))
        start = (int(rng.integers(width)), int(rng.integers(height)))
    attributes = [ALL_ATTRIBUTES[int(rng.integers(len(ALL_ATTRIBUTES)))]] * chunks
    if chunks > 1 and rng.random() < switch_probability:
        at = int(rng.integers(1, chunks))
        others = [a for a in ALL_ATTRIBUTES if a != attributes[0]]
        attributes[at:] = [others[int(rng.integers(len(others)))]] * (chunks - at)
    return Clip(first, start, tuple(attributes))


TRAINING, CODEC_FIT, EVALUATION, DECODER_FIT = 0, 1, 2, 3  # disjoint clip streams of one seed


def clip_for(seed: int, index: int, height: int, width: int, chunks: int, stream: int = TRAINING, **options) -> Clip:
    """Clip ``index`` (>= 0) of stream ``stream`` of the data set ``seed``: the same
    arguments always give the same clip."""
    return draw_clip(np.random.default_rng([seed, stream, index]), height, width, chunks, **options)
