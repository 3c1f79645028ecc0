"""Realtime Prometheus metrics, one registry per app (no module globals).

API process. Timings are taken where they happen: compute time comes from the
worker inside each chunk result; delivery timings (time to first chunk,
inter-chunk interval, deadline misses, media lead) are taken here, when a
chunk is handed to the socket's writer.

A deadline miss is a chunk handed over after its playback time, where the
viewer's clock starts with the first chunk (the client's reported playhead
is not needed for it). The media lead is how far the chunk's end is ahead of
the viewer: the last ``session.playback`` report, else real time since the
first chunk.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from rtvideo.engine.messages import EngineStats

SESSION_OUTCOMES = (
    "completed",
    "stopped",
    "client_disconnected",
    "stall_timeout",
    "max_duration",
    "shutdown",
    "failed",
    "slow_client",
    "abandoned",
)
VIEWER_ROLES = ("controller", "spectator")
REJECTION_REASONS = (
    "server_full",
    "unauthorized",
    "invalid_event",
    "invalid_request",
    "start_timeout",
    "shutting_down",
    "prompt_refused",
)
PROMPT_CHECKS = ("start", "interaction", "job")
INTERACTION_OUTCOMES = ("queued", "applied", "superseded", "rejected")
JOB_STATUSES = ("completed", "failed", "cancelled")
SLO_ACTIONS = ("hold", "decrease", "increase")
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 10.0, 30.0)
LAG_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 16)
LEAD_BUCKETS = (0.0, 0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0)
FACTOR_BUCKETS = (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 4.0, 8.0, 16.0)


class Metrics:
    def __init__(
        self,
        worker_up: Callable[[], bool],
        memory: Callable[[], tuple[int | None, int]] = lambda: (None, 0),
        engine_stats: Callable[[], EngineStats | None] = lambda: None,
        worker_pid: Callable[[], int | None] = lambda: None,
    ) -> None:
        """``worker_pid``: the pid of the worker process this API process spawned
        (rank 0), None while there is none (starting, restarting, or ranks
        launched on their own): its memory, CPU time and open files are exported
        as ``rtvideo_worker_process_*`` where ``/proc`` can be read, beside the
        API process's own ``process_*`` and ``python_gc_*``."""
        # The client library's own switch: no "<counter>_created" timestamp series, which
        # dashboards mistake for counts (rtvideo_sessions_created, rtvideo_jobs_created ...).
        disable_created_metrics()
        r = self.registry = CollectorRegistry()
        ProcessCollector(registry=r)
        GCCollector(registry=r)
        ProcessCollector(namespace="rtvideo_worker", pid=lambda: _proc_name(worker_pid()), registry=r)
        self.sessions_active = Gauge("rtvideo_sessions_active", "Realtime sessions open now", registry=r)
        self.sessions = Counter("rtvideo_sessions", "Realtime sessions ended, by outcome", ["outcome"], registry=r)
        self.viewers = Gauge(
            "rtvideo_session_viewers", "Connections attached to realtime sessions now, by role", ["role"], registry=r
        )
        self.sessions_detached = Gauge(
            "rtvideo_sessions_detached",
            "Realtime sessions without a controller now, kept for a resume (resume_grace_s)",
            registry=r,
        )
        for role in VIEWER_ROLES:
            self.viewers.labels(role)
        self.rejections = Counter(
            "rtvideo_session_rejections", "Realtime starts refused, by reason", ["reason"], registry=r
        )
        self.ttff = Histogram(
            "rtvideo_time_to_first_chunk_seconds",
            "From session.start to the first chunk handed to the client",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.inter_chunk = Histogram(
            "rtvideo_inter_chunk_interval_seconds",
            "Time between consecutive chunks of a session",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.compute = Histogram(
            "rtvideo_chunk_compute_seconds",
            "Worker pipeline time of one chunk (boundary, denoise, commit and decode)",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.realtime_factor = Histogram(
            "rtvideo_chunk_realtime_factor",
            "Media seconds of a chunk per second of its compute (above 1: faster than real time)",
            buckets=FACTOR_BUCKETS,
            registry=r,
        )
        self.interaction_latency = Histogram(
            "rtvideo_interaction_latency_seconds",
            "Interaction queued to applied, measured in the worker",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.interaction_lag = Histogram(
            "rtvideo_interaction_lag_chunks",
            "Chunk an interaction applied at minus the chunk in progress when it was queued",
            buckets=LAG_BUCKETS,
            registry=r,
        )
        self.interactions = Counter(
            "rtvideo_interactions",
            "Interactions by outcome (queued, applied, superseded, rejected)",
            ["outcome"],
            registry=r,
        )
        self.prompts_refused = Counter(
            "rtvideo_prompts_refused",
            "Prompts the prompt policy refused, by where they came (start, interaction, job)",
            ["where"],
            registry=r,
        )
        self.frames = Counter("rtvideo_frames_generated", "Frames delivered (realtime and jobs)", registry=r)
        self.chunks = Counter("rtvideo_chunks_delivered", "Realtime chunks handed to clients", registry=r)
        self.deadline_misses = Counter(
            "rtvideo_deadline_misses", "Realtime chunks handed over after their playback time", registry=r
        )
        self.lead = Histogram(
            "rtvideo_media_lead_seconds",
            "How far a chunk's end is ahead of the viewer's playhead when handed over",
            buckets=LEAD_BUCKETS,
            registry=r,
        )
        self.input_latency = Histogram(
            "rtvideo_input_frame_latency_seconds",
            "From the server reading an input frame to writing the output frame made from it to a controller",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.input_received = Counter(
            "rtvideo_input_frames_received", "Input frames (binary WebSocket frames) read from clients", registry=r
        )
        self.input_dropped = Counter(
            "rtvideo_input_frames_dropped",
            "Input frames dropped unprocessed, oldest first, because the model fell behind their sender",
            registry=r,
        )
        self.input_invalid = Counter(
            "rtvideo_input_frames_invalid",
            "Input frames refused (bad header, index, size, or a JPEG that does not decode)",
            registry=r,
        )
        self.jobs = Counter("rtvideo_jobs", "Request-mode jobs ended, by status", ["status"], registry=r)
        up = Gauge("rtvideo_worker_up", "1 while the engine's workers are up", registry=r)
        up.set_function(lambda: 1.0 if worker_up() else 0.0)
        budget = Gauge(
            "rtvideo_session_memory_budget_bytes",
            "Device memory open sessions may hold together (0: not limited)",
            registry=r,
        )
        budget.set_function(lambda: float(memory()[0] or 0))
        held = Gauge("rtvideo_session_memory_held_bytes", "Device memory open sessions hold", registry=r)
        held.set_function(lambda: float(memory()[1]))
        r.register(EngineStatsCollector(engine_stats))
        # Known label values start at 0, so rates and alerts see a series from the start.
        for counter, values in (
            (self.sessions, SESSION_OUTCOMES),
            (self.rejections, REJECTION_REASONS),
            (self.interactions, INTERACTION_OUTCOMES),
            (self.prompts_refused, PROMPT_CHECKS),
            (self.jobs, JOB_STATUSES),
        ):
            for value in values:
                counter.labels(value)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _proc_name(pid: int | None) -> str:
    """``/proc``'s entry for ``pid``; for None one that does not exist, which the
    collector skips (no series while there is no worker)."""
    return "none" if pid is None else str(pid)


class EngineStatsCollector:
    """The engine's scheduling figures (``EngineStats``, the latest the worker
    sent), read at scrape time: micro-steps and the rows they carried, the rows
    limit and the smoothed micro-step time (the SLO controller's, with --pp),
    its decisions, and each pipeline rank's busy and wall seconds (a rank's
    bubble fraction is ``1 - rate(busy) / rate(wall)``) and the chunks it
    decoded; with captured steps (the pipeline option ``cuda_graphs``), the
    graphs captured, the forwards replayed, the forwards run eagerly before
    their graph was captured, and the graphs held (series only where the
    worker reports them)."""

    def __init__(self, stats: Callable[[], EngineStats | None]) -> None:
        self._stats = stats

    def collect(self):
        stats = self._stats()
        steps = CounterMetricFamily("rtvideo_micro_steps", "Micro-steps the engine ran")
        rows = CounterMetricFamily("rtvideo_micro_step_rows", "Session rows that entered the pipeline, summed")
        limit = GaugeMetricFamily("rtvideo_rows_per_micro_step", "Rows a micro-step may carry now (SLO-controlled)")
        seconds = GaugeMetricFamily("rtvideo_micro_step_seconds", "Smoothed wall time of a micro-step (with --pp)")
        decisions = CounterMetricFamily(
            "rtvideo_slo_decisions", "The SLO controller's decisions, by action", labels=["action"]
        )
        busy = CounterMetricFamily("rtvideo_rank_busy_seconds", "Seconds a pipeline rank computed", labels=["rank"])
        wall = CounterMetricFamily(
            "rtvideo_rank_wall_seconds", "Seconds a pipeline rank spent in micro-steps (busy + bubble)", labels=["rank"]
        )
        decoded = CounterMetricFamily(
            "rtvideo_rank_decoded_chunks", "Chunks a pipeline rank decoded (with --pp)", labels=["rank"]
        )
        graphs = {
            "captures": CounterMetricFamily("rtvideo_step_graph_captures", "Chunk steps captured as CUDA graphs"),
            "replays": CounterMetricFamily("rtvideo_step_graph_replays", "Chunk steps run by replaying a graph"),
            "fallbacks": CounterMetricFamily(
                "rtvideo_step_graph_fallbacks",
                "Chunk steps of static shapes run eagerly, before their capture or after a failed one",
            ),
            "capture_failures": CounterMetricFamily(
                "rtvideo_step_graph_capture_failures", "Captures that failed (then every chunk step runs eagerly)"
            ),
        }
        held = GaugeMetricFamily("rtvideo_step_graphs_held", "Captured chunk-step graphs held now")
        if stats is not None:
            steps.add_metric([], stats.micro_steps)
            rows.add_metric([], stats.rows)
            limit.add_metric([], stats.rows_per_micro_step)
            seconds.add_metric([], stats.micro_step_s)
            for action in SLO_ACTIONS:  # every action from 0, so rates see a series from the start
                decisions.add_metric([action], stats.slo_decisions.get(action, 0))
            for figure in stats.ranks:
                busy.add_metric([str(figure.rank)], figure.busy_s)
                wall.add_metric([str(figure.rank)], figure.wall_s)
                decoded.add_metric([str(figure.rank)], figure.decoded_chunks)
            if stats.step_graphs:
                for name, family in graphs.items():
                    family.add_metric([], stats.step_graphs.get(name, 0))
                held.add_metric([], stats.step_graphs.get("held", 0))
        yield from (steps, rows, limit, seconds, decisions, busy, wall, decoded, *graphs.values(), held)


class SessionClock:
    """One realtime session's delivery timeline, feeding ``Metrics``."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.started = time.monotonic()
        self.first_chunk_at: float | None = None
        self.last_chunk_at: float | None = None
        self.playhead: float | None = None  # the client's last report

    def chunk(self, media_start: float, media_seconds: float, frames: int, compute_s: float) -> None:
        m, now = self.metrics, time.monotonic()
        if self.first_chunk_at is None:
            self.first_chunk_at = now
            m.ttff.observe(now - self.started)
        else:
            m.inter_chunk.observe(now - self.last_chunk_at)
            if now - self.first_chunk_at > media_start:
                m.deadline_misses.inc()
        self.last_chunk_at = now
        playhead = self.playhead if self.playhead is not None else now - self.first_chunk_at
        m.lead.observe(max(0.0, media_start + media_seconds - playhead))
        m.chunks.inc()
        m.frames.inc(frames)
        m.compute.observe(compute_s)
        if compute_s > 0:
            m.realtime_factor.observe(media_seconds / compute_s)
