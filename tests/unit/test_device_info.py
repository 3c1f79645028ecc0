"""What a worker says it computes on (``rtvideo.workers.device_info``): on this
CPU machine, the host's CPU model, cores and memory and the torch installed;
it crosses the wire in ``WorkerReady``; and describing the host never imports
torch (a stub worker has none)."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys

from rtvideo.engine.messages import WorkerReady
from rtvideo.engine.transport import decode_result, encode_result
from rtvideo.workers.device_info import cpu_model, describe_device
from tests.unit.test_messages import GEOMETRY


def test_the_host_is_described_by_its_cpu_its_cores_and_its_memory():
    host = describe_device(None)
    assert host.kind == "cpu" and host.name == host.cpu == cpu_model() and host.name not in ("", "unknown")
    assert host.cpu_cores == len(os.sched_getaffinity(0))
    assert host.memory_bytes is not None and host.memory_bytes > 1 << 30
    assert host.capability is None and host.torch == importlib.metadata.version("torch")


def test_a_torch_cpu_device_says_the_torch_it_runs():
    import torch

    described = describe_device(torch.device("cpu"))
    assert described.kind == "cpu" and described.torch == torch.__version__ and described.cuda == torch.version.cuda


def test_the_description_crosses_the_wire_in_worker_ready():
    ready = WorkerReady(
        rank=0,
        pid=1,
        pipeline="stub",
        supports_chunk_step_grouping=True,
        grouping=True,
        max_sessions=1,
        defaults=GEOMETRY,
        device=describe_device(None),
    )
    assert decode_result(encode_result(ready)).device == ready.device


def test_describing_the_host_imports_no_torch():
    script = "import sys; from rtvideo.workers.device_info import describe_device; describe_device(None); "
    script += "print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == "False", result.stderr
