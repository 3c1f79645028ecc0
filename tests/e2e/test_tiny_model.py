"""The built-in tiny preset (random weights) behind the real server, shared by
these tests (``tiny_server``: up to 3 rows a forward)."""

from __future__ import annotations

import io
import time
from concurrent.futures import ThreadPoolExecutor

import av
import httpx

from tests.e2e.client import Realtime, assert_applied_as_promised, interaction, open_realtime


async def test_tiny_model_streams_fmp4_and_applies_an_interaction_at_the_next_chunk(tiny_server):
    server = tiny_server
    [card] = httpx.get(f"{server.http}/v1/models").json()["data"]
    assert card["id"] == "tiny" and card["prompts"] == []  # random weights know no prompts
    async with open_realtime(server.ws) as ws:
        client = Realtime(ws)
        await client.send({"type": "session.start", "prompt": "a red fox", "num_chunks": 4, "prompt_change": "recache"})
        start = await client.until("video.start")
        assert start["config"]["first_chunk_frames"] == 9 and start["config"]["frames_per_chunk"] == 12
        await client.next()  # chunk 0
        await client.send(interaction("a blue whale", "w"))
        queued = await client.until("session.interaction.queued")
        applied = await client.until("session.interaction.applied")
        got = await client.rest()
    assert_applied_as_promised(queued, applied)
    assert [c.metadata["num_frames"] for c in got.chunks] == [9, 12, 12, 12]
    with av.open(io.BytesIO(b"".join(c.payload for c in got.chunks))) as container:
        frames = list(container.decode(video=0))
    assert len(frames) == 45 and (frames[0].width, frames[0].height) == (64, 64)
    assert got.of("session.done")[0]["frames"] == 45

    [done] = got.of("session.done")
    replay = {**done["replay"], "format": "raw"}
    first = httpx.post(f"{server.http}/v1/videos/sync", json=replay, timeout=120)
    second = httpx.post(f"{server.http}/v1/videos/sync", json=replay, timeout=120)
    assert first.status_code == 200 and first.content == second.content  # deterministic
    assert len(first.content) == 45 * 64 * 64 * 3


async def test_tiny_model_live_session_replays_bit_for_bit(tiny_server):
    server = tiny_server
    async with open_realtime(server.ws) as ws:
        client = Realtime(ws)
        start = {"type": "session.start", "prompt": "a red fox", "format": "raw", "transition_chunks": 2}
        await client.send({**start, "prompt_change": "soft", "seed": 4})
        await client.next()  # video.start
        await client.next()  # chunk 0
        await client.send(interaction("a blue whale"))
        await client.until("session.interaction.applied")
        await client.next()
        await client.next()
        await client.send({"type": "session.stop"})
        live = await client.rest()
    [done] = live.of("session.done")
    replay = httpx.post(f"{server.http}/v1/videos/sync", json=done["replay"], timeout=120)
    assert done["replay"]["exact"] is True  # one session: every chunk ran alone
    assert replay.status_code == 200
    assert replay.content == b"".join(c.payload for c in live.chunks)


def _counter(metrics: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in metrics.splitlines() if line.startswith(name + " "))


def test_tiny_model_jobs_batched_together_are_exact_and_replay_alone_bit_for_bit(tiny_server):
    """Three jobs whose chunks share batched forwards (``--max-batch-rows 3``) make
    the bytes each makes alone: the batched forward is batch-invariant on a CPU,
    so each job says ``exact: true`` and its request, posted again alone,
    regenerates it."""
    server = tiny_server

    def counters() -> tuple[float, float]:
        metrics = httpx.get(f"{server.http}/metrics").text
        return _counter(metrics, "rtvideo_micro_step_rows_total"), _counter(metrics, "rtvideo_micro_steps_total")

    rows_before, steps_before = counters()  # the server is shared: only this test's micro-steps count
    bodies = [{"prompt": f"scene {i}", "seed": i, "num_chunks": 3, "format": "raw"} for i in range(3)]
    with ThreadPoolExecutor(len(bodies)) as posting:  # posted together, so that their chunks line up
        posts = posting.map(lambda body: httpx.post(f"{server.http}/v1/videos", json=body, timeout=60), bodies)
        ids = [post.json()["id"] for post in posts]
    deadline = time.monotonic() + 120
    while {httpx.get(f"{server.http}/v1/videos/{i}").json()["status"] for i in ids} != {"completed"}:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    for _ in range(100):  # the figures of the jobs' last micro-steps (sent once the worker is idle)
        rows, steps = counters()
        if rows - rows_before == 3 * 3 * 4:
            break
        time.sleep(0.05)
    # 36 rows (3 jobs x 3 chunks x 4 steps): alone they would take 36 micro-steps
    # and more (opens and releases carry none); shared forwards take fewer.
    assert rows - rows_before == 36 and steps - steps_before < 36
    for video_id, body in zip(ids, bodies, strict=True):
        job = httpx.get(f"{server.http}/v1/videos/{video_id}").json()
        assert job["exact"] is True and job["inexact_reason"] is None
        batched = httpx.get(f"{server.http}/v1/videos/{video_id}/content").content
        alone = httpx.post(f"{server.http}/v1/videos/sync", json=body, timeout=120)
        assert alone.status_code == 200 and alone.content == batched, body["prompt"]
