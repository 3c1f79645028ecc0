"""The API process: the ``rtvideo`` CLI now; the FastAPI front end (WebSocket,
HTTP jobs, metrics, the browser page) comes next. Never imports ``workers`` or
torch; it talks to the engine through ``engine.client.EngineClient``."""
