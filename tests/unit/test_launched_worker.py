"""What the API process needs to attach a worker group started by a launcher:
its configuration as plain data, the TCP pipes, and the stand-in for a child
process handle (``rtvideo.engine.client.launched_worker``)."""

from __future__ import annotations

import msgspec
import pytest

from rtvideo.engine.client.launched_worker import LaunchedWorker
from rtvideo.engine.config import EngineConfig, PipelineSpec, config_from_wire, config_to_wire
from rtvideo.engine.messages import AttachWorker, Terminate, WorkerHello
from rtvideo.engine.transport import Endpoints, decode_control, encode_control


def test_the_configuration_crosses_as_plain_data_and_comes_back_equal():
    config = EngineConfig(
        pipeline=PipelineSpec("tiny", {"device": "cpu", "warm_up_chunks": 1}),
        pp=2,
        stream_batch=True,
        max_pixels=4096,
        worker_listen="0.0.0.0:7010",
    )
    wire = decode_control(encode_control(AttachWorker(config=config_to_wire(config))))
    assert config_from_wire(wire.config) == config
    with pytest.raises(ValueError, match="EngineConfig.pp must be >= 1"):
        config_from_wire({**config_to_wire(config), "pp": 0})
    with pytest.raises(ValueError, match="EngineConfig from the API process"):
        config_from_wire({**config_to_wire(config), "no_such_field": 1})


def test_the_pipes_of_an_api_process_at_host_port():
    assert Endpoints.tcp("10.0.0.5:7010") == Endpoints(control="tcp://10.0.0.5:7010", results="tcp://10.0.0.5:7011")
    assert Endpoints.tcp("::1:7010").control == "tcp://[::1]:7010"
    with pytest.raises(ValueError, match="HOST:PORT"):
        Endpoints.tcp("7010")
    with pytest.raises(ValueError, match="worker_listen must look like HOST:PORT"):
        EngineConfig(worker_listen="nowhere")
    with pytest.raises(ValueError, match="worker_listen"):
        EngineConfig(worker_listen="host:65535")  # its results port would be past the last


def test_a_launched_worker_is_alive_from_its_hello_until_its_last_word_or_a_kill():
    sent: list = []
    exits: list = []
    worker = LaunchedWorker(sent.append, lambda: exits.append(True))
    assert not worker.is_alive() and worker.pid is None  # not connected yet
    worker.hello = WorkerHello(host="gpu-3", pid=4242, world_size=2)
    assert worker.is_alive() and worker.pid == 4242 and "pid 4242 on gpu-3" in worker.describe()
    worker.exited(143, "its launcher ended the group (SIGTERM)")
    assert not worker.is_alive() and (worker.exitcode, exits) == (143, [True])
    worker.kill("too late")  # counted once, whichever way the exit was learned
    assert exits == [True] and sent == [Terminate(reason="too late")]


def test_a_wedged_group_is_told_to_terminate_and_counted_gone_at_once():
    sent: list = []
    exits: list = []
    worker = LaunchedWorker(sent.append, lambda: exits.append(True))
    worker.hello = WorkerHello(host="h", pid=1, world_size=1)
    worker.kill("wedged: no probe answered for 12 s")
    assert sent == [Terminate(reason="wedged: no probe answered for 12 s")]
    assert exits == [True] and not worker.is_alive() and worker.exitcode == -9
    assert msgspec.msgpack.decode(encode_control(sent[0]))["type"] == "terminate"


class FakeControl:
    """Stands in for the control plane: records what the receiver hands it."""

    def __init__(self) -> None:
        import threading

        self.handled: list = []
        self.event = threading.Event()

    def handle(self, message) -> None:
        self.handled.append(message)
        self.event.set()


def test_the_control_receiver_of_a_launched_worker_obeys_terminate_and_notices_a_silent_api(tmp_path, monkeypatch):
    """``Terminate`` ends the process after its last word; a launched worker that
    hears nothing for ``silent_after_s`` shuts its loop down, then exits."""
    import threading

    import zmq

    from rtvideo.engine import receiver as receiver_module
    from rtvideo.engine.messages import Probe, Shutdown

    exits: list[int] = []
    exited = threading.Event()

    def fake_exit(code: int) -> None:  # the test process goes on; the receivers are stopped below
        exits.append(code)
        exited.set()

    monkeypatch.setattr(receiver_module.os, "_exit", fake_exit)
    context = zmq.Context()
    endpoint = f"ipc://{tmp_path}/control"
    api = context.socket(zmq.PUSH)
    api.bind(endpoint)
    said: list[str] = []
    control = FakeControl()
    receiver = receiver_module.ControlReceiver(
        context, endpoint, control, None, silent_after_s=60.0, on_terminate=said.append
    )
    receiver.start()
    api.send(encode_control(Probe(probe_id=1)))
    assert control.event.wait(5) and control.handled == [Probe(probe_id=1)]
    api.send(encode_control(Terminate(reason="wedged")))
    assert exited.wait(5) and exits == [4] and said == ["wedged"]

    exited.clear()
    control = FakeControl()
    quiet = receiver_module.ControlReceiver(context, endpoint, control, None, silent_after_s=0.3, orphan_grace_s=0.1)
    quiet.start()
    assert control.event.wait(5) and control.handled == [Shutdown(reason="parent_exited")]
    assert exited.wait(5) and exits == [4, 3]
    for done in (receiver, quiet):
        done.stop()
    api.close(linger=0)
    context.term()
