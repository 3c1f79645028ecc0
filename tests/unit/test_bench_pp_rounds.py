"""``rtvideo bench pp`` with several rounds: each ratio is the median of the
rounds' own ratios (configurations side by side within a round), not the
ratio of fastest runs that may come from different rounds."""

from __future__ import annotations

import json

import pytest

from rtvideo.bench import pp as bench_pp


def test_ratios_are_the_median_of_side_by_side_rounds(monkeypatch, capsys):
    fps = {  # the machine slows down between rounds: the ratio inside each round is what counts
        ("pp1-1t", 4): [100.0, 50.0, 80.0],
        ("pp2", 4): [150.0, 90.0, 160.0],
        ("pp1-1t", 1): [90.0, 45.0, 70.0],
    }
    calls = []

    async def run_config(options, config, chunks):
        key = (config.name, config.sessions)
        calls.append((key, chunks))
        rate = fps[key][sum(1 for call, _ in calls if call == key) - 1]
        return {"config": config.name, "sessions": config.sessions, "fps": rate, "_payloads": None, "ranks": []}

    monkeypatch.setattr(bench_pp, "run_config", run_config)
    configs = (
        bench_pp.Config("pp1-1t", 1, 1, 4),
        bench_pp.Config("pp2", 2, None, 4),
        bench_pp.Config("pp1-1t", 1, 1, 1),
    )
    assert bench_pp.main(bench_pp.PpBenchOptions(chunks=6, repeats=3), as_json=True, configs=configs) == 0
    # round by round, not one configuration's runs in a row; one session makes as many chunks as four together
    assert calls == [(("pp1-1t", 4), 6), (("pp2", 4), 6), (("pp1-1t", 1), 24)] * 3
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["rounds"] == 3
    assert summary["ratios_per_round"]["pp2_vs_pp1_1t_4_sessions"] == [1.5, 1.8, 2.0]
    assert summary["pp2_vs_pp1_1t_4_sessions"] == 1.8  # the median; the fastest runs' (160 / 100) would say 1.6
    assert summary["pp2_vs_pp1_1t_1_session"] is None  # not run
    by = {(r["config"], r["sessions"]): r for r in summary["results"]}
    assert by["pp2", 4]["fps"] == 160.0 and by["pp2", 4]["fps_per_round"] == [150.0, 90.0, 160.0]


def test_only_selects_configurations_by_name_or_name_and_sessions_in_the_order_given():
    chosen = bench_pp.select("pp2-stream@1, pp1-1t,pp2-stream@1")
    assert [(c.name, c.sessions) for c in chosen] == [("pp2-stream", 1), ("pp1-1t", 1), ("pp1-1t", 4)]


@pytest.mark.parametrize(
    ("only", "says"),
    [("pp9", "no configuration 'pp9'"), ("pp2-stream@4", "no configuration 'pp2-stream@4'"), (" , ", "at least one")],
)
def test_only_refuses_what_names_no_configuration(only, says):
    with pytest.raises(ValueError, match=says) as refused:
        bench_pp.select(only)
    if "no configuration" in says:
        assert "pp2-stream@1" in str(refused.value)  # and lists the ones there are


def test_a_selection_runs_as_long_as_in_a_full_run(monkeypatch, capsys):
    """One session alone makes four sessions' worth of chunks even when no
    four-session configuration was selected: the ratios stay comparable with a
    full run's."""
    calls = []

    async def run_config(options, config, chunks):
        calls.append((config.name, config.sessions, chunks))
        return {"config": config.name, "sessions": config.sessions, "fps": 10.0, "_payloads": None, "ranks": []}

    monkeypatch.setattr(bench_pp, "run_config", run_config)
    configs = bench_pp.select("pp1-1t@1,pp2-stream@1")
    options = bench_pp.PpBenchOptions(chunks=6, repeats=1)
    assert bench_pp.main(options, as_json=True, configs=configs, sized_as=bench_pp.CONFIGS) == 0
    assert calls == [("pp1-1t", 1, 24), ("pp2-stream", 1, 24)]
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["pp2_stream_vs_pp1_1t_1_session"] == 1.0
    assert summary["pp2_vs_pp1_1t_4_sessions"] is None
