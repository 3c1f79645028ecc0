"""Where pipeline ranks run (``rtvideo.workers.parallel.placement``) and how a backend's
timeout reads (``rtvideo.workers.parallel.link.timed_out``), on hosts of every shape,
the GPUs a host shows stood in for by patching what torch reports of them
(the decisions are read off that report and the configuration)."""

from __future__ import annotations

import pytest
import torch

from rtvideo.engine.config import EngineConfig, PipelineSpec
from rtvideo.workers.parallel import placement
from rtvideo.workers.parallel.link import LinkTimeout, RingLink, timed_out
from rtvideo.workers.parallel.placement import PlacementError


@pytest.fixture
def gpus(monkeypatch):
    """``gpus(n)``: this host shows ``n`` GPUs (0: none)."""

    def show(count: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    return show


def config(pp: int = 2, transport: str = "auto", **options) -> EngineConfig:
    return EngineConfig(pipeline=PipelineSpec("tiny", options), pp=pp, pp_transport=transport)


def test_without_gpus_every_rank_is_a_cpu_rank_on_the_sockets(gpus):
    gpus(0)
    c = config()
    assert [placement.rank_device(c, r) for r in range(2)] == [torch.device("cpu")] * 2
    assert not placement.uses_process_group(c, 1)
    assert placement.uses_process_group(config(transport="torch"), 1)
    assert placement.backend(config(transport="torch"), 1) == "gloo"
    assert placement.rank_spec(c, 1) == c.pipeline


def test_spawned_ranks_take_a_gpu_each_and_nccl(gpus):
    gpus(2)
    c = config()
    assert [placement.rank_device(c, r) for r in range(2)] == [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert placement.uses_process_group(c, 1) and placement.backend(c, 1) == "nccl"
    assert placement.link_device(c, 1) == torch.device("cuda", 1)
    assert placement.rank_spec(c, 1).options["device"] == "cuda:1"


def test_more_ranks_than_gpus_on_a_host_is_refused_naming_both_numbers(gpus):
    gpus(1)
    with pytest.raises(
        PlacementError, match=r"pp 2: pipeline rank 1 would take GPU 1 of its host, which has 1 visible"
    ):
        placement.check_host(config())
    gpus(2)
    with pytest.raises(
        PlacementError,
        match=r"pp 4: pipeline rank 2 would take GPU 2 of its host, which has 2 visible: run at most 2 ranks a host",
    ):
        placement.check_host(config(pp=4))


def test_a_launched_rank_takes_the_gpu_of_its_local_rank_not_its_global_one(gpus, monkeypatch):
    gpus(2)
    monkeypatch.setenv("LOCAL_RANK", "1")  # global rank 3 of a group over two hosts of two GPUs
    assert placement.rank_device(config(pp=4), 3) == torch.device("cuda", 1)
    monkeypatch.setenv("LOCAL_RANK", "one")
    with pytest.raises(PlacementError, match="LOCAL_RANK must be an integer, got 'one'"):
        placement.rank_device(config(pp=4), 3)


def test_ranks_pinned_to_one_gpu_share_it_and_their_ring_goes_through_host_memory(gpus):
    gpus(1)
    c = config(device="cuda:0")
    placement.check_host(c)
    assert [placement.rank_device(c, r) for r in range(2)] == [torch.device("cuda", 0)] * 2
    assert placement.shares_gpu(c)
    assert not placement.uses_process_group(c, 0)  # NCCL joins no two ranks on one GPU: the sockets
    torch_ring = config(transport="torch", device="cuda:0")
    assert placement.backend(torch_ring, 1) == "gloo" and placement.link_device(torch_ring, 1).type == "cpu"


def test_the_device_option_cpu_keeps_every_rank_on_the_cpu_on_a_gpu_host(gpus):
    gpus(2)
    c = config(device="cpu")
    assert {placement.rank_device(c, r).type for r in range(2)} == {"cpu"}
    assert not placement.uses_process_group(c, 0)


def test_a_device_that_is_not_one_or_a_gpu_asked_for_without_one_is_refused(gpus):
    gpus(0)
    with pytest.raises(PlacementError, match="the pipeline option device is 'cuda', but no GPU is visible"):
        placement.rank_device(config(device="cuda"), 0)
    with pytest.raises(PlacementError, match="pipeline option device 'gpu0' is not a device"):
        placement.rank_device(config(device="gpu0"), 0)


@pytest.mark.parametrize(
    "message",
    [
        "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 1000ms for recv operation",
        "Work ran for 30001 milliseconds before timing out.",
        "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1, OpType=RECV, Timeout(ms)=30000)",
    ],
)
def test_every_backends_timeout_reads_as_one(message):
    assert timed_out(RuntimeError(message))


def test_a_wait_that_times_out_however_the_backend_says_so_is_a_link_timeout():
    class Work:
        def __init__(self, outcome):
            self.outcome = outcome

        def wait(self, timeout):
            if isinstance(self.outcome, BaseException):
                raise self.outcome
            return self.outcome

    link = RingLink(0, 2, 1.5, torch.device("cpu"))
    link._wait([Work(True)], "header", 1)
    for outcome in (False, RuntimeError("Work ran for 1500 milliseconds before timing out.")):
        with pytest.raises(LinkTimeout, match=r"rank 0: header from rank 1 not done within 1.5 s"):
            link._wait([Work(outcome)], "header", 1)
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        link._wait([Work(RuntimeError("Connection closed by peer"))], "header", 1)
