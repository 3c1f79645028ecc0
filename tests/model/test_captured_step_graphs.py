"""Captured denoise steps wired into the causal Wan pipeline (tiny preset, CPU).

``cuda_graphs: "eager"`` runs the captured-step path (``StepGraphs`` keys,
static inputs, copies out) with ``EagerReplay`` standing in for the CUDA
capture. A session streamed through it must make the plain eager route's
frames bit for bit: through the window filling (eager), full (captured, then
replayed), a reset and a re-cache, and a release then a new session. The
CUDA capture itself is tested in ``tests/gpu/test_wan_on_gpu.py``.
"""

from __future__ import annotations

import pytest

from engine.messages import StartSession
from workers.chunk_driver import ChunkDriver
from workers.pipelines.causal_wan import build

SIZE = {"width": 32, "height": 32}
SPAN = {"sink_frames": 3, "window_frames": 3}  # full after two chunks of 3 latent frames


@pytest.fixture(scope="module")
def eager():
    return build("tiny", device="cpu", warm_up_chunks=0, **SPAN)


@pytest.fixture(scope="module")
def replayed():
    return build("tiny", device="cpu", warm_up_chunks=0, cuda_graphs="eager", **SPAN)


def _stream(pipeline, sid: str, prompt_change: str, changes: dict[int, str], chunks: int) -> list[bytes]:
    """One session of ``chunks`` chunks, one row a forward, a new prompt at the
    chunks ``changes`` names: every chunk's frames. Released at the end."""
    driver = ChunkDriver(pipeline, max_rows=1)
    driver.open(StartSession(session_id=sid, prompt="a red fox", seed=3, prompt_change=prompt_change, **SIZE))
    frames = []
    for chunk in range(chunks):
        interactions = {sid: (changes[chunk], 0)} if chunk in changes else None
        frames.append(driver.run([sid], 1, interactions)[sid][0].payload)
    driver.release(sid)
    return frames


@pytest.mark.parametrize(
    ("prompt_change", "changes"),
    [
        ("reset", {3: "a blue heron"}),  # chunk 3 starts an empty window; chunk 5 is full again
        ("recache", {3: "a blue heron", 4: "a green frog"}),  # the rebuilt cache is full at once
    ],
)
def test_the_replayed_route_makes_the_eager_frames_bit_for_bit(eager, replayed, prompt_change, changes):
    graphs = replayed.step_graphs
    before = graphs.figures()
    expected = _stream(eager, f"eager-{prompt_change}", prompt_change, changes, chunks=7)
    got = _stream(replayed, f"replayed-{prompt_change}", prompt_change, changes, chunks=7)
    after = graphs.figures()
    assert after["captures"] - before["captures"] == 1  # one key: the session's full window (kept over the change)
    assert after["replays"] - before["replays"] > 4
    assert got == expected
    assert eager.step_graphs is None
    # then a new session: a new cache, captured afresh, the same frames again
    assert _stream(replayed, "after", "soft", {}, chunks=4) == _stream(eager, "after", "soft", {}, chunks=4)
    assert graphs.figures()["captures"] - after["captures"] == 1


def test_a_released_sessions_graphs_are_forgotten(replayed):
    driver = ChunkDriver(replayed, max_rows=1)
    [state] = driver.open(StartSession(session_id="forgotten", prompt="a red fox", **SIZE))
    driver.run(["forgotten"], 4)
    assert any(key.cache == state.kv.uid for key in replayed.step_graphs.graphs)
    driver.release("forgotten")
    assert not any(key.cache == state.kv.uid for key in replayed.step_graphs.graphs)
    assert not any(key.cache == state.kv.uid for key in replayed.step_graphs.uses)


def test_sessions_taking_turns_keep_their_graphs_and_batched_rows_stay_eager(eager, replayed):
    graphs = replayed.step_graphs
    ids = ["turn-a", "turn-b"]
    starts = [StartSession(session_id=sid, prompt="a red fox", seed=n, **SIZE) for n, sid in enumerate(ids)]
    outputs = {}
    for name, pipeline in (("eager", eager), ("replayed", replayed)):
        driver = ChunkDriver(pipeline, max_rows=1)  # one row a forward, the sessions in turn
        driver.open(*starts)
        before = graphs.figures()
        outputs[name] = driver.run(ids, 5)
        one_row = graphs.figures()
        driver.max_rows = 2  # the same sessions on, both rows in one forward
        driver.run(ids, 1)
        driver.release(*ids)
    assert [c.payload for sid in ids for c in outputs["replayed"][sid]] == [
        c.payload for sid in ids for c in outputs["eager"][sid]
    ]
    # each session's key buffers stayed put while the other committed: one capture each
    assert one_row["captures"] - before["captures"] == 2
    assert graphs.figures()["replays"] == one_row["replays"]  # the batched forwards ran eagerly


def test_cuda_graphs_on_a_cpu_is_refused_naming_the_option_and_the_device():
    with pytest.raises(ValueError, match=r"cuda_graphs: CUDA graphs need a CUDA device; this pipeline runs on cpu"):
        build("tiny", device="cpu", warm_up_chunks=0, cuda_graphs=True)
    with pytest.raises(ValueError, match=r"cuda_graphs must be true, false or \"eager\", got 'yes'"):
        build("tiny", device="cpu", warm_up_chunks=0, cuda_graphs="yes")


def test_bench_pipeline_versus_cuda_graphs_on_a_cpu_runs_the_eager_replay_and_says_so():
    from tests.support import rtvideo_summary

    flags = ("--versus", "cuda-graphs", "--chunks", "2", "--rounds", "1")
    summary = rtvideo_summary("bench", "pipeline", "--json", *flags)
    assert summary["variant"] == "cuda-graphs" and summary["device"] == "cpu"
    default, variant = summary["pipelines"]["default"], summary["pipelines"]["cuda-graphs"]
    assert default["cuda_graphs"] is False and default["step_graphs"] is None
    assert variant["cuda_graphs"] == "eager"  # nothing to capture on a CPU: the same path, replayed eagerly
    assert summary["untimed_chunks"] == 6  # the tiny preset's 3 + 15 frames fill in 6 chunks; the 7th captures
    assert variant["step_graphs"]["captures"] == 1 and variant["step_graphs"]["replays"] == 3 + 4
    assert variant["step_graphs"]["held"] == 0  # the session was released
    [one] = summary["rounds"]
    assert one["quality"]["identical"] and one["fps_ratio"] > 0
