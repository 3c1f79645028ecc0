"""The shipped demo model (``rtvideo/workers/demo/weights``, the ``demo`` preset): it loads
offline and, through the serving pipeline, reproduces the short evaluation recorded
with it (``rtvideo eval-demo --model demo --record check``) within a stated
tolerance. The full evaluation (``--record full``) is the command the docs quote;
it takes minutes, so CI repeats the short one."""

from __future__ import annotations

import json

import pytest
import torch

from rtvideo.training.demo.evaluate import evaluate
from rtvideo.workers.demo import WEIGHTS

TOLERANCE = 0.05  # a fraction may move by this much: a reading or two flipped by float rounding on another CPU
ARGUMENTS = ("trials", "chunks", "switch_at", "long_streams", "long_chunks", "seed", "rows")


@pytest.fixture(scope="module")
def recorded() -> dict:
    return json.loads((WEIGHTS / "rtvideo.json").read_text())["demo"]


@pytest.fixture
def one_thread():
    """The model is small enough that one thread is as fast as two, and two
    threads on a busy two-core machine wait on each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_the_shipped_weights_reproduce_their_recorded_check(recorded, monkeypatch, one_thread):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    check = recorded["evaluation"]["check"]
    summary = evaluate("demo", **{name: check[name] for name in ARGUMENTS})
    assert summary["trained_steps"] == recorded["trained_steps"] == check["trained_steps"]
    assert summary["chunks_judged"] == check["chunks_judged"]
    for name, bar in check["bars"].items():
        got = summary["bars"][name]["value"]
        assert abs(got - bar["value"]) <= TOLERANCE, f"{name}: {got} now, {bar['value']} recorded"
    for name in ("presence", "boundary_steady"):
        assert abs(summary[name] - check[name]) <= TOLERANCE, name


def test_the_full_evaluation_is_recorded_and_its_bars_are_what_its_figures_say(recorded):
    """The figures the docs quote were measured on these weights, with the full
    command's arguments; each bar's verdict follows from its value."""
    full = recorded["evaluation"]["full"]
    assert full["trained_steps"] == recorded["trained_steps"]
    assert (full["trials"], full["long_streams"], full["long_chunks"]) == (60, 5, 200)
    for bar in full["bars"].values():
        assert bar["passes"] == (bar["value"] >= bar["bar"])
