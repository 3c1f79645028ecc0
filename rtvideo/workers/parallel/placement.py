"""Which device each pipeline rank runs on, and what its ring travels on.

Worker processes. Decided the same way on every rank, from the configuration
and the rank's own host, and checked before anything is built, so that a
group that cannot run fails its start with one line naming what is wrong
instead of timing out later:

- the pipeline option ``device`` ``cpu`` (or no GPU visible): every rank on
  the CPU;
- a GPU without an index (``cuda``, or no ``device`` option on a host with
  GPUs): each rank on its own GPU of its host, chosen by its local rank
  (``LOCAL_RANK``, which ``torchrun`` sets on every host; for ranks spawned
  on one host, the rank). More ranks on a host than GPUs visible there is
  refused, naming both numbers;
- a GPU with an index (``cuda:0``): every rank on that one GPU, sharing it
  (a test of the ranks on a one-GPU machine). NCCL does not join two ranks
  on one GPU, so their ring goes through host memory: the ranks' sockets,
  or gloo with ``pp_transport`` ``torch``.

A group whose ranks landed on different kinds of device (a host without a
GPU among hosts with one) is refused by rank 0 once each rank said where it
runs (``RankGroup.start``).
"""

from __future__ import annotations

import os

import torch

from rtvideo.engine.config import EngineConfig, PipelineSpec


class PlacementError(ValueError):
    """The pipeline ranks cannot run where they would be placed (the message says why)."""


def local_rank(rank: int) -> int:
    """The rank's index among the ranks of its own host: ``LOCAL_RANK`` where a
    launcher set it, else ``rank`` (ranks spawned on one host)."""
    value = os.environ.get("LOCAL_RANK")
    if value is None:
        return rank
    try:
        return int(value)
    except ValueError:
        raise PlacementError(f"LOCAL_RANK must be an integer, got {value!r}") from None


def _wanted(config: EngineConfig) -> torch.device | None:
    wanted = config.pipeline.options.get("device")
    if wanted is None:
        return None
    try:
        return torch.device(wanted)
    except (RuntimeError, TypeError) as error:
        raise PlacementError(f"pipeline option device {wanted!r} is not a device: {error}") from None


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    """The device pipeline rank ``rank`` runs on (see the module's docstring);
    ``PlacementError`` naming the rank, its host's GPUs and the fix where it
    has none to run on."""
    wanted = _wanted(config)
    if wanted is not None and wanted.type != "cuda":
        return wanted
    if wanted is not None and wanted.index is not None:
        return wanted  # every rank on that GPU (checked to exist by the pipeline, like one rank's)
    if not torch.cuda.is_available():
        if wanted is not None:
            raise PlacementError(f"pipeline rank {rank}: the pipeline option device is 'cuda', but no GPU is visible")
        return torch.device("cpu")
    count = torch.cuda.device_count()
    local = local_rank(rank)
    if local >= count:
        raise PlacementError(
            f"pp {config.pp}: pipeline rank {rank} would take GPU {local} of its host, which has {count} "
            f"visible: run at most {count} rank{'s' if count != 1 else ''} a host, or put every rank on one GPU "
            "(pipeline option device cuda:0; slower: the ring then goes through host memory)"
        )
    return torch.device("cuda", local)


def check_host(config: EngineConfig) -> None:
    """Before ranks are spawned on this host: every one of them has a device
    (``PlacementError`` naming the first that has none)."""
    for rank in range(config.pp):
        rank_device(config, rank)


def shares_gpu(config: EngineConfig) -> bool:
    """Whether the ranks share one GPU (the option ``device`` names one by index)."""
    wanted = _wanted(config)
    return config.pp > 1 and wanted is not None and wanted.type == "cuda" and wanted.index is not None


def uses_process_group(config: EngineConfig, rank: int) -> bool:
    """Whether the ranks join a ``torch.distributed`` process group: only where
    the ring's messages travel on it: NCCL between ranks on GPUs of their own
    (``pp_transport`` ``auto`` or ``torch``), gloo with ``torch`` elsewhere.
    Without one, the ranks need no ports beyond the rendezvous store's and
    their sockets' (``rank_port``): gloo and NCCL open connections on ports of
    their own."""
    if config.pp_transport == "torch":
        return True
    return rank_device(config, rank).type == "cuda" and not shares_gpu(config)


def backend(config: EngineConfig, rank: int) -> str:
    """The process group's backend: NCCL between ranks on GPUs of their own, else gloo."""
    return "nccl" if rank_device(config, rank).type == "cuda" and not shares_gpu(config) else "gloo"


def link_device(config: EngineConfig, rank: int) -> torch.device:
    """Where the ring's buffers live: the rank's GPU for NCCL, host memory for gloo."""
    return rank_device(config, rank) if backend(config, rank) == "nccl" else torch.device("cpu")


def rank_spec(config: EngineConfig, rank: int) -> PipelineSpec:
    """The pipeline rank ``rank`` builds: the configured one, on its device."""
    device = rank_device(config, rank)
    if device.type != "cuda":
        return config.pipeline
    return PipelineSpec(config.pipeline.name, {**config.pipeline.options, "device": str(device)})
