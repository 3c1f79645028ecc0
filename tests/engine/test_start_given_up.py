"""The server's start given up while the worker builds its pipeline (an exit
signal while the model loads cancels the lifespan's start: ``rtvideo serve``
does it through ``OneLineLifespan.abort``): nothing of it is left, in process
too: the worker is stopped and the job store's data_dir is free again."""

from __future__ import annotations

import asyncio

from rtvideo.server.app import create_app
from rtvideo.server.jobs import open_job_store
from rtvideo.server.settings import ServerSettings
from tests.engine.test_lifecycle import wait_gone


async def test_a_start_cancelled_while_the_model_loads_leaves_no_worker_and_frees_the_data_dir(tmp_path):
    marker = tmp_path / "building"
    settings = ServerSettings(
        model="tests.e2e.slow_start:build",
        pipeline_options={"marker": str(marker)},
        data_dir=str(tmp_path / "data"),
        max_pixels=1 << 22,
    )
    app = create_app(settings)
    starting = asyncio.create_task(app.router.lifespan_context(app).__aenter__())
    async with asyncio.timeout(60):
        while not marker.exists() or not marker.read_text():  # the worker is building its pipeline
            assert not starting.done(), starting
            await asyncio.sleep(0.05)
    worker = int(marker.read_text())
    starting.cancel()
    await asyncio.gather(starting, return_exceptions=True)
    wait_gone(worker, within=10)
    store = await open_job_store(settings)  # held by nobody: the cancelled start closed it
    await store.close()
