"""deploy/ and the Dockerfile: every file parses and validates against its schema
(offline, with validators from the package registries), and the Dockerfile
copies only what exists and runs the README's commands."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = sorted((DEPLOY / "k8s").glob("*.yaml"))
KUBERNETES = "1.33.0"


@pytest.mark.parametrize("path", [p for p in K8S if p.name != "kustomization.yaml"], ids=lambda p: p.name)
def test_kubernetes_manifests_validate_strictly(path):
    for document in yaml.safe_load_all(path.read_text()):
        kubernetes_validate.validate(document, KUBERNETES, strict=True)


def test_kustomization_lists_every_manifest():
    kustomization = yaml.safe_load((DEPLOY / "k8s" / "kustomization.yaml").read_text())
    listed = set(kustomization["resources"])
    assert listed == {p.name for p in K8S if p.name != "kustomization.yaml"}


def test_the_deployment_is_what_operators_need():
    deployment = yaml.safe_load((DEPLOY / "k8s" / "deployment.yaml").read_text())
    pod = deployment["spec"]["template"]["spec"]
    [container] = pod["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container["readinessProbe"]["httpGet"]["path"] == "/health/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health/live"
    assert "preStop" in container["lifecycle"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    grace = float(env["RTVIDEO_SHUTDOWN_GRACE_S"]) + container["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pod["terminationGracePeriodSeconds"] > grace
    hpa = yaml.safe_load((DEPLOY / "k8s" / "hpa.yaml").read_text())
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == "rtvideo_sessions_active"
    ingress = yaml.safe_load((DEPLOY / "k8s" / "ingress.yaml").read_text())
    assert ingress["metadata"]["annotations"]["nginx.ingress.kubernetes.io/affinity"] == "cookie"


def test_compose_file_validates_against_the_compose_spec():
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "check_jsonschema",
            "--builtin-schema",
            "vendor.compose-spec",
            str(DEPLOY / "compose.yaml"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    for service in compose["services"].values():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (DEPLOY / source).exists(), source


def test_grafana_dashboard_and_provisioning_parse():
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "rtvideo.json").read_text())
    assert dashboard["panels"] and all(panel["targets"] for panel in dashboard["panels"])
    for path in (DEPLOY / "grafana" / "provisioning").rglob("*.yml"):
        assert yaml.safe_load(path.read_text())["apiVersion"] == 1


def test_dockerfile_copies_what_exists_and_runs_the_readme_commands():
    dockerfile = (ROOT / "Dockerfile").read_text()
    for line in re.findall(r"^COPY (.+)$", dockerfile, flags=re.M):
        *sources, _ = line.split()
        for source in sources:
            assert (ROOT / source).exists(), f"the Dockerfile copies {source}, which does not exist"
    assert re.search(r"^RUN make install\b", dockerfile, flags=re.M)  # the README's commands install with make
    assert '"rtvideo", "serve"' in dockerfile.replace("/app/.venv/bin/rtvideo", "rtvideo")
    assert "HEALTHCHECK" in dockerfile and "USER rtvideo" in dockerfile
    makefile = (ROOT / "Makefile").read_text()
    assert "rtvideo serve" in makefile and "make serve" in (ROOT / "README.md").read_text()


def test_jobs_live_on_a_volume_wherever_the_server_is_deployed():
    """The job store (RTVIDEO_DATA_DIR) is a mounted volume in the image, under
    compose and in the pod, never the container's own layer that a restart resets."""
    dockerfile = (ROOT / "Dockerfile").read_text()
    [data_dir] = re.findall(r"RTVIDEO_DATA_DIR=(\S+)", dockerfile)
    [volumes] = re.findall(r"^VOLUME (\[.*\])$", dockerfile, flags=re.M)
    assert data_dir in json.loads(volumes)
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    service = compose["services"]["rtvideo"]
    mounts = {volume.split(":")[1]: volume.split(":")[0] for volume in service["volumes"]}
    assert mounts[data_dir] in compose["volumes"]  # a named volume: it outlives the container
    deployment = yaml.safe_load((DEPLOY / "k8s" / "deployment.yaml").read_text())
    pod = deployment["spec"]["template"]["spec"]
    [container] = pod["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    mounted = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert env["RTVIDEO_DATA_DIR"] in mounted
    assert mounted[env["RTVIDEO_DATA_DIR"]] in {v["name"] for v in pod["volumes"]}
