"""``rtvideo bench soak``: a running server taken, round after round, through
the paths a long-lived server goes through, while its memory and open files
are watched.

A round runs these paths, at most ``concurrency`` at a time, each checked
for what the protocol promises:

- ``plain``: a session of ``chunks`` chunks, paced and held after its first
  chunk by a playhead reported at 0; then a text frame that is not JSON (a
  non-fatal ``invalid_json``; the session goes on), a new prompt (it ends
  once: applied, superseded or an error), and a playhead far ahead; read to
  ``session.done`` (``completed``), its chunks 0..n-1 each once;
- ``stopped``: an open-ended session stopped once its first chunk arrived
  (``session.done``, reason ``stopped``);
- ``left``: an open-ended session whose client closes its socket (1000)
  after the first chunk: the server ends it (the idle check below sees it);
- ``resumed``: a session whose socket drops (no closing handshake) after its
  first chunk, taken over on a new socket with ``session.resume``: across
  the two sockets chunks 0..n-1 each once, ``completed``;
- ``watched``: an open-ended session a spectator joins (``?watch=``) after
  its first chunk, stopped once the spectator has a chunk; both read to
  ``session.done`` (``stopped``), the spectator's chunks the last of the
  controller's, in order;
- ``shared``: an open-ended ``shared_control`` session a second controller
  joins (``?control=``) after its first chunk: its prompt is applied,
  ``c1`` hears it as ``c2``'s, and its stop ends the session for both
  (``stopped``);
- ``restyled``: video to video, a session of ``chunks`` chunks with an
  ``input``: JPEG frames of a moving scene at the model's default size, sent
  in real time from ``video.start`` on; ``completed``, chunks 0..n-1 each
  once, each made from input frames (``input_frame_indexes``);
- ``refused``: a ``session.start`` with a width of -1: a fatal
  ``invalid_event`` whose message names ``width``, then the close;
- ``job``: ``POST /v1/videos`` of ``chunks`` chunks, polled to
  ``completed``, its MP4 fetched (``ftyp`` first), then deleted;
- ``cancelled``: a job deleted as soon as it was made (``cancelled``, or
  ``completed`` when it was that fast).

After each round the bench waits until the server is idle (no realtime
session open, no viewer attached) and reads ``/metrics``: the API process's
resident memory and open files (``process_*``) and its worker's
(``rtvideo_worker_process_*``, rank 0). A server fills some things once
(imports, pools, caches, the allocator's arenas: on the stub model the API
process grows by about 10 MiB over its first hundred rounds, then stays),
so a leak is judged on the second half of the rounds after the
``warm_up_rounds``: growth there past ``max_growth_mib`` of resident memory,
or past ``max_fd_growth`` open files of an idle process. A path that breaks
its promise is a failure. The summary
(the last line, JSON) gives both, each figure per round, and the exit
status is 1 when there was either. ``--rounds 3`` makes a quick check of the
paths alone; judging a leak wants minutes (``enough_rounds``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from websockets.asyncio.client import ClientConnection

from rtvideo.bench import v2v
from rtvideo.bench.machine import http_of, served_by, server_request
from rtvideo.bench.realtime import SESSION_FAILURES, failure, session_events, session_socket
from rtvideo.engine.progress import Progress

PATHS = ("plain", "stopped", "left", "resumed", "watched", "shared", "restyled", "refused", "job", "cancelled")
WATCHED = {
    "api_rss_mib": "process_resident_memory_bytes",
    "worker_rss_mib": "rtvideo_worker_process_resident_memory_bytes",
    "api_open_fds": "process_open_fds",
    "worker_open_fds": "rtvideo_worker_process_open_fds",
}
OUTCOMES = ("session.interaction.applied", "session.interaction.superseded", "error")
Until = Callable[[str, dict, int | None], bool]  # _read's stop: (kind, event, the chunk just whole or None)
IDLE_TIMEOUT_S = 30.0  # after a round, the server's sessions must all have ended within this
RESUME_TRIES_S = 10.0  # how long a resume is tried again while the dropped socket is not yet noticed


class SoakFailure(Exception):
    """A path that did not get what the protocol promises; the message says what
    (never a ``video.start`` whole: its tokens stay out of the summary)."""


@dataclass(frozen=True)
class SoakOptions:
    url: str  # the realtime socket's URL (ws://…/v1/realtime/video)
    minutes: float = 10.0  # rounds begin until this long has passed
    rounds: int | None = None  # or stop after this many rounds (whichever comes first)
    chunks: int = 3
    concurrency: int = 2  # paths of a round in flight at once (each is one session or job)
    warm_up_rounds: int = 3
    max_growth_mib: float = 8.0
    max_fd_growth: int = 4
    api_key: str | None = None
    stall_timeout_s: float = 60.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.minutes > 0:
            raise ValueError(f"minutes must be > 0, got {self.minutes}")
        if self.rounds is not None and self.rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {self.rounds}")
        if self.chunks < 2:
            raise ValueError(f"chunks must be >= 2 (a path acts after the first chunk), got {self.chunks}")
        if self.concurrency < 1 or self.warm_up_rounds < 0 or self.max_fd_growth < 0:
            raise ValueError("concurrency must be >= 1, warm_up_rounds and max_fd_growth >= 0")
        if not self.max_growth_mib >= 0:
            raise ValueError(f"max_growth_mib must be >= 0, got {self.max_growth_mib}")


@dataclass
class Chunks:
    """A session's chunks as one socket received them: a chunk counts once its
    bytes arrived after its metadata."""

    indexes: list[int] = field(default_factory=list)
    pending: int | None = None
    started: dict | None = None  # the socket's video.start
    # per chunk: how many input frames it was made from, and its frames (with an input: as many)
    made_from: list[tuple[int, int]] = field(default_factory=list)

    def see(self, kind: str, event: dict) -> int | None:
        """Note one message; the index of a chunk that just became whole, else None."""
        if kind == "video.start":
            self.started = event
        elif kind == "video.chunk_metadata":
            self.pending = event["generation_chunk_index"]
            self.made_from.append((len(event.get("input_frame_indexes") or ()), event["num_frames"]))
        elif kind == "media" and self.pending is not None:
            self.indexes.append(self.pending)
            self.pending, whole = None, self.pending
            return whole
        return None


def whole_chunk(index: int | None = None) -> Until:
    """``_read``'s stop once chunk ``index`` is whole (None: the next chunk that is)."""
    return lambda _, __, whole: whole is not None and index in (None, whole)


