"""The model-agnostic engine. Pure Python: imports neither ``server`` nor ``workers`` nor torch.

Both processes share the wire types (``messages``, encoded by ``transport``),
the configuration (``config``), the request limits (``limits``) and the long
commands' progress bars (``progress``). The core runs in worker rank 0: the
control plane (``control``, fed by the ``receiver`` thread; ``validation``,
``mailbox``), each session's state (``session``), the schedulers
(``scheduler``, ``stream_batch``, ``slo``, ``pacing``), the chunk cost model
(``chunk_cost``), the micro-step plans and the executor protocol (``plan``)
and the loop (``loop``). The API process's side is ``rtvideo.engine.client``
(``EngineClient``), which the core never imports."""
