"""``rtvideo bench realtime``: K concurrent WebSocket sessions against a running server.

Each session sends ``session.start`` (``num_chunks`` chunks, fmp4), sends a
new prompt at a random moment (seeded by the session's index) within the
chunk period after its ``interact_at`` chunk has arrived, and again every
``interact_every`` chunks after that when that is set, and reads to the end.
Each session is watched by a simulated viewer (``rtvideo/bench/playback.py``): a
playhead that starts with the first chunk, plays in real time, stalls when it
catches up with what arrived, and reports itself every 0.25 s for pacing under
the bundled page's buffer policy (``max_lead_seconds`` ``"adaptive"``, the
default: the lead starts at half a second, grows after each underrun and
shrinks back), or under a fixed budget (a number), or unpaced (``None``).
Figures, over all sessions:

- time to first chunk (``session.start`` sent to the first chunk received),
  and the same minus the worker's compute for that chunk (the serving cost);
- chunk latency (each chunk's arrival after the previous one, the first
  counted from the start) and the inter-chunk gap (chunks after the first);
- interaction to visible: the prompt sent, to the first chunk received whose
  ``started_event_ids`` carries it;
- key to pixel: the prompt sent, to the moment the simulated viewer shows the
  first frame of the chunk the ``session.interaction.applied`` event names
  (what a viewer of the page feels); underruns (playback ran dry while the
  session went on), in all and per minute of viewing (playing or stalled);
- realtime factor (media seconds received per wall second, per session) and
  deadline attainment (chunks received before their playback time, the
  viewer starting with the first chunk and never stalling);
- serving overhead: wall time of the run over the worker's compute for the
  same chunks (``compute_ms`` in each chunk's metadata). One worker computes
  sessions one after another, so 1.0 is the floor; meaningful unpaced
  (``--max-lead off``), where no session waits for its viewer.

The last line printed is one JSON object.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, WebSocketException

from rtvideo.bench.machine import http_of, served_by
from rtvideo.bench.playback import REPORT_EVERY_S, START_S, LeadPolicy, SimulatedPlayer
from rtvideo.bench.stats import percentiles
from rtvideo.engine.progress import Progress

ADAPTIVE = "adaptive"
STALL_TIMEOUT_S = 120.0  # a session that hears nothing from the server for this long has failed


@dataclass(frozen=True)
class RealtimeBenchOptions:
    url: str
    sessions: int = 4
    chunks: int = 12
    interact_at: int = 3
    interact_every: int = 0  # chunks between further prompts after the first; 0: one prompt per session
    max_lead_seconds: float | str | None = ADAPTIVE  # "adaptive": the page's policy; a number: fixed; None: unpaced
    api_key: str | None = None
    prompt: str = "a paper boat drifting down a rainy street"
    stall_timeout_s: float = STALL_TIMEOUT_S

    def __post_init__(self) -> None:
        lead = self.max_lead_seconds
        if not (lead is None or lead == ADAPTIVE or (isinstance(lead, int | float) and lead > 0)):
            raise ValueError(f"max_lead_seconds must be {ADAPTIVE!r}, a number > 0 or None, got {lead!r}")
        if self.interact_at < 0 or self.interact_every < 0:
            raise ValueError("interact_at and interact_every must be >= 0")
        if not self.stall_timeout_s > 0:
            raise ValueError(f"stall_timeout_s must be > 0, got {self.stall_timeout_s}")

    def policy(self) -> LeadPolicy:
        """A session's buffer policy (its start value is the ``max_lead_seconds`` it asks for)."""
        lead = self.max_lead_seconds
        if lead == ADAPTIVE:
            return LeadPolicy()
        return LeadPolicy(START_S if lead is None else float(lead), adaptive=False)

    def budget(self) -> float | None:
        """``max_lead_seconds`` for ``session.start``."""
        return None if self.max_lead_seconds is None else self.policy().start_s

    def prompt_after(self, chunks: int) -> bool:
        """Whether a new prompt is due once ``chunks`` chunks have arrived."""
        after = chunks - 1 - self.interact_at
        return after == 0 or (after > 0 and self.interact_every > 0 and after % self.interact_every == 0)


@dataclass
class SessionResult:
    started: float = 0.0
    arrivals: list[float] = field(default_factory=list)
    compute_ms: list[float] = field(default_factory=list)
    media_start: list[float] = field(default_factory=list)
    media_seconds: float = 0.0
    sent: dict[str, float] = field(default_factory=dict)  # event id -> when the prompt was sent
    visible: dict[str, float] = field(default_factory=dict)  # event id -> its first chunk's arrival
    key_to_pixel_s: list[float] = field(default_factory=list)
    underruns: int = 0
    viewing_s: float = 0.0  # from the first chunk to the end of playback
    error: str | None = None


