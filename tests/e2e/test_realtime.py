"""The realtime endpoint against the server as a subprocess: formats, metadata,
interactions landing at the next chunk, and replay through HTTP request mode."""

from __future__ import annotations

import asyncio
import io

import av
import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from rtvideo.server.media import split_jpeg_payload
from tests.e2e.client import Realtime, interaction, open_realtime

START = {"type": "session.start", "prompt": "a paper boat on a river", "seed": 3, "width": 32, "height": 24}


async def run_session(url: str, start: dict) -> Realtime:
    async with open_realtime(url) as ws:
        client = Realtime(ws)
        await client.send(start)
        await client.rest()
        return client


@pytest.mark.parametrize("fmt", ["fmp4", "m4s", "jpeg", "raw"])
async def test_happy_path_per_format(server, fmt):
    client = await run_session(server.ws, {**START, "format": fmt, "num_frames": 10})
    got = client.received
    [start] = got.of("video.start")
    config = start["config"]
    assert start["format"] == config["format"] == ("fmp4" if fmt == "m4s" else fmt)
    assert (config["width"], config["height"], config["num_frames"]) == (32, 24, 10)
    assert config["num_chunks"] == 3 and config["frames_per_chunk"] == 4
    metas = [c.metadata for c in got.chunks]
    assert [m["transport_chunk_index"] for m in metas] == [0, 1, 2]
    assert [m["generation_chunk_index"] for m in metas] == [0, 1, 2]
    assert [m["num_frames"] for m in metas] == [4, 4, 2]  # trimmed to num_frames
    assert [m["first_frame_index"] for m in metas] == [0, 4, 8]
    assert [m["media_start_seconds"] for m in metas] == pytest.approx([0.0, 0.25, 0.5])
    assert all(m["kind"] == "media" and m["request_id"] == start["request_id"] for m in metas)
    [done] = got.of("session.done")
    assert (done["chunks"], done["frames"], done["stopped"], done["reason"]) == (3, 10, False, "completed")
    assert got.close_code == 1000
    payloads = [c.payload for c in got.chunks]
    if config["format"] == "raw":
        assert [len(p) for p in payloads] == [4 * 24 * 32 * 3, 4 * 24 * 32 * 3, 2 * 24 * 32 * 3]
    elif config["format"] == "jpeg":
        images = [split_jpeg_payload(p) for p in payloads]
        assert [len(i) for i in images] == [4, 4, 2]
        frame = next(av.open(io.BytesIO(images[0][0]), format="mjpeg").decode(video=0))
        assert (frame.width, frame.height) == (32, 24)
    else:
        with av.open(io.BytesIO(b"".join(payloads))) as container:  # init segment first, one fragment per chunk
            frames = list(container.decode(video=0))
        assert len(frames) == 10
        assert [f.pts for f in frames] == sorted(f.pts for f in frames)
        assert (frames[0].width, frames[0].height) == (32, 24)


async def test_an_interaction_lands_at_the_next_chunk_and_matches_request_mode(server):
    base = {**START, "format": "raw", "num_chunks": 6}
    async with open_realtime(server.ws) as ws:
        client = Realtime(ws)
        await client.send(base)
        await client.until("video.start")
        first = await client.next()  # chunk 0 arrived; the worker is on chunk 1 or later
        assert first.metadata["generation_chunk_index"] == 0
        await client.send(
            {"type": "session.interaction", "interaction": {"event_id": "u1", "event": {"prompt": "a storm"}}}
        )
        queued = await client.until("session.interaction.queued")
        applied = await client.until("session.interaction.applied")
        live = await client.rest()

    k = applied["generation_chunk_index"]
    if queued["in_progress_chunk_index"] is not None:
        assert k == queued["in_progress_chunk_index"] + 1
    assert k == queued["expected_chunk_index"]
    chunk_k = live.chunks[k].metadata
    assert chunk_k["started_event_ids"] == ["u1"]
    assert applied["first_frame_index"] == chunk_k["first_frame_index"]
    assert applied["media_start_seconds"] == pytest.approx(chunk_k["media_start_seconds"])
    assert applied["queued_to_applied_ms"] >= 0

    plain = await run_session(server.ws, base)
    assert [c.payload for c in live.chunks[:k]] == [c.payload for c in plain.received.chunks[:k]]
    assert [c.payload for c in live.chunks[k:]] != [c.payload for c in plain.received.chunks[k:]]

    job = {key: value for key, value in base.items() if key != "type"}
    job["interactions"] = [{"at_chunk": k, "prompt": "a storm"}]
    response = httpx.post(f"{server.http}/v1/videos/sync", json=job, timeout=60)
    assert response.status_code == 200
    assert response.content == b"".join(c.payload for c in live.chunks)

    [done] = live.of("session.done")
    replay = httpx.post(f"{server.http}/v1/videos/sync", json=done["replay"], timeout=60)
    assert replay.content == b"".join(c.payload for c in live.chunks)


