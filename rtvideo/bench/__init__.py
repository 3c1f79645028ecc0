"""Benchmarks: the ``rtvideo bench`` commands, each printing a JSON summary as its last line.

Tools beside the server: they may import ``server``, ``engine`` and
``workers``; only the command line (``cli``) and the tests import them.
``engine`` (``bench engine``: the loop's overhead over the stub pipeline) and
``pp`` (``bench pp``: pipeline ranks against one) start worker processes,
``realtime`` (``bench realtime``) drives WebSocket sessions against a running
server, each watched by ``playback``'s simulated viewer, and ``v2v``
(``bench v2v``) video-to-video sessions; these never import torch themselves.
``pipeline`` (``bench pipeline``) and ``versus`` (its ``--versus``) run the
model in this process, a speed setting's pipeline options read from
``settings`` (one table for ``--with`` and ``--versus``). ``stats`` and
``thread_cpu`` are what they share.
"""
