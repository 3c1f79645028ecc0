"""``rtvideo bench pipeline --versus all``: every variant in turn, each one's
summary, the refused ones named with the reason; each round says what the
session added to the captured-step counts."""

from __future__ import annotations

import json

from rtvideo.bench import pipeline as bench_pipeline
from rtvideo.bench import versus as bench_versus
from rtvideo.engine.messages import StartSession


def _build(**options):
    return bench_pipeline._build("tiny", "cpu", None, None, **options)


def test_versus_all_runs_each_variant_and_names_the_refused_ones():
    start = StartSession(session_id="versus", prompt="a red fox", num_inference_steps=2)
    summary = bench_versus.versus_all(_build, start, 2, 1, variants=("cuda-graphs", "vae-float32"))
    assert summary["bench"] == "pipeline-versus-all" and list(summary["variants"]) == ["cuda-graphs"]
    assert list(summary["refused"]) == ["vae-float32"] and "VAE is fp32 already" in summary["refused"]["vae-float32"]
    graphs = summary["variants"]["cuda-graphs"]
    assert summary["median_fps_ratios"] == {"cuda-graphs": graphs["median_fps_ratio"]}
    [one] = graphs["rounds"]
    # captured at warm-up: the round's session only replays (2 full-window chunks: 2 steps and a commit each)
    assert one["variant"]["step_graphs"] == {
        "captures": 0,
        "replays": 2 * (2 + 1),
        "fallbacks": 0,
        "capture_failures": 0,
    }
    assert one["default"]["step_graphs"] is None and one["quality"]["identical"]


def test_the_command_takes_all_and_prints_every_variants_rounds(monkeypatch, capsys):
    asked = {}

    def fake(build, start, chunks, rounds, **kwargs):
        asked.update(chunks=chunks, rounds=rounds)
        figures = {"fps": 2.0, "time_to_first_chunk_s": 0.1}
        one = {"first": "default", "default": figures, "variant": figures, "fps_ratio": 1.0}
        return {
            "bench": "pipeline-versus-all",
            "variants": {"compile": {"variant": "compile", "rounds": [one]}},
            "refused": {"fp8": "no GPU"},
        }

    monkeypatch.setattr(bench_versus, "versus_all", fake)
    assert bench_pipeline.main(["--versus", "all", "--chunks", "3", "--rounds", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert asked == {"chunks": 3, "rounds": 1}
    assert out[0].startswith("round 1 (default first): default 2.0 fps") and "compile 2.0 fps" in out[0]
    assert out[1] == "fp8: refused: no GPU" and json.loads(out[2])["bench"] == "pipeline-versus-all"


def test_short_window_is_timed_once_the_default_window_is_full_and_changes_what_later_chunks_see():
    start = StartSession(session_id="short", prompt="a red fox", num_inference_steps=1, width=32, height=32)
    summary = bench_versus.versus(_build, "short-window", start, 2, 1)
    default, short = summary["pipelines"]["default"], summary["pipelines"]["short-window"]
    assert (default["sink_frames"], default["window_frames"], short["window_frames"]) == (3, 15, 9)
    assert summary["untimed_chunks"] == 6  # the default's window, (3 + 15) / 3 chunks, filled before the timing
    [one] = summary["rounds"]
    assert not one["quality"]["identical"]  # from chunk 4 on, the short window has let its oldest frames go
    assert one["variant"]["fps"] > 0 and one["default"]["fps"] > 0


def test_short_window_is_refused_where_the_window_is_no_longer():
    import pytest

    start = StartSession(session_id="short", prompt="a red fox", num_inference_steps=1, width=32, height=32)
    with pytest.raises(ValueError, match="KV window is 9 latent frames already, no longer than short-window's 9"):
        bench_versus.versus(lambda **options: _build(**{"window_frames": 9, **options}), "short-window", start, 2, 1)
