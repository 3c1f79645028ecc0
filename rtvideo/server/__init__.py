"""The API process: the FastAPI front end (the realtime WebSocket, HTTP jobs,
metrics, the browser page), started by ``rtvideo serve`` (``cli``). Never
imports ``workers``, ``bench``, ``training``, ``cli`` or torch; it talks to the
engine through ``rtvideo.engine.client.engine_client.EngineClient``. The wire protocol
is docs/PROTOCOL.md."""
