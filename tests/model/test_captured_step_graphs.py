"""Captured steps wired into the causal Wan pipeline (tiny preset, CPU).

``cuda_graphs: "eager"`` runs the captured-step path (``StepGraphs`` keys,
static inputs, copies out) with ``EagerReplay`` standing in for the CUDA
capture. A session streamed through it must make the plain eager route's
frames bit for bit: through the window filling (eager), full (its denoise
forwards and its commits captured, then replayed), a reset and a re-cache,
and a release then a new session, which takes the released session's cache
over and with it its graphs (``KeptCaches``); so must two sessions taking
turns, then batched in one forward (their batch's own graphs, whichever
order the rows come in). The CUDA capture itself is tested in
``tests/gpu/test_wan_on_gpu.py``.
"""

from __future__ import annotations

import pytest

from rtvideo.engine.messages import StartSession
from rtvideo.workers.chunk_driver import ChunkDriver
from rtvideo.workers.pipelines.causal_wan import build

SIZE = {"width": 32, "height": 32}
SPAN = {"sink_frames": 3, "window_frames": 3}  # full after two chunks of 3 latent frames


@pytest.fixture(scope="module")
def eager():
    return build("tiny", device="cpu", warm_up_chunks=0, **SPAN)


@pytest.fixture
def replayed():  # each test its own: a released session's cache and graphs serve the pipeline's next session
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
    after = replayed.graph_figures()
    # two keys (kept over the change): the full window's denoise forward and its commit pass
    assert after["captures"] - before["captures"] == 2
    assert after["replays"] - before["replays"] > 4
    assert got == expected
    assert eager.step_graphs is None
    # then a new session: the released one's cache taken over, its graphs replayed, the same frames again
    assert _stream(replayed, "after", "soft", {}, chunks=4) == _stream(eager, "after", "soft", {}, chunks=4)
    assert graphs.figures()["captures"] == after["captures"]
    assert replayed.graph_figures()["caches_taken_over"] == after["caches_taken_over"] + 1


def test_a_session_after_a_release_takes_the_cache_and_graphs_over_and_makes_a_fresh_sessions_frames():
    pipeline = build("tiny", device="cpu", warm_up_chunks=0, cuda_graphs="eager", **SPAN)
    fresh = build("tiny", device="cpu", warm_up_chunks=0, **SPAN)
    graphs = pipeline.step_graphs
    driver = ChunkDriver(pipeline, max_rows=1)
    [first] = driver.open(StartSession(session_id="first", prompt="a red fox", seed=1, **SIZE))
    driver.run(["first"], pipeline.capture_chunks)
    cache = first.kv
    assert graphs.captures == 2 and {key.kind for key in graphs.graphs} == {"denoise", "commit"}
    driver.release("first")
    assert first.kv is not cache and first.kv.nbytes() == 0  # the released session holds none of it
    assert pipeline.graph_figures()["kept_caches"] == 1 and graphs.figures()["held"] == 2
    replays = graphs.replays

    start = StartSession(session_id="second", prompt="a blue heron", seed=2, **SIZE)
    [second] = driver.open(start)
    assert second.kv is cache and second.kv.frames == 0  # the same stores, holding nothing
    got = [c.payload for c in driver.run(["second"], 5)["second"]]
    expected = [c.payload for c in _stream_start(fresh, start, 5)]
    assert got == expected
    assert graphs.captures == 2 and graphs.replays > replays  # replayed from its first full window, no capture
    assert pipeline.graph_figures()["caches_taken_over"] == 1
    driver.release("second")


def test_kept_caches_are_bounded_counted_in_the_budget_and_serve_only_their_size(monkeypatch):
    import rtvideo.workers.pipelines.causal_wan_geometry as geometry

    pipeline = build("tiny", device="cpu", warm_up_chunks=0, cuda_graphs="eager", kept_caches=1, **SPAN)
    kept, graphs = pipeline.kept, pipeline.step_graphs
    monkeypatch.setattr(geometry, "host_session_budget", lambda: 10**9)
    assert kept.most == 1 and kept.most_bytes > 0 and pipeline.session_memory_budget() == 10**9 - kept.most_bytes

    driver = ChunkDriver(pipeline, max_rows=1)
    ids = ["a", "b"]
    states = driver.open(
        *(StartSession(session_id=sid, prompt="a red fox", seed=n, **SIZE) for n, sid in enumerate(ids))
    )
    caches = [state.kv for state in states]
    driver.run(ids, pipeline.capture_chunks)
    assert graphs.captures == 4  # each session its own denoise and commit graphs
    roped = [pipeline.context.roped.entries[cache.uid].nbytes() for cache in caches]
    driver.release(*ids)  # a, then b: only b's cache kept; a's freed and its graphs forgotten
    assert [k.cache for k in kept.kept] == [caches[1]] and caches[0].nbytes() == 0
    assert kept.nbytes == caches[1].nbytes() + roped[1] and kept.nbytes <= kept.most_bytes
    assert {key.caches for key in graphs.graphs} == {(caches[1].uid,)}
    assert pipeline.session_memory_budget() == 10**9 - (kept.most_bytes - kept.nbytes)

    other = {"width": 48, "height": 32}  # another size: a cache of its own, the kept one stays
    [state] = driver.open(StartSession(session_id="other", prompt="a red fox", **other))
    assert state.kv is not caches[1] and [k.cache for k in kept.kept] == [caches[1]]
    other_cache = state.kv
    driver.run(["other"], 2)  # the second reads its cache: roped keys to keep with it
    driver.release("other")  # kept, the newest: b's let go (one at most), its graphs with it
    assert [k.cache for k in kept.kept] == [other_cache] and caches[1].nbytes() == 0
    assert not any(caches[1].uid in key.caches for key in graphs.graphs)


