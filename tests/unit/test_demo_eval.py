"""The demo evaluation's measures and bars, on ground-truth streams rendered by the
scenes (no model): the truth passes every bar at 1.0, and a stream that shows the
wrong thing fails the bar that names it."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest

from rtvideo.training.demo import scenes
from rtvideo.training.demo.classify import classify, dominant_colour
from rtvideo.training.demo.evaluate import evaluate, judge_ground_truth
from rtvideo.training.demo.metrics import (
    BARS,
    JUMP_PX,
    StreamJudge,
    Trial,
    ground_truth,
    long_trials,
    summarize,
    switch_trials,
)

SIZE = 64
SWAP = {"red": "blue", "blue": "green", "green": "yellow", "yellow": "white", "white": "red"}


def streams(trials: int = 12, long_streams: int = 2, long_chunks: int = 40) -> list[Trial]:
    return switch_trials(trials, 6, 3) + long_trials(long_streams, long_chunks)


def judged(trials: list[Trial], frames_of) -> list[StreamJudge]:
    """Judge ``frames_of(trial, chunk, frames)`` for every ground-truth chunk of every trial."""
    judges = []
    for trial in trials:
        judge = StreamJudge(trial)
        for chunk, frames in enumerate(ground_truth(trial, SIZE)):
            judge.add(frames_of(trial, chunk, frames))
        judges.append(judge)
    return judges


def render_as(trial: Trial, chunk: int, **changes: str) -> np.ndarray:
    """The trial's chunk as the scenes draw it, with ``changes`` made to every chunk's attributes."""
    wrong = Trial(trial.name, trial.seed, tuple(dataclasses.replace(a, **changes) for a in trial.attributes))
    return _rendered(wrong)[chunk]


@functools.lru_cache(maxsize=4)
def _rendered(trial: Trial) -> list[np.ndarray]:
    """Every chunk of ``trial``, rendered once (a stream is drawn from its start)."""
    return ground_truth(trial, SIZE)


def test_the_fixed_prompt_set_covers_every_caption_and_switches_every_attribute():
    trials = switch_trials(60, 6, 3)
    assert {t.attributes[0] for t in trials} == set(scenes.ALL_ATTRIBUTES)
    for trial in trials:
        before, after = trial.attributes[2], trial.attributes[3]
        assert trial.switch_at == 3 and trial.prompt_at(3) == after.caption and trial.prompt_at(4) is None
        assert before.colour != after.colour and before.shape != after.shape and before.direction != after.direction
    assert switch_trials(60, 6, 3) == trials  # fixed by the seed
    assert switch_trials(60, 6, 3, seed=1) != trials
    assert {t.attributes[0].colour for t in long_trials(5, 10)} == set(scenes.COLOURS)


def test_ground_truth_passes_every_bar_at_one():
    summary = summarize(judge_ground_truth(streams()))
    assert summary["bars"].keys() == BARS.keys()
    for name, bar in summary["bars"].items():
        assert bar["value"] == 1.0 and bar["passes"] is True, name
    assert summary["presence"] == summary["boundary_steady"] == 1.0
    assert summary["switch_by_chunk"] == [1.0, 1.0, 1.0] and summary["colour_by_chunk"] == [1.0] * 6
    assert summary["long_window"] == [30, 39] and summary["passes"] is True


def test_the_command_judges_ground_truth_with_a_200_chunk_window():
    summary = evaluate(None, trials=4, long_streams=1, long_chunks=200)
    assert summary["passes"] is True and summary["long_window"] == [150, 199]
    assert summary["chunks_judged"] == 4 * 6 + 200


def test_a_swapped_colour_fails_colour_switch_and_long_colour_only():
    swapped = judged(streams(), lambda t, c, f: render_as(t, c, colour=SWAP[t.attributes[c].colour]))
    bars = summarize(swapped)["bars"]
    assert bars["colour"]["value"] == bars["switch"]["value"] == bars["long_colour"]["value"] == 0.0
    assert not bars["colour"]["passes"] and not bars["switch"]["passes"] and not bars["long_colour"]["passes"]
    assert bars["shape"]["passes"] and bars["direction"]["passes"] and bars["steady"]["passes"]


def test_a_wrong_shape_or_direction_fails_its_bar():
    other_shape = {"circle": "square", "square": "triangle", "triangle": "circle"}
    shapes = summarize(judged(streams(), lambda t, c, f: render_as(t, c, shape=other_shape[t.attributes[c].shape])))
    assert shapes["shape"] == 0.0 and not shapes["bars"]["shape"]["passes"] and shapes["bars"]["colour"]["passes"]
    assert shapes["long_shape"] == 0.0 and not shapes["bars"]["long_shape"]["passes"]
    assert shapes["bars"]["long_colour"]["passes"] and shapes["bars"]["long_direction"]["passes"]

    backwards = {"left": "right", "right": "left", "up": "down", "down": "up"}
    directions = summarize(
        judged(streams(), lambda t, c, f: render_as(t, c, direction=backwards[t.attributes[c].direction]))
    )
    assert directions["direction"] == 0.0 and not directions["bars"]["direction"]["passes"]
    assert directions["long_direction"] == 0.0 and not directions["bars"]["long_direction"]["passes"]
    assert directions["bars"]["long_shape"]["passes"]


def test_a_late_switch_fails_the_switch_bar():
    """The new colour only from the chunk after the one the prompt was applied at."""

    def late(trial: Trial, chunk: int, frames: np.ndarray) -> np.ndarray:
        if trial.switch_at is not None and chunk == trial.switch_at:
            return render_as(trial, chunk, colour=trial.attributes[chunk - 1].colour)
        return frames

    summary = summarize(judged(streams(), late))
    assert summary["switch"] == 0.0 and summary["switch_by_chunk"] == [0.0, 1.0, 1.0]
    assert summary["colour"] == pytest.approx(5 / 6, abs=1e-4)  # one chunk in six
    assert summary["colour_by_chunk"] == [1.0, 1.0, 1.0, 0.0, 1.0, 1.0]
    assert not summary["bars"]["switch"]["passes"]


@pytest.mark.parametrize("fault", ["vanish", "jump"])
def test_an_object_that_vanishes_or_jumps_between_chunks_is_not_steady(fault):
    """Every chunk's first 2 frames blank (vanish), or every other chunk's object
    shifted by 6 px (jump): every pair across a chunk boundary fails, and with
    them the steady bar."""

    def broken(trial: Trial, chunk: int, frames: np.ndarray) -> np.ndarray:
        frames = frames.copy()
        if fault == "vanish":
            frames[:2] = np.asarray(scenes.BACKGROUND, dtype=np.uint8)
        else:
            frames = np.roll(frames, int(2 * JUMP_PX) * (chunk % 2), axis=2)
        return frames

    summary = summarize(judged(streams(), broken))
    assert summary["boundary_steady"] == 0.0
    assert summary["steady"] < BARS["steady"] and not summary["bars"]["steady"]["passes"]
    assert summary["presence"] < 0.9 if fault == "vanish" else summary["presence"] == 1.0
    assert summary["bars"]["colour"]["passes"] and summary["bars"]["shape"]["passes"]


def test_the_colour_read_is_the_colour_most_of_the_object_is():
    """Half a frame's object red, a little more of it blue: blue. A generated object
    is often dimmer than the palette: one blended halfway into the background reads
    as its own colour (the palette colour nearest its mean would call a dim yellow
    red and a dim white blue)."""
    background = np.asarray(scenes.BACKGROUND, dtype=np.float64)
    for colour in scenes.COLOURS:
        for shape in scenes.SHAPES:
            [frames] = ground_truth(Trial("t", 0, (scenes.Attributes(colour, shape, "right"),)), SIZE)
            dim = np.rint(background + 0.5 * (frames - background)).astype(np.uint8)
            assert classify(frames).attributes.colour == classify(dim).attributes.colour == colour
    red = ground_truth(Trial("r", 0, (scenes.Attributes("red", "square", "right"),)), SIZE)[0]
    blue = ground_truth(Trial("b", 0, (scenes.Attributes("blue", "square", "right"),)), SIZE)[0]
    mixed = red.copy()
    mixed[:, : SIZE // 2 + 2] = blue[:, : SIZE // 2 + 2]
    assert dominant_colour(mixed) == "blue"
    assert dominant_colour(np.zeros_like(red) + np.asarray(scenes.BACKGROUND, dtype=np.uint8)) is None