def session_socket(url: str, api_key: str | None) -> connect:
    """A realtime socket to ``url`` (``async with``), with no limit on a
    message's size, sending ``api_key`` as a bearer token when there is one."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    return connect(url, max_size=None, additional_headers=headers)


def session_start(prompt: str, index: int, chunks: int, max_lead_seconds: float | None, **fields: Any) -> dict:
    """The ``session.start`` of a bench's session ``index``: its own prompt
    (``prompt #index``) and seed (``index``), ``chunks`` chunks as fmp4, and
    ``fields`` besides."""
    return {
        "type": "session.start",
        "prompt": f"{prompt} #{index}",
        "seed": index,
        "num_chunks": chunks,
        "format": "fmp4",
        "max_lead_seconds": max_lead_seconds,
        **fields,
    }


class SessionLost(Exception):
    """A bench session that ended neither with ``session.done`` nor with a fatal
    ``error``: the socket closed, or the server sent nothing for the stall timeout."""


SESSION_FAILURES = (SessionLost, OSError, WebSocketException)
"""What a bench session can fail with, besides a fatal ``error`` event: it is
recorded as that session's failure, and the other sessions and the summary go
on (connecting: refused, a handshake the server answered with an HTTP error)."""


def failure(error: BaseException) -> str:
    """A session's failure, as ``failed_sessions`` lists it."""
    return str(error) if isinstance(error, SessionLost) else f"{type(error).__name__}: {error}"


async def session_events(
    ws: ClientConnection, stall_timeout_s: float = STALL_TIMEOUT_S, with_media: bool = False
) -> AsyncIterator[tuple[str, dict, float]]:
    """The JSON events a realtime socket sends, each as its type, the event and
    when it was read (``time.perf_counter``), up to and including
    ``session.done``, or a fatal ``error`` and the close after it; binary
    messages (the media) are skipped, or with ``with_media`` given as the type
    ``media`` and ``{"bytes": their length}``. Raises ``SessionLost`` when the socket
    closes otherwise, or when no message comes for ``stall_timeout_s``."""
    fatal = False
    while True:
        try:
            async with asyncio.timeout(stall_timeout_s):
                message = await ws.recv()
        except TimeoutError:
            raise SessionLost(f"no message from the server for {stall_timeout_s:g} s (--stall-timeout)") from None
        except ConnectionClosed as closed:
            if fatal:
                return
            raise SessionLost(f"the server closed the socket before session.done: {closed}") from None
        if isinstance(message, bytes):
            if with_media:
                yield "media", {"bytes": len(message)}, time.perf_counter()
            continue
        event = json.loads(message)
        fatal = fatal or (event["type"] == "error" and bool(event.get("fatal")))
        yield event["type"], event, time.perf_counter()
        if event["type"] == "session.done":
            return


async def _report(ws: ClientConnection, player: SimulatedPlayer) -> None:
    """Every ``REPORT_EVERY_S`` once playback started: the playhead, as the policy reports it."""
    while True:
        await asyncio.sleep(REPORT_EVERY_S)
        if player.started:
            player.advance(time.perf_counter())
            position = player.policy.reported(player.position)
            await ws.send(json.dumps({"type": "session.playback", "position_seconds": position}))


async def _prompt(ws: ClientConnection, result: SessionResult, event_id: str, prompt: str, delay: float) -> None:
    """A viewer pressing Send ``delay`` seconds from now."""
    await asyncio.sleep(delay)
    result.sent[event_id] = time.perf_counter()
    interaction = {"event_id": event_id, "event": {"prompt": prompt}}
    await ws.send(json.dumps({"type": "session.interaction", "interaction": interaction}))


async def _session(options: RealtimeBenchOptions, index: int, progress: Progress | None = None) -> SessionResult:
    progress = progress or Progress.silent()  # advanced by each chunk received
    result = SessionResult()
    player = SimulatedPlayer(options.policy())
    moments = random.Random(index)  # when within a chunk period each prompt is sent: seeded, so runs compare
    tasks: set[asyncio.Task] = set()
    try:
        async with session_socket(options.url, options.api_key) as ws:
            start = session_start(options.prompt, index, options.chunks, options.budget())
            result.started = time.perf_counter()
            await ws.send(json.dumps(start))
            fps, period = 16.0, 0.75
            if options.max_lead_seconds is not None:
                tasks.add(asyncio.create_task(_report(ws, player)))
            try:
                async for kind, event, now in session_events(ws, options.stall_timeout_s):
                    if kind == "video.start":
                        fps = event["config"]["fps"]
                        period = event["config"]["frames_per_chunk"] / fps
                    elif kind == "video.chunk_metadata":
                        progress.advance()
                        result.arrivals.append(now)
                        result.compute_ms.append(event["compute_ms"])
                        result.media_start.append(event["media_start_seconds"])
                        result.media_seconds += event["num_frames"] / fps
                        player.received(now, event["media_start_seconds"] + event["num_frames"] / fps)
                        for event_id in event["started_event_ids"]:
                            result.visible.setdefault(event_id, now)
                        if options.prompt_after(len(result.arrivals)):
                            event_id = f"bench-{index}-{len(result.sent)}-{uuid.uuid4().hex[:8]}"
                            prompt = f"a storm at sea #{index}.{len(result.sent)}"
                            delay = moments.uniform(0.0, period)
                            tasks.add(asyncio.create_task(_prompt(ws, result, event_id, prompt, delay)))
                    elif kind == "session.interaction.applied" and event["event_id"] in result.sent:
                        player.watch(event["media_start_seconds"], result.sent[event["event_id"]])
                    elif kind == "error" and event.get("fatal"):
                        result.error = f"{event['code']}: {event['message']}"
                    elif kind == "session.done":
                        player.finish(now)
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)  # their cancels, not this task's
    except SESSION_FAILURES as error:
        result.error = failure(error)
    result.key_to_pixel_s = player.shown_after()
    result.underruns = player.policy.underruns
    if result.arrivals:
        result.viewing_s = player.clock - result.arrivals[0]
    return result


