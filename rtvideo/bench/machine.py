"""Which machine made a benchmark's figures: every summary says it.

A benchmark that runs the model in this process (``pipeline``, its
``--versus``) labels its figures with the device it ran on; one that starts
workers on this host (``engine``, ``pp``) with this host; one that drives a
server (``realtime``, ``v2v``) with what the server's worker computes on, as
``/health`` says (``rtvideo.workers.device_info``). A figure without its
machine cannot be compared with another, nor reproduced.
"""

from __future__ import annotations

import json
import urllib.request
from typing import Any

import msgspec

from rtvideo.workers.device_info import describe_device


def this_machine(device: object | None = None) -> dict[str, Any]:
    """``device`` (a ``torch.device``; None: this host's CPU) described, as JSON."""
    return msgspec.to_builtins(describe_device(device))


def served_by(http_url: str, api_key: str | None = None, timeout: float = 10.0) -> dict[str, Any] | None:
    """What the server at ``http_url`` computes on (its ``/health``'s rank 0
    ``device``); None when it does not say or cannot be asked."""
    request = server_request(http_url, "/health", api_key)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            workers = json.load(answer).get("workers") or [{}]
    except (OSError, ValueError):
        return None
    return workers[0].get("device")


def server_request(
    http_url: str, path: str, api_key: str | None = None, method: str = "GET", body: dict | None = None
) -> urllib.request.Request:
    """A request to ``path`` on the server at ``http_url``, with ``api_key`` as a
    bearer token when there is one and ``body`` as JSON when there is one."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    data = None
    if body is not None:
        headers["Content-Type"] = "application/json"
        data = json.dumps(body).encode()
    return urllib.request.Request(http_url.rstrip("/") + path, data=data, method=method, headers=headers)


def http_of(url: str) -> str:
    """A realtime URL's server, over HTTP (``ws://h:p/v1/realtime/video`` → ``http://h:p``)."""
    base = url.removesuffix("/v1/realtime/video")
    return base.replace("ws://", "http://", 1).replace("wss://", "https://", 1)
