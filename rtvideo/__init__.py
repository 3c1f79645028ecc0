"""rtvideo: a realtime video generation server.

One package, one folder per process (docs/ENGINE.md, README's map):

- ``rtvideo.server``: the API process (FastAPI, asyncio; never imports torch);
- ``rtvideo.engine``: the policy, pure Python: wire types, configs, the schedulers
  and the engine loop, and the API side's ``EngineClient``;
- ``rtvideo.workers``: the worker processes (torch): pipelines, KV caches, decode;
- ``rtvideo.cli``, ``rtvideo.bench``, ``rtvideo.training``: the ``rtvideo``
  command and the tools it runs.

Import direction: ``server -> engine <- workers`` (``tests/unit/test_import_direction.py``).
Importing this package imports none of them.
"""
