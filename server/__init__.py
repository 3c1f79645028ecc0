"""The API process: the FastAPI front end (the realtime WebSocket, HTTP jobs,
metrics, the browser page) and the ``rtvideo`` CLI with its benchmarks. Never
imports ``workers`` or torch; it talks to the engine through
``engine.client.EngineClient``. The wire protocol is docs/PROTOCOL.md."""