def outcome_of(event: dict, event_id: str) -> bool:
    """Whether ``event`` ends the interaction ``event_id``: applied, superseded, or its error."""
    return event.get("type") in OUTCOMES and event.get("event_id") == event_id


@contextlib.asynccontextmanager
async def meanwhile(work: Awaitable[Any]) -> AsyncIterator[asyncio.Future]:
    """``work`` runs as a task for the block; at its end the task is cancelled
    if not done, and awaited, so no failure of it goes unseen."""
    task = asyncio.ensure_future(work)
    try:
        yield task
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def expect(condition: bool, what: str) -> None:
    if not condition:
        raise SoakFailure(what)


class Soak:
    """One soak against one server: its paths, the server's figures per round."""

    def __init__(self, options: SoakOptions) -> None:
        self.options = options
        self.http = http_of(options.url)
        self.gate = asyncio.Semaphore(options.concurrency)
        self.counts = {path: 0 for path in PATHS}
        self.failures: list[str] = []
        self.samples: list[dict[str, float | None]] = []
        self._frames: tuple[v2v.InputShape, list[bytes]] | None = None  # the restyled path's input

    # ------------------------------------------------------------------ realtime

    def _socket(self, query: str = "") -> Any:
        return session_socket(self.options.url + query, self.options.api_key)

    def _start(self, name: str, chunks: int | None) -> dict:
        return {
            "type": "session.start",
            "prompt": f"a soak of the {name} path",
            "seed": random.randrange(1 << 31),
            "num_chunks": chunks,
            "format": "fmp4",
            "max_lead_seconds": None,  # unpaced: nothing here plays the video
        }

    def _events(self, ws: ClientConnection):
        return session_events(ws, self.options.stall_timeout_s, with_media=True)

    async def _read(
        self, ws: ClientConnection, chunks: Chunks, until: Until | None = None, heard: list[dict] | None = None
    ) -> dict:
        """Read ``ws`` to the first event ``until(kind, event, whole)`` accepts
        (``whole``: the index of the chunk whose bytes just came, else None), or
        else to ``session.done``; that event is returned. The events read (not the
        media) go to ``heard`` when it is given. A fatal error, or the socket
        ending first, fails the path."""
        async with contextlib.aclosing(self._events(ws)) as events:
            async for kind, event, _ in events:
                if kind == "error" and event["fatal"]:
                    raise SoakFailure(f"{event['code']}: {event['message']}")
                whole = chunks.see(kind, event)
                if heard is not None and kind != "media":
                    heard.append(event)
                if kind == "session.done" or (until is not None and until(kind, event, whole)):
                    return event
        raise SoakFailure("the socket ended before session.done")

    async def plain(self) -> None:
        n = self.options.chunks
        chunks = Chunks()
        async with self._socket() as ws:
            # Paced with a tiny budget and a playhead held at 0, the session waits
            # at a boundary before its last chunk, so the prompt always meets it
            # running; a report far ahead then lets it finish.
            start = {**self._start("plain", n), "max_lead_seconds": 0.01}
            await ws.send(json.dumps(start))
            await self._read(ws, chunks, until=whole_chunk(0))
            await ws.send(json.dumps({"type": "session.playback", "position_seconds": 0}))
            await ws.send("this is not JSON")
            event_id = f"soak-{uuid.uuid4().hex[:12]}"
            interaction = {"event_id": event_id, "event": {"prompt": "a soak's second prompt"}}
            await ws.send(json.dumps({"type": "session.interaction", "interaction": interaction}))
            await ws.send(json.dumps({"type": "session.playback", "position_seconds": 1e9}))
            heard: list[dict] = []
            done = await self._read(ws, chunks, heard=heard)
        refused = any(e["type"] == "error" and e["code"] == "invalid_json" for e in heard)
        ends = [e["code"] if e["type"] == "error" else e["type"] for e in heard if outcome_of(e, event_id)]
        expect(refused, "plain: a text frame that is not JSON got no invalid_json error")
        expect(len(ends) == 1, f"plain: the prompt ended {len(ends)} times ({ends})")
        self._completed("plain", done, chunks.indexes, n)

    def _completed(self, path: str, done: dict | None, indexes: list[int], n: int) -> None:
        expect(done is not None and done["reason"] == "completed", f"{path}: ended {done}, not completed")
        expect(indexes == list(range(n)), f"{path}: chunks {indexes}, not 0..{n - 1} each once")

    async def stopped(self) -> None:
        async with self._socket() as ws:
            await ws.send(json.dumps(self._start("stopped", None)))
            await self._read(ws, Chunks(), until=whole_chunk(0))
            await ws.send(json.dumps({"type": "session.stop"}))
            done = await self._read(ws, Chunks())
        expect(done["reason"] == "stopped", f"stopped: ended {done['reason']}, not stopped")

    async def left(self) -> None:
        async with self._socket() as ws:
            await ws.send(json.dumps(self._start("left", None)))
            await self._read(ws, Chunks(), until=whole_chunk(0))
        # the close (1000) ends the session; the round's idle check sees that it did

    async def resumed(self) -> None:
        n = self.options.chunks
        chunks = Chunks()
        async with self._socket() as ws:
            await ws.send(json.dumps(self._start("resumed", n)))
            await self._read(ws, chunks, until=whole_chunk(0))
            ws.transport.abort()  # a network drop: no closing handshake, no stop
        started = chunks.started
        body = {
            "type": "session.resume",
            "request_id": started["request_id"],
            "resume_token": started["resume_token"],
            "last_chunk_index": chunks.indexes[-1],
        }
        deadline = time.monotonic() + RESUME_TRIES_S
        while True:
            async with self._socket() as ws:
                await ws.send(json.dumps(body))
                first = json.loads(await ws.recv())
                if first["type"] == "video.start":
                    expect(first.get("resumed") is True, f"resumed: video.start's resumed is {first.get('resumed')!r}")
                    done = await self._read(ws, chunks)
                    break
                expect(first.get("code") == "resume_token_in_use", f"resumed: the resume was refused: {first}")
            expect(time.monotonic() < deadline, f"resumed: the token stayed in use for {RESUME_TRIES_S:g} s")
            await asyncio.sleep(0.05)
        self._completed("resumed", done, chunks.indexes, n)

    async def watched(self) -> None:
        """Open-ended: the controller stops it once the spectator has a chunk."""
        async with self._socket() as ws:
            await ws.send(json.dumps(self._start("watched", None)))
            chunks, seen = Chunks(), Chunks()
            await self._read(ws, chunks, until=whole_chunk(0))
            async with self._socket(f"?watch={chunks.started['watch_token']}") as spectator:
                async with meanwhile(self._read(ws, chunks)) as reading:
                    await self._read(spectator, seen, until=whole_chunk())
                    await ws.send(json.dumps({"type": "session.stop"}))
                    controller = await reading
                watcher = await self._read(spectator, seen)
        expect(controller["reason"] == watcher["reason"] == "stopped", f"watched: {controller}, {watcher}")
        indexes = chunks.indexes
        expect(indexes == list(range(len(indexes))), f"watched: the controller got chunks {indexes}")
        tail = indexes[len(indexes) - len(seen.indexes) :]
        expect(seen.indexes == tail, f"watched: the spectator got {seen.indexes}, the controller {indexes}")

    async def shared(self) -> None:
        async with self._socket() as ws:
            await ws.send(json.dumps({**self._start("shared", None), "shared_control": True}))
            first, second = Chunks(), Chunks()
            await self._read(ws, first, until=whole_chunk(0))
            async with self._socket(f"?control={first.started['control_token']}") as other:
                heard: list[dict] = []  # what c1 was told meanwhile
                async with meanwhile(self._read(ws, first, heard=heard)) as reading:
                    await self._read(other, second, until=whole_chunk())
                    joined = second.started["controller_id"]
                    expect(joined == "c2", f"shared: joined as {joined!r}")
                    event_id = f"soak-{uuid.uuid4().hex[:12]}"
                    interaction = {"event_id": event_id, "event": {"prompt": "a soak's prompt from c2"}}
                    await other.send(json.dumps({"type": "session.interaction", "interaction": interaction}))
                    ended = await self._read(other, second, until=lambda _, event, __: outcome_of(event, event_id))
                    await other.send(json.dumps({"type": "session.stop"}))
                    done = await self._read(other, second)
                    await reading
        applied = ended["type"] == "session.interaction.applied" and ended.get("controller") == "c2"
        expect(applied, f"shared: c2's prompt ended as {ended}")
        of_c2 = [e.get("controller") for e in heard if outcome_of(e, event_id)]
        expect(of_c2 == ["c2"], f"shared: c1 heard {of_c2} as the prompt's outcomes")
        expect(done["reason"] == "stopped", f"shared: c2's stop ended it as {done['reason']}")
        indexes = first.indexes
        expect(indexes == list(range(len(indexes))), f"shared: c1 got chunks {indexes}")

    async def restyled(self) -> None:
        n = self.options.chunks
        shape, images = await self._input()
        video = {"kind": "video", "strength": 0.6, "format": "jpeg", "width": shape.width, "height": shape.height}
        chunks = Chunks()
        async with self._socket() as ws:
            await ws.send(json.dumps({**self._start("restyled", n), "input": {**video, "fps": shape.fps}}))
            await self._read(ws, chunks, until=lambda kind, _, __: kind == "video.start")
            async with meanwhile(v2v.send_frames(ws, images, shape.fps, v2v.SessionResult())):
                done = await self._read(ws, chunks)
        self._completed("restyled", done, chunks.indexes, n)
        made = chunks.made_from
        expect(all(used == frames for used, frames in made), f"restyled: (input frames, frames) per chunk {made}")

    async def _input(self) -> tuple[v2v.InputShape, list[bytes]]:
        """The served model's default size and rate, and a moving scene's frames
        as JPEGs at that size (made once)."""
        if self._frames is None:
            options = v2v.V2vBenchOptions(url=self.options.url, api_key=self.options.api_key)
            shape = await asyncio.to_thread(v2v.served_shape, options)
            images = await asyncio.to_thread(v2v.encoded, v2v.scene(shape), "jpeg", shape.fps)
            self._frames = (shape, images)
        return self._frames

    async def refused(self) -> None:
        async with self._socket() as ws:
            await ws.send(json.dumps({**self._start("refused", 2), "width": -1}))
            events = [event async for kind, event, _ in session_events(ws, self.options.stall_timeout_s)]
        expect(len(events) == 1, f"refused: {len(events)} events, not one error")
        [error] = events
        expect(error["type"] == "error" and error["fatal"], f"refused: {error}")
        expect(error["code"] == "invalid_event" and "width" in error["message"], f"refused: {error}")

    # ------------------------------------------------------------------ jobs

    def _http(self, method: str, path: str, body: dict | None = None) -> tuple[int, bytes]:
        request = server_request(self.http, path, self.options.api_key, method, body)
        try:
            with urllib.request.urlopen(request, timeout=self.options.stall_timeout_s) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as error:
            return error.code, error.read()

    async def _call(self, method: str, path: str, body: dict | None = None) -> tuple[int, bytes]:
        return await asyncio.to_thread(self._http, method, path, body)

    async def _create(self, path: str) -> str:
        job = {"prompt": f"a soak's {path} job", "num_chunks": self.options.chunks}
        status, data = await self._call("POST", "/v1/videos", job)
        expect(status == 202, f"{path}: POST /v1/videos answered {status}: {data[:300]!r}")
        return json.loads(data)["id"]

    async def job(self) -> None:
        video = await self._create("job")
        deadline = time.monotonic() + self.options.stall_timeout_s
        while True:
            status, data = await self._call("GET", f"/v1/videos/{video}")
            expect(status == 200, f"job: GET answered {status}: {data[:300]!r}")
            state = json.loads(data)["status"]
            if state == "completed":
                break
            expect(state in ("queued", "in_progress"), f"job: status {state}")
            expect(time.monotonic() < deadline, f"job: still {state} after {self.options.stall_timeout_s:g} s")
            await asyncio.sleep(0.05)
        status, data = await self._call("GET", f"/v1/videos/{video}/content")
        expect(status == 200 and data[4:8] == b"ftyp", f"job: content answered {status}, {data[:16]!r}")
        status, data = await self._call("DELETE", f"/v1/videos/{video}")
        expect(status == 200 and json.loads(data)["deleted"] is True, f"job: DELETE answered {status}: {data!r}")

    async def cancelled(self) -> None:
        video = await self._create("cancelled")
        status, data = await self._call("DELETE", f"/v1/videos/{video}")
        expect(status == 200, f"cancelled: DELETE answered {status}: {data[:300]!r}")
        state = json.loads(data)["status"]
        expect(state in ("cancelled", "completed"), f"cancelled: deleted as {state}")
        status, _ = await self._call("GET", f"/v1/videos/{video}")
        expect(status == 404, f"cancelled: the deleted job answered {status}, not 404")

    # ------------------------------------------------------------------ rounds

    async def _path(self, name: str, run: Callable[[], Awaitable[None]]) -> None:
        async with self.gate:
            try:
                await run()
                self.counts[name] += 1
            except (SoakFailure, *SESSION_FAILURES) as error:
                self.failures.append(f"round {len(self.samples)}: {name}: {failure(error)}")

    async def round(self, rng: random.Random) -> None:
        """Every path once, in a shuffled order, at most ``concurrency`` at a time;
        then the server's figures once it is idle."""
        order = list(PATHS)
        rng.shuffle(order)
        await asyncio.gather(*(self._path(name, getattr(self, name)) for name in order))
        self.samples.append(await self._idle_sample())

    async def _idle_sample(self) -> dict[str, float | None]:
        """The watched figures once no session is open and no viewer attached."""
        deadline = time.monotonic() + IDLE_TIMEOUT_S
        while True:
            figures = await asyncio.to_thread(self._scrape)
            busy = figures["rtvideo_sessions_active"] + figures["rtvideo_session_viewers"]
            if busy == 0:
                break
            if time.monotonic() > deadline:
                self.failures.append(
                    f"round {len(self.samples)}: the server still had {figures['rtvideo_sessions_active']:g} "
                    f"sessions and {figures['rtvideo_session_viewers']:g} viewers {IDLE_TIMEOUT_S:g} s after"
                )
                break
            await asyncio.sleep(0.05)
        sample: dict[str, float | None] = {}
        for name, metric in WATCHED.items():
            value = figures.get(metric)
            sample[name] = value if value is None or not name.endswith("_mib") else value / 2**20
        return sample

    def _scrape(self) -> dict[str, float]:
        """``/metrics``' samples by name, labelled ones summed."""
        status, data = self._http("GET", "/metrics")
        if status != 200:
            raise SoakFailure(f"/metrics answered {status}")
        figures: dict[str, float] = {"rtvideo_sessions_active": 0.0, "rtvideo_session_viewers": 0.0}
        for family in text_string_to_metric_families(data.decode()):
            for sample in family.samples:
                figures[sample.name] = figures.get(sample.name, 0.0) + sample.value
        return figures


