"""The engine's API side: what the API process runs of the engine (asyncio, pure Python, no torch).

``engine_client`` is ``EngineClient``, the server's handle on the engine,
``session_handle`` one open session's result stream, ``errors`` what they
raise, ``restart_budget`` how many fresh workers may follow deaths;
``spawned_worker`` starts worker rank 0 as a child process from a fork server,
``launched_worker`` stands for a worker group a launcher started
(``torchrun``), ``heartbeat`` says when a worker is wedged. It speaks to the
worker only in the wire types both sides share (``rtvideo.engine.messages``, encoded
by ``rtvideo.engine.transport``) and imports nothing of the core that runs in the
worker (the loop, the control plane, the schedulers), which never imports it.
"""
