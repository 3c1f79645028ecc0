"""The control-receiver thread of worker rank 0.

Reads the RPC queue as messages arrive, independent of the loop thread, and
hands each to ``ControlPlane.handle``: interactions reach their mailbox (and
are acknowledged) even while a chunk is being denoised, and a stop is seen
between two denoise steps of a grouped invocation.

It also watches the parent-liveness pipe: when the API process dies (however
it dies), the pipe's read end hits EOF, the receiver asks the loop to shut
down, and if the loop has not finished within ``orphan_grace_s`` the process
exits anyway, so a worker never outlives its parent. A worker started by a
launcher has no parent pipe: it counts the API process gone after
``silent_after_s`` without a control message (the API process probes every
second), and ``Terminate`` (the API process found it wedged) ends the
process at once, whatever the loop is doing.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import msgspec
import zmq

from rtvideo.engine.control import ControlPlane
from rtvideo.engine.messages import AttachWorker, Shutdown, Terminate
from rtvideo.engine.transport import decode_control

log = logging.getLogger(__name__)


class ControlReceiver:
    def __init__(
        self,
        context: zmq.Context,
        endpoint: str,
        control: ControlPlane,
        parent_alive_fd: int | None,
        orphan_grace_s: float = 5.0,
        silent_after_s: float | None = None,
        on_terminate=None,
    ) -> None:
        """``parent_alive_fd``: the liveness pipe's read end (None: a launched
        worker, watched by ``silent_after_s`` instead); ``on_terminate`` is called
        with the reason before a ``Terminate`` ends the process (its last word)."""
        self._socket = context.socket(zmq.PULL)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(endpoint)
        self._control = control
        self._parent_fd = parent_alive_fd
        self._orphan_grace_s = orphan_grace_s
        self._silent_after_s = silent_after_s
        self._heard_at = time.monotonic()
        self._on_terminate = on_terminate
        self._stop = threading.Event()
        self._wake_r, self._wake_w = os.pipe()  # stop() wakes the poll at once
        self._thread = threading.Thread(target=self._run, name="control-receiver", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        os.write(self._wake_w, b"x")
        self._thread.join(timeout=2.0)
        self._socket.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        if self._parent_fd is not None:
            poller.register(self._parent_fd, zmq.POLLIN)
        while not self._stop.is_set():
            ready = dict(poller.poll(timeout=200))
            if self._socket in ready:
                self._heard_at = time.monotonic()
                self._receive_all()
            if self._parent_fd is not None and self._parent_fd in ready:
                self._orphaned()
                return
            silent = self._silent_after_s
            if silent is not None and time.monotonic() - self._heard_at > silent:
                log.warning("no word from the API process for %g s", silent)
                self._orphaned()
                return

    def _receive_all(self) -> None:
        while True:
            try:
                data = self._socket.recv(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            try:
                message = decode_control(data)
            except msgspec.DecodeError as error:
                log.error("dropping an undecodable control message: %s", error)
                continue
            if isinstance(message, Terminate):
                self._terminate(message.reason)
            if isinstance(message, AttachWorker):
                continue  # a repeated answer to this worker's hello: it is attached already
            try:
                self._control.handle(message)
            except Exception:  # keep receiving: one bad message must not silence control
                log.exception("control message %s failed", type(message).__name__)

    def _terminate(self, reason: str) -> None:
        log.error("terminated by the API process: %s", reason)
        if self._on_terminate is not None:
            try:
                self._on_terminate(reason)
            except Exception:
                log.exception("could not say why this worker exits")
        os._exit(4)

    def _orphaned(self) -> None:
        log.warning("the API process is gone; shutting this worker down")
        self._control.handle(Shutdown(reason="parent_exited"))
        timer = threading.Timer(self._orphan_grace_s, os._exit, args=(3,))
        timer.daemon = True
        timer.start()
