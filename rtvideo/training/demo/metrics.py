"""The demo model's evaluation measures and bars, from chunks of raw RGB frames.

Pure numpy (no model here): ``evaluate`` feeds it the served
pipeline's chunks, the tests feed it ground-truth chunks rendered by
``scenes``. A ``Trial`` is one stream and the caption in force at each of its
chunks; a ``StreamJudge`` reads the stream's chunks in order; ``summarize``
turns every stream's readings into the figures and the bars.

The measures (each a fraction in [0, 1]):

- ``colour`` / ``shape`` / ``direction``: chunks of the switch trials whose
  main object ``classify`` reads with the caption's colour / shape / direction
  (the caption in force at that chunk); ``colour_by_chunk`` per chunk index;
- ``switch``: switch trials in which, in every chunk from the one the new
  prompt was applied at to the end, the new caption's colour is the chunk's
  colour (``classify``'s: its dominant colour); ``switch_by_chunk`` gives the
  share per chunk after the change;
- ``presence``: frames that show an object (``classify.MIN_PIXELS``
  foreground pixels or more);
- ``steady`` (flicker): consecutive frame pairs of a stream, inside a chunk
  and across chunk boundaries, in which the object is present in both frames
  and its centroid moved at most ``JUMP_PX`` pixels (the scenes move it
  1 px a frame), the pair into a chunk where the prompt changed excepted (a
  new shape has another centroid); ``boundary_steady`` is the same over the
  pairs that cross a chunk boundary only: the object neither vanishes nor
  jumps between chunks;
- ``long_colour`` / ``long_shape`` / ``long_direction``: chunks of the long
  streams (one prompt each) in their last quarter (chunks 150-199 of 200)
  whose colour / shape / direction is the caption's.

The bars: ``colour`` >= 0.95, ``shape`` >= 0.70, ``direction`` >= 0.70,
``switch`` >= 0.90 are issue 13's; ``steady`` >= 0.95 and ``long_colour``
>= 0.95, ``long_shape`` >= 0.70, ``long_direction`` >= 0.70 (the issue's
bars for the first chunks, held at the end of a long stream) are ours for
what the issue says in words (no flicker or vanishing between chunks;
200-chunk streams stay on prompt). Ground truth meets each at 1.0 (tested).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from rtvideo.training.demo import scenes
from rtvideo.training.demo.classify import circular_centroid, classify, foreground

JUMP_PX = 3.0  # a centroid moving more than this between consecutive frames jumped (the object moves 1 px)
BARS: dict[str, float] = {
    "colour": 0.95,
    "shape": 0.70,
    "direction": 0.70,
    "switch": 0.90,
    "steady": 0.95,
    "long_colour": 0.95,
    "long_shape": 0.70,
    "long_direction": 0.70,
}


@dataclass(frozen=True)
class Trial:
    """One evaluated stream: ``attributes[c]`` is the caption in force at chunk ``c``."""

    name: str
    seed: int
    attributes: tuple[scenes.Attributes, ...]
    long: bool = False  # a long stream: judged on its last quarter (``long_colour``)

    @property
    def chunks(self) -> int:
        return len(self.attributes)

    def prompt_at(self, chunk: int) -> str | None:
        """The prompt to apply at ``chunk``'s boundary: the first chunk's caption at 0,
        a new caption where it changes, else None."""
        if chunk == 0 or self.attributes[chunk] != self.attributes[chunk - 1]:
            return self.attributes[chunk].caption
        return None

    @property
    def switch_at(self) -> int | None:
        changes = [c for c in range(1, self.chunks) if self.prompt_at(c) is not None]
        return changes[0] if changes else None


def switch_trials(count: int, chunks: int, switch_at: int, seed: int = 0) -> list[Trial]:
    """``count`` streams of ``chunks`` chunks whose prompt changes at chunk ``switch_at``
    to one that differs in colour, shape and direction. The first captions go
    through all 60 in an order drawn from ``seed`` (so 60 trials use each once)."""
    if not 0 < switch_at < chunks:
        raise ValueError(f"switch_at must be inside the stream (1..{chunks - 1}), got {switch_at}")
    rng = np.random.default_rng([seed, scenes.EVALUATION, 0])
    order = rng.permutation(len(scenes.ALL_ATTRIBUTES))
    trials = []
    for number in range(count):
        before = scenes.ALL_ATTRIBUTES[int(order[number % len(order)])]
        others = [
            a
            for a in scenes.ALL_ATTRIBUTES
            if a.colour != before.colour and a.shape != before.shape and a.direction != before.direction
        ]
        after = others[int(rng.integers(len(others)))]
        attributes = (before,) * switch_at + (after,) * (chunks - switch_at)
        trials.append(Trial(f"switch-{number}", seed * 100_000 + number, attributes))
    return trials


def long_trials(count: int, chunks: int, seed: int = 0) -> list[Trial]:
    """``count`` streams of ``chunks`` chunks under one caption each; the colours take
    turns, so 5 streams show each colour once."""
    rng = np.random.default_rng([seed, scenes.EVALUATION, 1])
    colours = list(scenes.COLOURS)
    trials = []
    for number in range(count):
        colour = colours[number % len(colours)]
        shape = scenes.SHAPES[int(rng.integers(len(scenes.SHAPES)))]
        direction = list(scenes.DIRECTIONS)[int(rng.integers(len(scenes.DIRECTIONS)))]
        attributes = (scenes.Attributes(colour, shape, direction),) * chunks
        trials.append(Trial(f"long-{number}", seed * 100_000 + 50_000 + number, attributes, long=True))
    return trials


def _distance(a: tuple[float, float], b: tuple[float, float], height: int, width: int) -> float:
    dx = (b[0] - a[0] + width / 2) % width - width / 2
    dy = (b[1] - a[1] + height / 2) % height - height / 2
    return float(np.hypot(dx, dy))


@dataclass(frozen=True)
class ChunkReading:
    """What one chunk showed against its caption."""

    chunk: int
    truth: scenes.Attributes
    seen: scenes.Attributes | None  # classify's reading (None: no object in any frame)
    present: int  # frames with an object
    frames: int
    steady: int  # steady frame pairs among ``pairs``
    pairs: int  # the frame pairs judged for steadiness (the pair into the chunk included)
    boundary_steady: bool | None  # the pair into the chunk (None: first chunk, or a prompt change)


@dataclass
class StreamJudge:
    """Reads one trial's chunks in order (``add``), keeping the last frame's centroid
    across the chunk boundary."""

    trial: Trial
    readings: list[ChunkReading] = field(default_factory=list)
    _last: tuple[float, float] | None = None  # the previous chunk's last centroid
    _had_last: bool = False  # whether there is a previous frame at all

    def add(self, frames: np.ndarray) -> ChunkReading:
        """Judge the trial's next chunk, ``frames`` ``[frames, height, width, 3]`` uint8."""
        chunk = len(self.readings)
        if chunk >= self.trial.chunks:
            raise ValueError(f"trial {self.trial.name} has {self.trial.chunks} chunks")
        height, width = frames.shape[1:3]
        centres = [circular_centroid(mask) for mask in foreground(frames)]
        changed = chunk > 0 and self.trial.prompt_at(chunk) is not None
        previous = [self._last] if self._had_last and not changed else []
        sequence = previous + centres
        steady = [
            a is not None and b is not None and _distance(a, b, height, width) <= JUMP_PX
            for a, b in zip(sequence, sequence[1:], strict=False)
        ]
        reading = ChunkReading(
            chunk=chunk,
            truth=self.trial.attributes[chunk],
            seen=classify(frames).attributes,
            present=sum(c is not None for c in centres),
            frames=len(frames),
            steady=sum(steady),
            pairs=len(steady),
            boundary_steady=steady[0] if previous else None,
        )
        self.readings.append(reading)
        self._last, self._had_last = centres[-1], True
        return reading


def _share(values: list[bool]) -> float | None:
    return round(float(np.mean(values)), 4) if values else None


def summarize(judges: list[StreamJudge]) -> dict:
    """The figures over every judged stream, and ``bars``: per bar its value, the
    bar and whether it passes (None: not measured, e.g. no long streams);
    ``passes``: every bar was measured and passes."""
    short = [j for j in judges if not j.trial.long]
    long = [j for j in judges if j.trial.long]
    chunks = [r for j in short for r in j.readings]
    summary: dict = {}
    for name in ("colour", "shape", "direction"):
        summary[name] = _share([r.seen is not None and getattr(r.seen, name) == getattr(r.truth, name) for r in chunks])
    length = max((j.trial.chunks for j in short), default=0)
    summary["colour_by_chunk"] = [
        _share([r.seen is not None and r.seen.colour == r.truth.colour for r in chunks if r.chunk == c])
        for c in range(length)
    ]
    switched, by_chunk = [], {}
    for judge in short:
        at = judge.trial.switch_at
        if at is None:
            continue
        after = judge.trial.attributes[at].colour
        hits = [r.seen is not None and r.seen.colour == after for r in judge.readings[at:]]
        switched.append(len(hits) == judge.trial.chunks - at and all(hits))
        for offset, hit in enumerate(hits):
            by_chunk.setdefault(offset, []).append(hit)
    summary["switch"] = _share(switched)
    summary["switch_by_chunk"] = [_share(by_chunk[k]) for k in sorted(by_chunk)]
    every = [r for j in judges for r in j.readings]
    summary["presence"] = round(sum(r.present for r in every) / max(1, sum(r.frames for r in every)), 4)
    summary["steady"] = round(sum(r.steady for r in every) / max(1, sum(r.pairs for r in every)), 4)
    summary["boundary_steady"] = _share([r.boundary_steady for r in every if r.boundary_steady is not None])
    window = [r for j in long for r in j.readings if r.chunk >= j.trial.chunks * 3 // 4]
    for name in ("colour", "shape", "direction"):
        summary[f"long_{name}"] = _share(
            [r.seen is not None and getattr(r.seen, name) == getattr(r.truth, name) for r in window]
        )
    if long:
        length = long[0].trial.chunks
        summary["long_window"] = [length * 3 // 4, length - 1]
    summary["bars"] = {
        name: {"value": summary[name], "bar": bar, "passes": None if summary[name] is None else summary[name] >= bar}
        for name, bar in BARS.items()
    }
    summary["passes"] = all(bar["passes"] is True for bar in summary["bars"].values())
    return summary


def ground_truth(trial: Trial, size: int) -> list[np.ndarray]:
    """The trial as the scenes draw it (the object starting at the centre, keeping its
    position when the caption changes): its chunks' frames, ``[frames, size, size, 3]`` each."""
    clip = scenes.Clip(0, scenes.canonical_start(size, size), trial.attributes)
    frames = scenes.render(clip, size, size)
    bounds = np.cumsum([0, *clip.frames_per_chunk()])
    return [frames[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
