"""The fork server that preloads a worker's modules must stay safe to fork on a
GPU machine: diffusers asks whether an accelerator is there when it is
imported, and torch answering through the CUDA runtime leaves every fork
unable to use CUDA. Importing ``workers`` makes torch ask NVML instead. The
failure itself needs a CUDA build of torch (``tests/gpu``'s worker-process
test runs it); here, in fresh interpreters, the setting that prevents it."""

from __future__ import annotations

import os
import subprocess
import sys

PRINT_SETTING = "import rtvideo.workers, os; print(os.environ.get('PYTORCH_NVML_BASED_CUDA_CHECK'))"


def _setting_after_import(environment: dict[str, str]) -> str:
    result = subprocess.run(
        [sys.executable, "-c", PRINT_SETTING], env=environment, capture_output=True, text=True, check=True
    )
    return result.stdout.strip()


def test_importing_workers_makes_torch_ask_nvml_whether_cuda_is_there():
    environment = {key: value for key, value in os.environ.items() if key != "PYTORCH_NVML_BASED_CUDA_CHECK"}
    assert _setting_after_import(environment) == "1"


def test_an_operator_s_own_setting_is_kept():
    assert _setting_after_import({**os.environ, "PYTORCH_NVML_BASED_CUDA_CHECK": "0"}) == "0"
