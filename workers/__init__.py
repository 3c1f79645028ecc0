"""Worker processes: the torch side. One process per GPU (per pipeline rank);
rank 0 runs the engine loop (``engine.loop``) over a ``ModelRunner``."""
