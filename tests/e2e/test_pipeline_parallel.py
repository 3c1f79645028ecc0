"""The server with the tiny model split over two pipeline ranks (``--pp 2``), end
to end: a WebSocket session with an interaction, its replay, and the ranks'
figures on /metrics; sessions that drop, stop and finish side by side all let go."""

from __future__ import annotations

import asyncio
import re

import httpx

from tests.e2e.client import Realtime, assert_applied_as_promised, interaction, open_realtime


async def test_a_realtime_session_under_two_ranks_applies_an_interaction_and_replays_exactly(make_server):
    """An endless session, so the prompt always has a next chunk to land on
    however far the worker ran ahead of this client (a session of a few chunks
    can be made whole before the prompt arrives); stopped once the chunk after
    the applied one is in."""
    server = make_server("--pp", "2", model="tiny")
    async with open_realtime(server.ws) as ws:
        client = Realtime(ws)
        await client.send({"type": "session.start", "prompt": "a red fox", "format": "raw", "seed": 3})
        await client.until("video.start")
        await client.next()  # chunk 0
        await client.send(interaction("a blue whale", "w"))
        queued = await client.until("session.interaction.queued")
        applied = await client.until("session.interaction.applied")
        while not any(
            c.metadata["generation_chunk_index"] > applied["generation_chunk_index"] for c in client.received.chunks
        ):
            await client.next()
        await client.send({"type": "session.stop"})
        got = await client.rest()
    assert_applied_as_promised(queued, applied)
    made = [c.metadata["generation_chunk_index"] for c in got.chunks]
    assert made == list(range(len(made))) and len(made) >= applied["generation_chunk_index"] + 2
    [done] = got.of("session.done")
    assert done["reason"] == "stopped"
    assert done["replay"]["interactions"][0]["prompt"] == "a blue whale"
    replay = httpx.post(f"{server.http}/v1/videos/sync", json=done["replay"], timeout=120)
    assert replay.status_code == 200 and replay.content == b"".join(c.payload for c in got.chunks)
    metrics = httpx.get(f"{server.http}/metrics", timeout=10).text
    for rank in ("0", "1"):
        assert f'rtvideo_rank_busy_seconds_total{{rank="{rank}"}}' in metrics
    # every chunk's frames came from the follower (the decoder split over the ranks: auto on a CPU)
    decoded = dict(re.findall(r'rtvideo_rank_decoded_chunks_total\{rank="(\d)"\} ([\d.]+)', metrics))
    assert float(decoded["0"]) == 0 and float(decoded["1"]) >= len(made)
    assert "rtvideo_micro_steps_total" in metrics and "rtvideo_rows_per_micro_step" in metrics


async def test_sessions_that_vanish_stop_or_finish_together_under_two_ranks_are_all_let_go(make_server):
    """Three realtime sessions at once on two ranks: one client's connection
    drops mid-stream (no stop: the server ends the session once the resume
    grace is over), one stops, one runs to its last chunk. Each ends as it
    should, the worker then holds nothing of any of them, and a new session
    streams."""
    server = make_server("--pp", "2", "--resume-grace-s", "0.5", model="tiny")
    start = {"type": "session.start", "prompt": "a red fox", "format": "raw"}

    async def dropped() -> None:
        client = Realtime(await open_realtime(server.ws))
        await client.send({**start, "seed": 1})
        await client.until("video.start")
        while len(client.received.chunks) < 2:
            await client.next()
        client.ws.transport.abort()  # a network drop: no closing handshake, no stop

    async def stopped() -> dict:
        async with open_realtime(server.ws) as ws:
            client = Realtime(ws)
            await client.send({**start, "seed": 2})
            await client.until("video.start")
            while len(client.received.chunks) < 3:
                await client.next()
            await client.send({"type": "session.stop"})
            got = await client.rest()
        [done] = got.of("session.done")
        return done

    async def finished() -> tuple[dict, list[int]]:
        async with open_realtime(server.ws) as ws:
            client = Realtime(ws)
            await client.send({**start, "seed": 3, "num_chunks": 4})
            got = await client.rest()
        [done] = got.of("session.done")
        return done, [c.metadata["generation_chunk_index"] for c in got.chunks]

    _, stop_done, (finish_done, made) = await asyncio.gather(dropped(), stopped(), finished())
    assert stop_done["reason"] == "stopped"
    assert finish_done["reason"] == "completed" and made == [0, 1, 2, 3]
    server.released(within=30)  # the dropped one too, once its grace ran out

    async with open_realtime(server.ws) as ws:
        client = Realtime(ws)
        await client.send({**start, "seed": 4, "num_chunks": 2})
        got = await client.rest()
    assert [c.metadata["generation_chunk_index"] for c in got.chunks] == [0, 1]
    assert got.of("session.done")[0]["reason"] == "completed"
