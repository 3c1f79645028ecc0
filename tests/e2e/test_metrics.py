"""``/metrics`` parses as Prometheus text and every family moves as it should
across a scripted run: sessions, an interaction, a refused start, a
disconnect, a job."""

from __future__ import annotations

import os
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.client import Realtime, interaction, open_realtime


def scrape(server) -> dict[tuple[str, tuple], float]:
    response = httpx.get(f"{server.http}/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


async def test_metrics_follow_a_scripted_run(make_server):
    server = make_server("--max-sessions", "1", pipeline={"step_time_s": 0.002, "memory_budget": 65536})
    before = scrape(server)
    assert not [name for name, _ in before if name.endswith("_created")], "timestamp series look like counts"
    assert value(before, "rtvideo_worker_up") == 1.0
    assert value(before, "rtvideo_sessions_active") == 0.0
    assert value(before, "rtvideo_session_memory_budget_bytes") == 65536.0
    assert value(before, "rtvideo_session_memory_held_bytes") == 0.0

    async with open_realtime(server.ws) as ws:
        client = Realtime(ws)
        # Unpaced: a playhead report here must not hold it at a boundary with the
        # interaction waiting (pacing would, had the worker run ahead of the report).
        await client.send({"type": "session.start", "prompt": "p", "format": "raw", "max_lead_seconds": None})
        await client.until("video.start")
        await client.next()
        mid = scrape(server)
        assert value(mid, "rtvideo_sessions_active") == 1.0
        assert value(mid, "rtvideo_session_memory_held_bytes") == 4096.0  # the stub's 32x32 x 4 bytes
        async with open_realtime(server.ws) as ws2:  # the server is full
            refused = Realtime(ws2)
            await refused.send({"type": "session.start", "prompt": "p"})
            await refused.rest(timeout=10)
        await client.send({"type": "session.playback", "position_seconds": 0.1})
        await client.send(interaction("q", "e1"))
        await client.until("session.interaction.applied")
        await client.next()
        await client.send({"type": "session.stop"})
        await client.rest()

    async with open_realtime(server.ws) as ws:  # a client that disappears mid-stream
        client = Realtime(ws)
        await client.send({"type": "session.start", "prompt": "p", "format": "raw"})
        await client.until("video.start")
        await client.next()

    job = httpx.post(
        f"{server.http}/v1/videos/sync", json={"prompt": "p", "num_chunks": 2, "format": "raw"}, timeout=60
    )
    assert job.status_code == 200

    deadline = time.monotonic() + 30.0
    while time.monotonic() < deadline:  # the disconnected session ends asynchronously (slower on a loaded machine)
        after = scrape(server)
        if value(after, "rtvideo_sessions_total", outcome="client_disconnected") == 1.0:
            break
    assert value(after, "rtvideo_sessions_active") == 0.0
    assert value(after, "rtvideo_session_memory_held_bytes") == 0.0
    assert value(after, "rtvideo_sessions_total", outcome="stopped") == 1.0
    assert value(after, "rtvideo_sessions_total", outcome="client_disconnected") == 1.0
    assert value(after, "rtvideo_session_rejections_total", reason="server_full") == 1.0
    assert value(after, "rtvideo_time_to_first_chunk_seconds_count") == 2.0
    assert value(after, "rtvideo_inter_chunk_interval_seconds_count") >= 2.0
    assert value(after, "rtvideo_chunk_compute_seconds_count") >= 4.0
    assert value(after, "rtvideo_chunk_realtime_factor_count") >= 4.0
    assert value(after, "rtvideo_media_lead_seconds_count") >= 4.0
    assert value(after, "rtvideo_interactions_total", outcome="queued") == 1.0
    assert value(after, "rtvideo_interactions_total", outcome="applied") == 1.0
    assert value(after, "rtvideo_interaction_latency_seconds_count") == 1.0
    assert value(after, "rtvideo_interaction_lag_chunks_count") == 1.0
    assert value(after, "rtvideo_interaction_lag_chunks_sum") == 1.0  # exactly one chunk
    chunks = value(after, "rtvideo_chunks_delivered_total")
    assert chunks >= 4.0 and value(after, "rtvideo_deadline_misses_total") <= chunks
    assert value(after, "rtvideo_frames_generated_total") >= 4 * chunks + 8  # realtime chunks plus the job's
    assert value(after, "rtvideo_jobs_total", status="completed") == 1.0


def test_the_api_process_and_its_worker_export_their_memory_and_open_files(server):
    """``process_*`` (the API process) and ``rtvideo_worker_process_*`` (the worker
    it spawned, the pid /health names), read from /proc at scrape time."""
    pid = httpx.get(f"{server.http}/health").json()["workers"][0]["pid"]
    samples = scrape(server)
    with open(f"/proc/{pid}/stat") as stat:
        worker_start_ticks = float(stat.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/stat") as stat:
        boot = next(float(line.split()[1]) for line in stat if line.startswith("btime "))
    worker_start = boot + worker_start_ticks / os.sysconf("SC_CLK_TCK")
    assert value(samples, "rtvideo_worker_process_start_time_seconds") == pytest.approx(worker_start)
    assert value(samples, "process_start_time_seconds") < worker_start  # the API process spawned it
    for prefix in ("process", "rtvideo_worker_process"):
        assert value(samples, f"{prefix}_resident_memory_bytes") > 16 * 2**20
        assert value(samples, f"{prefix}_open_fds") >= 3
        assert value(samples, f"{prefix}_cpu_seconds_total") > 0
    assert value(samples, "python_gc_collections_total", generation="0") > 0