async def test_a_stopped_endless_session_replays_bit_for_bit(server):
    async with open_realtime(server.ws) as ws:
        client = Realtime(ws)
        await client.send({**START, "format": "raw", "transition_chunks": 2})
        await client.next()
        await client.next()
        await client.send(interaction("sunrise"))
        await client.until("session.interaction.applied")
        await client.next()
        await client.send({"type": "session.ping"})
        await client.until("session.pong")
        await client.send({"type": "session.stop"})
        live = await client.rest()
    [done] = live.of("session.done")
    assert done["stopped"] and done["reason"] == "stopped" and live.close_code == 1000
    assert done["frames"] == sum(c.metadata["num_frames"] for c in live.chunks)
    assert done["replay"]["interactions"][0]["prompt"] == "sunrise"
    replay = httpx.post(f"{server.http}/v1/videos/sync", json=done["replay"], timeout=60)
    assert replay.status_code == 200
    assert replay.content == b"".join(c.payload for c in live.chunks)
    frames = np.frombuffer(replay.content, dtype=np.uint8)
    assert frames.size == done["frames"] * 24 * 32 * 3


def scrape(server) -> dict[tuple[str, tuple], float]:
    samples = {}
    for family in text_string_to_metric_families(httpx.get(f"{server.http}/metrics", timeout=10).text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def metric(samples, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


async def test_client_disconnect_mid_chunk_frees_the_session(make_server):
    # 1 s chunks (four 0.25 s steps); a stop cuts a chunk short between two steps.
    server = make_server(pipeline={"step_time_s": 0.25})
    async with open_realtime(server.ws) as ws:
        client = Realtime(ws)
        await client.send({**START, "format": "raw"})
        await client.until("video.start")
        first = await client.next()
        assert first.metadata["generation_chunk_index"] == 0
        # The worker's acknowledgement names the chunk in progress when it arrived: chunk 1 is.
        await client.send(interaction("a storm", "mid"))
        queued = await client.until("session.interaction.queued")
        assert (queued["in_progress_chunk_index"], queued["expected_chunk_index"]) == (1, 2)
    # The socket closed with chunk 1 in progress.

    deadline = asyncio.get_running_loop().time() + 30
    while metric(after := scrape(server), "rtvideo_sessions_total", outcome="client_disconnected") != 1.0:
        assert asyncio.get_running_loop().time() < deadline, "the disconnected session never ended"
    # Chunk 1 never finished: the disconnect reached the worker while it was in progress, and cut it short.
    assert metric(after, "rtvideo_chunks_delivered_total") == 1.0
    assert metric(after, "rtvideo_interactions_total", outcome="queued") == 1.0
    assert metric(after, "rtvideo_interactions_total", outcome="rejected") == 1.0  # "mid" ended, never applied
    assert metric(after, "rtvideo_interactions_total", outcome="applied") == 0.0
    assert metric(after, "rtvideo_sessions_active") == 0.0
    server.released()  # the worker released everything the session held


async def test_a_client_that_stops_reading_holds_its_own_session(make_server):
    """Pacing off, 2.3 MB chunks, a client that reads nothing for two seconds: the
    engine makes at most max_undelivered_seconds of media beyond what the socket
    took (plus what the socket buffers hold), instead of all it can; a client
    reading alongside is not held."""
    server = make_server("--max-undelivered-seconds", "1", pipeline={"step_time_s": 0.001, "max_size": 512})
    start = {**START, "format": "raw", "width": 448, "height": 448, "max_lead_seconds": None}
    # No compression: the stub's frames deflate to almost nothing, and the socket would never fill.
    stalled = open_realtime(server.ws, max_queue=1, compression=None)
    async with stalled as stalled_ws, open_realtime(server.ws) as reader_ws:
        stalled, reader = Realtime(stalled_ws), Realtime(reader_ws)
        await stalled.send(start)
        await reader.send({**start, "width": 32, "height": 32})
        await stalled.until("video.start")
        deadline = asyncio.get_running_loop().time() + 2.0
        while asyncio.get_running_loop().time() < deadline:  # the stalled client reads nothing meanwhile
            await reader.next()
        await stalled.send({"type": "session.stop"})
        got = await stalled.rest()
        await reader.send({"type": "session.stop"})
        read = await reader.rest()
    done = got.of("session.done")[0]
    assert done["chunks"] == len(got.chunks) and len(got.chunks) < 30, len(got.chunks)  # unheld: hundreds
    assert len(read.chunks) > 2 * len(got.chunks)
