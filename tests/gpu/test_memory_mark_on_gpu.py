"""On a GPU, a calibration measurement that ran out of memory leaves the device's
peak at its fullest; the pipeline forgets that peak for the one before the
measurement (``after_out_of_memory``), so the memory for sessions is not read as
nothing. Skipped without CUDA (tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from rtvideo.workers.pipelines.causal_wan import build

pytestmark = pytest.mark.gpu


def test_the_peak_of_a_measurement_that_ran_out_of_memory_is_forgotten_for_the_one_before():
    pipeline = build("tiny", device="cuda", warm_up_chunks=0)
    budget = pipeline.session_memory_budget()
    mark = pipeline.memory_mark()
    spike = torch.empty(2**30, dtype=torch.uint8, device="cuda")  # stands in for the measurement's peak
    del spike
    assert pipeline.session_memory_budget() < budget - 2**29  # the spike counts as a transient
    pipeline.after_out_of_memory(mark)
    assert pipeline.session_memory_budget() >= budget - 2**26  # forgotten: the budget is as before
