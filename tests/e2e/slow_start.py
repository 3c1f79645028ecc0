"""A pipeline factory (``--model tests.e2e.slow_start:build``) whose build never
ends: it writes its process id to ``marker``, then waits, as a model that takes
minutes to load does."""

from __future__ import annotations

import os
import time
from pathlib import Path


def build(*, marker: str, **_options):
    Path(marker).write_text(str(os.getpid()))
    time.sleep(600)
    raise RuntimeError("a start the test never ended")
