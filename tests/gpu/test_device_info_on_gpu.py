"""On a GPU the worker's description names the card torch sees, with its memory,
compute capability and the CUDA torch was built with (``/health`` and every
benchmark summary carry it). Skipped without CUDA (tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from rtvideo.workers.device_info import describe_device

pytestmark = pytest.mark.gpu


def test_a_cuda_device_is_named_as_torch_names_it():
    device = torch.device("cuda", 0)
    described = describe_device(device)
    props = torch.cuda.get_device_properties(device)
    assert described.kind == "cuda" and described.name == torch.cuda.get_device_name(device)
    assert described.memory_bytes == props.total_memory and described.capability == f"{props.major}.{props.minor}"
    assert described.cuda == torch.version.cuda and described.torch == str(torch.__version__)
