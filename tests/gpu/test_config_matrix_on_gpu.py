"""On a CUDA machine: the configuration matrix of tests/engine/test_config_matrix.py
with two pipeline ranks on one GPU (pipeline option ``device`` ``cuda:0``: the
ranks share it, so their ring goes through host memory, on the ranks' sockets
or over gloo), each checked against one rank on the same GPU: frames bit for
bit equal where the mode is exact. Forwards of one row, so that no
configuration batches where another does not (a batched forward is not
batch-invariant on a GPU). Skipped without CUDA (see tests/conftest.py)."""

from __future__ import annotations

import pytest
import pytest_asyncio

from rtvideo.engine.client.engine_client import EngineClient
from tests.engine.test_config_matrix import MODES, REFERENCE, Mode, check_mode

pytestmark = [pytest.mark.gpu, pytest.mark.asyncio(loop_scope="module")]
DEVICE = "cuda:0"
ROWS = 1
CASES = [(mode, "auto") for mode in MODES if mode.pp == 2] + [(MODES[2], "torch")]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def reference():
    engine = EngineClient(REFERENCE.config(device=DEVICE, rows=ROWS))
    await engine.start()
    yield engine
    await engine.shutdown()


@pytest.mark.parametrize(("mode", "transport"), CASES, ids=lambda case: getattr(case, "name", case))
async def test_two_ranks_on_one_gpu_make_what_one_rank_makes(mode: Mode, transport: str, reference: EngineClient):
    await check_mode(mode, mode.config(device=DEVICE, rows=ROWS, transport=transport), reference)