def growth(samples: list[dict[str, float | None]], name: str, warm_up: int) -> dict[str, Any]:
    """One watched figure over the rounds (``exported`` False where the server
    does not export it): at the end of the warm-up, halfway through the rounds
    after it, at the end, the most; the growth since the warm-up, and the
    growth and least-squares slope per round over the second half (``late_``),
    where a server that only fills up once has stopped growing and a leak has
    not."""
    values = [s[name] for s in samples]
    if not values or any(v is None for v in values):
        return {"exported": False}
    after = values[max(min(warm_up, len(values)) - 1, 0) :]  # from the last warm-up round's sample
    late = after[len(after) // 2 :]
    return {
        "exported": True,
        "after_warm_up": after[0],
        "middle": late[0],
        "end": values[-1],
        "max": max(values),
        "growth": values[-1] - after[0],
        "late_growth": values[-1] - late[0],
        "late_slope_per_round": slope(late),
        "per_round": values,
    }


def slope(values: list[float]) -> float | None:
    """The least-squares slope of ``values`` against their index (None for fewer than two)."""
    n = len(values)
    if n < 2:
        return None
    mean_x, mean_y = (n - 1) / 2, sum(values) / n
    covariance = sum((x - mean_x) * (y - mean_y) for x, y in enumerate(values))
    return covariance / sum((x - mean_x) ** 2 for x in range(n))


def leaks(figures: dict[str, dict[str, Any]], options: SoakOptions) -> list[str]:
    """The watched figures (``growth``'s, by name) that grew past their limit
    over the second half of the rounds: ``max_growth_mib`` for memory,
    ``max_fd_growth`` for open files."""
    found = []
    for name, figure in figures.items():
        if figure["exported"]:
            limit = options.max_growth_mib if name.endswith("_mib") else options.max_fd_growth
            if figure["late_growth"] > limit:
                found.append(
                    f"{name} grew {figure['late_growth']:.1f} over the second half of the rounds "
                    f"({figure['middle']:.1f} to {figure['end']:.1f}; limit {limit:g})"
                )
    return found


async def run(options: SoakOptions, progress: Progress | None = None) -> dict:
    progress = progress or Progress.silent()
    soak = Soak(options)
    rng = random.Random(options.seed)
    began = time.perf_counter()
    while (options.rounds is None or len(soak.samples) < options.rounds) and (
        time.perf_counter() - began < options.minutes * 60
    ):
        try:
            await soak.round(rng)
        except (SoakFailure, OSError) as error:  # /metrics unreadable: the server is gone
            soak.failures.append(f"round {len(soak.samples)}: /metrics: {failure(error)}")
            break
        progress.advance()
    wall = time.perf_counter() - began
    figures = {name: growth(soak.samples, name, options.warm_up_rounds) for name in WATCHED}
    rounds = len(soak.samples)
    return {
        "bench": "soak",
        "url": options.url,
        "served_by": await asyncio.to_thread(served_by, soak.http, options.api_key),
        "rounds": rounds,
        "warm_up_rounds": options.warm_up_rounds,
        "wall_s": wall,
        "paths": soak.counts,
        "failures": soak.failures,
        "leaks": leaks(figures, options),
        "enough_rounds": rounds >= options.warm_up_rounds + 4,  # a second half of two rounds or more
        **figures,
    }


def main(options: SoakOptions, as_json: bool) -> int:
    with Progress("bench soak", options.rounds or 0, unit="round", quiet=as_json) as progress:
        summary = asyncio.run(run(options, progress))
    if not as_json:
        for name in WATCHED:
            figure = summary[name]
            if figure["exported"]:
                print(
                    f"{name:>16}: {figure['after_warm_up']:.1f} after the warm-up, {figure['middle']:.1f} halfway, "
                    f"{figure['end']:.1f} at the end ({figure['late_growth']:+.1f} over the second half)"
                )
        print(f"rounds {summary['rounds']}, paths {summary['paths']}, failures {len(summary['failures'])}")
        for line in summary["failures"][:10] + summary["leaks"]:
            print(f"  {line}")
    print(json.dumps(summary))
    return 1 if summary["failures"] or summary["leaks"] else 0