def test_without_kept_caches_a_released_sessions_graphs_are_forgotten():
    pipeline = build("tiny", device="cpu", warm_up_chunks=0, cuda_graphs="eager", kept_caches=0, **SPAN)
    driver = ChunkDriver(pipeline, max_rows=1)
    [state] = driver.open(StartSession(session_id="forgotten", prompt="a red fox", **SIZE))
    driver.run(["forgotten"], 4)
    uid = state.kv.uid
    assert any(uid in key.caches for key in pipeline.step_graphs.graphs)
    driver.release("forgotten")
    assert not any(uid in key.caches for key in pipeline.step_graphs.graphs)
    assert not any(uid in key.caches for key in pipeline.step_graphs.uses)
    assert pipeline.kept_room() == 0 and state.kv.nbytes() == 0


def test_the_warm_up_captures_so_the_first_session_of_the_default_size_replays_at_once():
    from rtvideo.workers.warmup import warm_up

    pipeline = build("tiny", device="cpu", cuda_graphs="eager", max_batch_rows=2, **SPAN)
    cold = build("tiny", device="cpu", warm_up_chunks=0, **SPAN)
    warm_up(pipeline)
    graphs = pipeline.step_graphs
    assert graphs.captures == 2 and pipeline.graph_figures()["kept_caches"] == 1 and pipeline.held_sessions() == ()
    taken = pipeline.graph_figures()["caches_taken_over"]  # the session alone took a batched one's
    start = StartSession(session_id="first", prompt="a red fox", seed=5)  # the default size
    got = [c.payload for c in _stream_start(pipeline, start, pipeline.capture_chunks)]
    assert got == [c.payload for c in _stream_start(cold, start, pipeline.capture_chunks)]
    assert graphs.captures == 2 and pipeline.graph_figures()["caches_taken_over"] == taken + 1


def test_kept_caches_need_captured_steps():
    with pytest.raises(ValueError, match="kept_caches keeps caches for captured steps"):
        build("tiny", device="cpu", warm_up_chunks=0, kept_caches=1)
    with pytest.raises(ValueError, match="kept_caches"):
        build("tiny", device="cpu", warm_up_chunks=0, cuda_graphs="eager", kept_caches=-1)


def _stream_start(pipeline, start: StartSession, chunks: int) -> list:
    """``chunks`` chunks of a session of ``start``, one row a forward; released at the end."""
    driver = ChunkDriver(pipeline, max_rows=1)
    driver.open(start)
    try:
        return driver.run([start.session_id], chunks)[start.session_id]
    finally:
        driver.release(start.session_id)


def test_sessions_taking_turns_keep_their_graphs_and_batched_rows_replay_their_own(eager, replayed):
    graphs = replayed.step_graphs
    ids = ["turn-a", "turn-b"]
    starts = [StartSession(session_id=sid, prompt="a red fox", seed=n, **SIZE) for n, sid in enumerate(ids)]
    outputs, figures = {}, {}
    for name, pipeline in (("eager", eager), ("replayed", replayed)):
        driver = ChunkDriver(pipeline, max_rows=1)  # one row a forward, the sessions in turn
        driver.open(*starts)
        turns = driver.run(ids, 5)
        figures["one row"] = graphs.figures()
        driver.max_rows = 2  # the same sessions on, both rows in every forward and commit
        batched = driver.run(ids, 2)
        figures["two rows"] = graphs.figures()
        reordered = driver.run(ids[::-1], 1)  # the rows the other way round
        figures["reordered"] = graphs.figures()
        driver.release(*ids)
        outputs[name] = [c.payload for part in (turns, batched, reordered) for sid in ids for c in part[sid]]
    assert outputs["replayed"] == outputs["eager"]  # bit for bit, one row or two a forward
    one_row, two_rows, reordered = figures["one row"], figures["two rows"], figures["reordered"]
    # each session's key buffers stayed put while the other committed: two captures each (denoise, commit)
    assert one_row["captures"] == 4
    # the batch: its denoise forward and its commit pass, each run eagerly once, then captured
    assert two_rows["captures"] - one_row["captures"] == 2 and two_rows["fallbacks"] - one_row["fallbacks"] == 2
    # the same two sessions the other way round are the same graphs: four steps and a commit replayed
    assert reordered["captures"] == two_rows["captures"] and reordered["fallbacks"] == two_rows["fallbacks"]
    assert reordered["replays"] - two_rows["replays"] == 5


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
    assert summary["untimed_chunks"] == 6  # the tiny preset's 3 + 15 frames fill in 6 chunks
    graphs = variant["step_graphs"]
    # captured at warm-up (its 7th chunk's denoise steps, its 8th's commit), none in the round's session:
    # warm-up replays 3 + 4 denoise and 1 commit, the round's two full-window chunks 2 x (4 + 1)
    assert graphs["captures"] == 2 and graphs["replays"] == 8 + 10
    assert graphs["held"] == 2 and graphs["kept_caches"] == 1  # kept with the released session's cache
    [one] = summary["rounds"]
    assert one["quality"]["identical"] and one["fps_ratio"] > 0
