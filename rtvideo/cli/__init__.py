"""The ``rtvideo`` command line (``python -m rtvideo.cli``; the ``rtvideo`` script is ``rtvideo.cli.main:main``).

A command imports what it runs only when it runs: ``serve`` the server
(``server``, the API process, which loads no torch), ``bench`` the benchmarks
(``bench``), ``train-demo``, ``eval-demo`` and ``refine-demo-decoder`` the demo
model's training (``rtvideo.training.demo``), ``convert`` the checkpoint converter
(``rtvideo.workers.convert``).
"""
