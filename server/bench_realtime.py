"""``rtvideo bench realtime``: K concurrent WebSocket sessions against a running server.

Each session sends ``session.start`` (``num_chunks`` chunks, fmp4), sends a
new prompt once its ``interact_at`` chunk has arrived, and reads to the end.
Figures, over all sessions:

- time to first chunk (``session.start`` sent to the first chunk received),
  and the same minus the worker's compute for that chunk (the serving cost);
- chunk latency (each chunk's arrival after the previous one, the first
  counted from the start) and the inter-chunk gap (chunks after the first);
- interaction to visible: the prompt sent, to the first chunk received whose
  ``started_event_ids`` carries it;
- realtime factor (media seconds received per wall second, per session) and
  deadline attainment (chunks received before their playback time, the
  viewer starting with the first chunk);
- serving overhead: wall time of the run over the worker's compute for the
  same chunks (``compute_ms`` in each chunk's metadata). One worker computes
  sessions one after another, so 1.0 is the floor.

The last line printed is one JSON object.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field

from websockets.asyncio.client import connect

from server.benchstats import percentiles


@dataclass(frozen=True)
class RealtimeBenchOptions:
    url: str
    sessions: int = 4
    chunks: int = 12
    interact_at: int = 3
    max_lead_seconds: float | None = None
    api_key: str | None = None
    prompt: str = "a paper boat drifting down a rainy street"


@dataclass
class SessionResult:
    started: float = 0.0
    arrivals: list[float] = field(default_factory=list)
    compute_ms: list[float] = field(default_factory=list)
    media_start: list[float] = field(default_factory=list)
    media_seconds: float = 0.0
    interaction_sent: float | None = None
    interaction_visible: float | None = None
    error: str | None = None


async def _session(options: RealtimeBenchOptions, index: int) -> SessionResult:
    result = SessionResult()
    headers = {"Authorization": f"Bearer {options.api_key}"} if options.api_key else None
    event_id = f"bench-{index}-{uuid.uuid4().hex[:8]}"
    async with connect(options.url, max_size=None, additional_headers=headers) as ws:
        start = {
            "type": "session.start",
            "prompt": f"{options.prompt} #{index}",
            "seed": index,
            "num_chunks": options.chunks,
            "format": "fmp4",
            "max_lead_seconds": options.max_lead_seconds,
        }
        result.started = time.perf_counter()
        await ws.send(json.dumps(start))
        fps = 16.0
        while True:
            message = await ws.recv()
            if isinstance(message, bytes):
                continue
            event = json.loads(message)
            kind = event["type"]
            if kind == "video.start":
                fps = event["config"]["fps"]
            elif kind == "video.chunk_metadata":
                now = time.perf_counter()
                result.arrivals.append(now)
                result.compute_ms.append(event["compute_ms"])
                result.media_start.append(event["media_start_seconds"])
                result.media_seconds += event["num_frames"] / fps
                if event_id in event["started_event_ids"] and result.interaction_visible is None:
                    result.interaction_visible = now
                if len(result.arrivals) == options.interact_at + 1:
                    result.interaction_sent = time.perf_counter()
                    interaction = {"event_id": event_id, "event": {"prompt": f"a storm at sea #{index}"}}
                    await ws.send(json.dumps({"type": "session.interaction", "interaction": interaction}))
            elif kind == "error" and event.get("fatal"):
                result.error = f"{event['code']}: {event['message']}"
            elif kind == "session.done":
                return result


async def run(options: RealtimeBenchOptions) -> dict:
    began = time.perf_counter()
    results = await asyncio.gather(*(_session(options, i) for i in range(options.sessions)))
    wall = time.perf_counter() - began
    failed = [r.error for r in results if r.error]
    ok = [r for r in results if not r.error and r.arrivals]
    ttff = [(r.arrivals[0] - r.started) * 1e3 for r in ok]
    ttff_serving = [(r.arrivals[0] - r.started) * 1e3 - r.compute_ms[0] for r in ok]
    latency, gaps, visible, factor, attained, total = [], [], [], [], 0, 0
    for r in ok:
        previous = r.started
        for arrival in r.arrivals:
            latency.append((arrival - previous) * 1e3)
            previous = arrival
        gaps += [(b - a) * 1e3 for a, b in zip(r.arrivals, r.arrivals[1:], strict=False)]
        if r.interaction_sent is not None and r.interaction_visible is not None:
            visible.append((r.interaction_visible - r.interaction_sent) * 1e3)
        factor.append(r.media_seconds / (r.arrivals[-1] - r.started))
        for arrival, media_start in zip(r.arrivals, r.media_start, strict=True):
            total += 1
            attained += arrival - r.arrivals[0] <= media_start
    compute_s = sum(sum(r.compute_ms) for r in ok) / 1e3
    return {
        "bench": "realtime",
        "url": options.url,
        "sessions": options.sessions,
        "chunks_per_session": options.chunks,
        "max_lead_seconds": options.max_lead_seconds,
        "failed_sessions": failed,
        "ttff_ms": percentiles(ttff),
        "ttff_minus_first_chunk_compute_ms": percentiles(ttff_serving),
        "chunk_latency_ms": percentiles(latency),
        "inter_chunk_gap_ms": percentiles(gaps),
        "interaction_to_visible_ms": percentiles(visible),
        "realtime_factor": percentiles(factor),
        "deadline_attainment": attained / total if total else None,
        "wall_s": wall,
        "pipeline_compute_s": compute_s,
        "serving_overhead_ratio": wall / compute_s if compute_s else None,
    }


def main(options: RealtimeBenchOptions, as_json: bool) -> int:
    summary = asyncio.run(run(options))
    if not as_json:
        s = summary

        def p(key: str, q: str = "p50") -> float:
            return s[key].get(q, 0.0)

        print(
            f"{options.sessions} sessions x {options.chunks} chunks: TTFF p50 {p('ttff_ms'):.0f} ms "
            f"(serving {p('ttff_minus_first_chunk_compute_ms'):.1f} ms), "
            f"gap p95 {p('inter_chunk_gap_ms', 'p95'):.0f} ms, "
            f"interaction visible p50 {p('interaction_to_visible_ms'):.0f} ms, "
            f"overhead {s['serving_overhead_ratio'] or 0:.3f}, deadlines {s['deadline_attainment'] or 0:.0%}"
        )
    print(json.dumps(summary))
    return 1 if summary["failed_sessions"] else 0
