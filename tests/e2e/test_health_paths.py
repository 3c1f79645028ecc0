"""Every health path that docs/ and deploy/ name (the docs, the Kubernetes probes,
the Dockerfile's HEALTHCHECK, compose, Prometheus) exists on the server and means
what they say: a readiness path answers 503 while the server drains, while a
crashed worker restarts and once the workers are dead; a liveness path stays 200
while the server drains or a worker restarts, and answers 503 once they are dead.
The server runs as a subprocess on the stub pipeline."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import threading
import time
from pathlib import Path

import httpx
import yaml

from tests.e2e.client import Realtime, open_realtime
from tests.e2e.test_restart import kill_worker_under_a_session, wait_ready

ROOT = Path(__file__).resolve().parents[2]
READINESS = {"/health", "/health/ready"}  # docs/PROTOCOL.md, "Health": what each path means
LIVENESS = {"/health/live"}
HEALTH_PATH = re.compile(r"/health(?:/[a-z]+)*")


def named_in(*paths: Path) -> set[str]:
    """The health paths named anywhere in these files (or the files under these folders)."""
    files = [f for p in paths for f in ([p] if p.is_file() else sorted(p.rglob("*"))) if f.is_file()]
    return {match for f in files for match in HEALTH_PATH.findall(f.read_text(errors="replace"))}


def answers(server) -> dict[str, httpx.Response]:
    return {path: httpx.get(f"{server.http}{path}", timeout=5) for path in sorted(READINESS | LIVENESS)}


def test_every_documented_health_path_has_a_meaning_and_the_probes_use_the_right_one():
    in_docs, in_deploy = named_in(ROOT / "docs"), named_in(ROOT / "deploy", ROOT / "Dockerfile")
    assert in_docs == READINESS | LIVENESS, f"the docs name {sorted(in_docs)}"
    assert in_deploy and in_deploy <= in_docs, f"deploy/ names {sorted(in_deploy - in_docs)}, which no doc describes"
    deployment = yaml.safe_load((ROOT / "deploy" / "k8s" / "deployment.yaml").read_text())
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    assert container["startupProbe"]["httpGet"]["path"] in READINESS
    assert container["readinessProbe"]["httpGet"]["path"] in READINESS
    assert container["livenessProbe"]["httpGet"]["path"] in LIVENESS
    dockerfile = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")  # continuation lines joined
    [healthcheck] = [line for line in dockerfile.splitlines() if line.startswith("HEALTHCHECK ")]
    [checked] = HEALTH_PATH.findall(healthcheck)
    assert checked in READINESS, healthcheck


async def test_each_health_path_answers_as_documented_ready_restarting_and_draining(make_server, tmp_path):
    gate = tmp_path / "restart-gate"
    server = make_server("--shutdown-grace-s", "30", pipeline={"step_time_s": 0.005, "startup_gate": str(gate)})
    ready = answers(server)
    assert {path: a.status_code for path, a in ready.items()} == dict.fromkeys(ready, 200)
    assert {a.json()["status"] for a in ready.values()} == {"ok"}

    os.mkfifo(gate)  # the first worker is up; the next one waits here
    await kill_worker_under_a_session(server)
    restarting = answers(server)
    for path in READINESS:
        assert (restarting[path].status_code, restarting[path].json()["status"]) == (503, "restarting"), path
    for path in LIVENESS:
        assert (restarting[path].status_code, restarting[path].json()["status"]) == (200, "restarting"), path
    opened = threading.Thread(target=lambda: open(gate, "wb").close(), daemon=True)
    opened.start()  # the held worker goes on
    opened.join(30)
    os.unlink(gate)
    wait_ready(server)
    assert {a.status_code for a in answers(server).values()} == {200}

    async with open_realtime(server.ws) as ws:  # a session holds the drain open
        client = Realtime(ws)
        await client.send({"type": "session.start", "prompt": "endless", "format": "raw"})
        await client.until("video.start")
        server.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while httpx.get(f"{server.http}/health").status_code != 503:
            assert time.monotonic() < deadline, "the server never said it drains"
            await asyncio.sleep(0.02)
        draining = answers(server)
        await client.send({"type": "session.stop"})
        await client.rest(timeout=30)
    for path in READINESS:
        assert (draining[path].status_code, draining[path].json()["status"]) == (503, "draining"), path
    for path in LIVENESS:
        assert (draining[path].status_code, draining[path].json()["status"]) == (200, "ok"), path


def test_each_health_path_answers_as_documented_once_the_workers_are_dead(make_server):
    server = make_server("--max-worker-restarts", "0", pipeline={"step_time_s": 0.005})
    os.kill(server.health()["workers"][0]["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 30
    while httpx.get(f"{server.http}/health/live").status_code != 503:
        assert time.monotonic() < deadline, "liveness never said the workers are dead"
        time.sleep(0.02)
    dead = answers(server)
    for path in READINESS:
        assert (dead[path].status_code, dead[path].json()["status"]) == (503, "unavailable"), path
    for path in LIVENESS:
        assert (dead[path].status_code, dead[path].json()["status"]) == (503, "dead"), path
