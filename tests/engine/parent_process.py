"""A stand-in API process for lifecycle tests: starts an engine with one endless
session, prints ``READY <worker pid>``, and waits to be signalled.

Run as ``python -m tests.engine.parent_process``. On SIGINT it shuts the engine
down the orderly way (asyncio cancels the main task); on SIGTERM or SIGKILL it
just dies, and the worker must notice by itself.
"""

from __future__ import annotations

import asyncio
import signal

from rtvideo.engine.client.engine_client import EngineClient
from rtvideo.engine.config import EngineConfig, PipelineSpec
from rtvideo.engine.messages import ChunkReady, StartSession


async def main() -> None:
    client = EngineClient(EngineConfig(pipeline=PipelineSpec("stub", {"step_time_s": 0.002})))
    await client.start()
    try:
        handle = await client.start_session(StartSession(session_id="endless", prompt="p"))
        while not isinstance(await handle.next(30), ChunkReady):
            pass
        print(f"READY {client.worker_pid}", flush=True)
        await asyncio.Event().wait()
    finally:
        await client.shutdown()


if __name__ == "__main__":
    # Handle SIGINT even when started with it ignored (a shell's background job
    # inherits SIG_IGN), as the real server does: uvicorn installs its own handler.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass
