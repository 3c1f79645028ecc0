"""What a worker computes on, in words: the label every figure it makes carries.

Worker process (and the in-process benchmarks). ``describe_device`` names the
device a pipeline runs on, for ``WorkerReady.device`` (so ``/health`` says
which GPU a replica serves from) and for the benchmarks' summaries (so a
figure is labelled by the machine that made it: the GPU's name, memory and
compute capability, torch and CUDA versions, the host's CPU and cores). A
worker that serves the stub never imports torch: the description then says
the CPU and the torch installed, and asks torch nothing (no CUDA version).
"""

from __future__ import annotations

import importlib.metadata
import platform
import sys
from pathlib import Path

from rtvideo.engine.messages import DeviceInfo
from rtvideo.workers.cpu_threads import usable_cores


def cpu_model() -> str:
    """The host CPU's model name (``/proc/cpuinfo``; else what ``platform`` says; else ``unknown``)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "Model", "Hardware") and value.strip():
                return " ".join(value.split())
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _host_memory_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _torch_installed() -> str | None:
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


def describe_device(device: object | None = None) -> DeviceInfo:
    """``device`` (a ``torch.device``, or None: this host's CPU) described. A
    CUDA device is named by torch (``NVIDIA H200``), with its memory and compute
    capability; a CPU by its model, with the host's memory."""
    torch = sys.modules.get("torch")  # never imported here: a stub worker has none
    cores = usable_cores()
    version, cuda = getattr(torch, "__version__", None), getattr(getattr(torch, "version", None), "cuda", None)
    versions = {  # plain strings: torch's version is a str subclass the wire cannot encode
        "torch": str(version) if version else _torch_installed(),  # installed, where not imported
        "cuda": None if cuda is None else str(cuda),
    }
    kind = getattr(device, "type", None) or "cpu"
    if kind == "cuda" and torch is not None:
        props = torch.cuda.get_device_properties(device)
        return DeviceInfo(
            kind="cuda",
            name=str(props.name),
            memory_bytes=props.total_memory,
            capability=f"{props.major}.{props.minor}",
            cpu=cpu_model(),
            cpu_cores=cores,
            **versions,
        )
    return DeviceInfo(
        kind=kind,
        name=cpu_model() if kind == "cpu" else kind,
        memory_bytes=_host_memory_bytes() if kind == "cpu" else None,
        capability=None,
        cpu=cpu_model(),
        cpu_cores=cores,
        **versions,
    )
