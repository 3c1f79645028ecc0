"""Imported first by the fork server the API process starts its workers from
(``rtvideo.engine.client.spawned_worker.worker_context``), and by nothing else.

The fork server, like the workers it forks, follows its parent: it exits when
the API process is gone (``multiprocessing`` closes its liveness pipe), never on
a signal meant for the server. A SIGTERM sent to the whole process group, as
systemd's default ``KillMode=control-group`` and ``timeout`` send it, used to
kill the fork server, and with it the worker, while the API process drained:
its sessions failed ``worker_died`` instead of ending ``shutdown``, and a fresh
worker was started during the shutdown. ``multiprocessing`` ignores SIGINT in
the fork server itself; this ignores SIGTERM too (workers set both again).
"""

from __future__ import annotations

import signal

signal.signal(signal.SIGTERM, signal.SIG_IGN)
