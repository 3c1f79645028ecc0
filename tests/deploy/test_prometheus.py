"""A real Prometheus (Debian's package) scrapes a test server with
deploy/prometheus.yml, its alert rules load, and every PromQL expression in
the alerts and the Grafana dashboard names only families the server exports."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.e2e.client import Realtime, interaction, open_realtime

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
needs_prometheus = pytest.mark.skipif(PROMETHEUS is None, reason="Debian's prometheus package is not installed")
FAMILIES = [
    "rtvideo_sessions_active",
    "rtvideo_sessions_total",
    "rtvideo_time_to_first_chunk_seconds_count",
    "rtvideo_inter_chunk_interval_seconds_bucket",
    "rtvideo_chunk_compute_seconds_sum",
    "rtvideo_interaction_latency_seconds_count",
    "rtvideo_interaction_lag_chunks_bucket",
    "rtvideo_interactions_total",
    "rtvideo_frames_generated_total",
    "rtvideo_media_lead_seconds_bucket",
    "rtvideo_chunk_realtime_factor_bucket",
    "rtvideo_worker_up",
    "rtvideo_session_memory_held_bytes",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def until_ready(
    http: httpx.AsyncClient, base: str, process: subprocess.Popen, log: Path, timeout_s: float = 60
) -> None:
    """Wait for Prometheus's readiness endpoint: while its storage starts it
    answers 503 "Service Unavailable" (plain text) to every API call."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, f"prometheus exited: {log.read_text()[-2000:]}"
        try:
            if (await http.get(f"{base}/-/ready")).status_code == 200:
                return
        except httpx.HTTPError:
            pass  # not listening yet
        await asyncio.sleep(0.25)
    raise AssertionError(f"prometheus was not ready within {timeout_s} s")


async def one_session(server) -> None:
    async with open_realtime(server.ws) as ws:
        client = Realtime(ws)
        await client.send({"type": "session.start", "prompt": "p", "format": "raw", "num_chunks": 6})
        await client.until("video.start")
        await client.next()
        await client.send(interaction("q"))
        await client.rest()


def expressions() -> list[str]:
    found = []
    for group in yaml.safe_load((DEPLOY / "alerts.yml").read_text())["groups"]:
        found += [rule["expr"] for rule in group["rules"]]
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "rtvideo.json").read_text())
    found += [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    return found


@pytest.mark.skipif(PROMTOOL is None, reason="Debian's prometheus package (promtool) is not installed")
def test_alert_rules_load():
    result = subprocess.run([PROMTOOL, "check", "rules", str(DEPLOY / "alerts.yml")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "5 rules found" in result.stdout


async def test_every_expression_names_only_exported_families(server):
    await one_session(server)
    exported = set(re.findall(r"^(\w+)(?:\{|\s)", httpx.get(f"{server.http}/metrics").text, flags=re.M))
    for expr in expressions():
        names = set(re.findall(r"\b((?:rtvideo|process)_\w+)", expr))  # ours, and the client's process families
        assert names, expr
        assert names <= exported, f"{expr} names {names - exported}, which /metrics does not export"
        others = set(re.findall(r"\b([a-z_]+)\{", expr)) - names
        assert others <= {"up"}, f"{expr} names {others}"


@needs_prometheus
async def test_a_real_prometheus_scrapes_the_realtime_families(server, tmp_path):
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    config["global"]["scrape_interval"] = "1s"
    config["rule_files"] = [str(DEPLOY / "alerts.yml")]
    config["scrape_configs"][0]["static_configs"][0]["targets"] = [server.http.removeprefix("http://")]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = tmp_path / "prometheus.log"
    with log.open("w") as sink:  # the child holds its own copy of the descriptor
        process = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={tmp_path / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp_path / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=sink,
        )
    base = f"http://127.0.0.1:{port}"
    api = f"{base}/api/v1"
    try:
        await one_session(server)
        async with httpx.AsyncClient(timeout=5) as http:
            await until_ready(http, base, process, log)
            deadline = time.monotonic() + 60
            missing = FAMILIES
            while time.monotonic() < deadline and missing:
                answer = await http.get(f"{api}/query", params={"query": '{__name__=~"rtvideo_.+"}'})
                if answer.status_code == 200:
                    names = {series["metric"]["__name__"] for series in answer.json()["data"]["result"]}
                    missing = [f for f in FAMILIES if f not in names]
                if missing:
                    await asyncio.sleep(0.25)
        assert not missing, f"Prometheus never saw {missing}"
        query = httpx.get(f"{api}/query", params={"query": "sum(rtvideo_time_to_first_chunk_seconds_count)"}).json()
        assert float(query["data"]["result"][0]["value"][1]) >= 1
        rules = httpx.get(f"{api}/rules").json()["data"]["groups"]
        assert sum(len(group["rules"]) for group in rules) == 5
    finally:
        process.terminate()
        process.wait(timeout=30)