async def run(options: RealtimeBenchOptions, progress: Progress | None = None) -> dict:
    began = time.perf_counter()
    results = await asyncio.gather(*(_session(options, i, progress) for i in range(options.sessions)))
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
        visible += [(r.visible[e] - sent) * 1e3 for e, sent in r.sent.items() if e in r.visible]
        factor.append(r.media_seconds / (r.arrivals[-1] - r.started))
        for arrival, media_start in zip(r.arrivals, r.media_start, strict=True):
            total += 1
            attained += arrival - r.arrivals[0] <= media_start
    compute_s = sum(sum(r.compute_ms) for r in ok) / 1e3
    underruns = sum(r.underruns for r in ok)
    viewing_s = sum(r.viewing_s for r in ok)
    return {
        "bench": "realtime",
        "url": options.url,
        "served_by": await asyncio.to_thread(served_by, http_of(options.url), options.api_key),
        "sessions": options.sessions,
        "chunks_per_session": options.chunks,
        "max_lead_seconds": options.max_lead_seconds,
        "failed_sessions": failed,
        "ttff_ms": percentiles(ttff),
        "ttff_minus_first_chunk_compute_ms": percentiles(ttff_serving),
        "chunk_latency_ms": percentiles(latency),
        "inter_chunk_gap_ms": percentiles(gaps),
        "interaction_to_visible_ms": percentiles(visible),
        "key_to_pixel_ms": percentiles([s * 1e3 for r in ok for s in r.key_to_pixel_s]),
        "underruns": underruns,
        "underruns_per_minute": underruns / (viewing_s / 60) if viewing_s else None,
        "viewing_s": viewing_s,
        "realtime_factor": percentiles(factor),
        "deadline_attainment": attained / total if total else None,
        "wall_s": wall,
        "pipeline_compute_s": compute_s,
        "serving_overhead_ratio": wall / compute_s if compute_s else None,
    }


def main(options: RealtimeBenchOptions, as_json: bool) -> int:
    with Progress("bench realtime", options.sessions * options.chunks, unit="chunk", quiet=as_json) as progress:
        summary = asyncio.run(run(options, progress))
    if not as_json:
        s = summary

        def p(key: str, q: str = "p50") -> float:
            return s[key].get(q, 0.0)

        print(
            f"{options.sessions} sessions x {options.chunks} chunks: TTFF p50 {p('ttff_ms'):.0f} ms "
            f"(serving {p('ttff_minus_first_chunk_compute_ms'):.1f} ms), "
            f"gap p95 {p('inter_chunk_gap_ms', 'p95'):.0f} ms, "
            f"interaction visible p50 {p('interaction_to_visible_ms'):.0f} ms, "
            f"key to pixel p50 {p('key_to_pixel_ms'):.0f} ms p95 {p('key_to_pixel_ms', 'p95'):.0f} ms, "
            f"underruns {s['underruns']} ({s['underruns_per_minute'] or 0:.2f}/min), "
            f"overhead {s['serving_overhead_ratio'] or 0:.3f}, deadlines {s['deadline_attainment'] or 0:.0%}"
        )
    print(json.dumps(summary))
    return 1 if summary["failed_sessions"] else 0
