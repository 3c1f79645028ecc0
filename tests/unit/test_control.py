"""The control plane wakes the loop for whatever may change its next decision,
including a playback report that lands between the loop's pacing decision and
its wait (in-process: control plane, loop, runner and stub)."""

from __future__ import annotations

import threading

from rtvideo.engine.config import EngineConfig
from rtvideo.engine.control import ControlPlane
from rtvideo.engine.messages import ChunkReady, Delivered, Playback, Probe, StartSession
from rtvideo.engine.pacing import Playhead
from rtvideo.workers.pipelines.stub import StubPipeline
from rtvideo.workers.runner import ModelRunner
from tests.support import inline_loop

CHUNK_S = 4 / 16.0  # the stub's 4 frames at 16 fps


def _control() -> tuple[ControlPlane, list]:
    sent: list = []
    return ControlPlane(EngineConfig(), StubPipeline().describe, sent.append), sent


def test_wait_returns_at_once_for_a_report_after_the_pacing_read():
    control, _ = _control()
    control.handle(StartSession(session_id="s", prompt="p"))
    control.drain()
    seen, playheads = control.pacing_state()
    assert playheads == {"s": Playhead(None, None)}
    assert control.wait(seen, timeout=0) is False  # nothing new since the read

    receiver = threading.Thread(target=control.handle, args=(Playback(session_id="s", position_seconds=1.5),))
    receiver.start()
    receiver.join()
    assert control.wait(seen, timeout=0) is True  # the report came after the read: no sleep
    seen, playheads = control.pacing_state()
    assert playheads == {"s": Playhead(1.5, None)} and control.wait(seen, timeout=0) is False
    control.handle(Delivered(session_id="s", media_seconds=0.75))  # the API process's delivery report wakes it too
    assert control.wait(seen, timeout=0) is True and control.pacing_state()[1] == {"s": Playhead(1.5, 0.75)}


def test_wait_returns_at_once_for_a_message_already_in_the_inbox():
    control, _ = _control()
    control.handle(Probe(probe_id=1))  # arrives after the loop's drain, before its pacing read
    seen, _ = control.pacing_state()
    assert control.wait(seen, timeout=0) is True
    assert control.drain() == [Probe(probe_id=1)]
    assert control.wait(seen, timeout=0) is False


def test_a_playback_report_that_lands_between_the_pacing_decision_and_the_wait_is_not_lost():
    class ReportBeforeWait(ControlPlane):
        """Delivers ``late`` from the receiver's side after the loop decided its
        pacing and just before the loop waits: the race, made certain."""

        late: Playback | None = None

        def wait(self, *args, **kwargs):
            if self.late is not None:
                receiver = threading.Thread(target=self.handle, args=(self.late,))
                receiver.start()
                receiver.join()
                self.late = None
            return super().wait(*args, **kwargs)

    sent: list = []
    config = EngineConfig()
    runner = ModelRunner(StubPipeline())
    control = ReportBeforeWait(config, runner.describe, sent.append)
    loop = inline_loop(config, control, runner, sent.append, grouping=True, max_rows=1)
    # One denoise step a chunk: one micro-step, one run_once.
    control.handle(StartSession(session_id="s", prompt="p", max_lead_seconds=CHUNK_S, num_inference_steps=1))
    control.handle(Playback(session_id="s", position_seconds=0.0))
    loop.run_once()
    assert [m.generation_chunk_index for m in sent if isinstance(m, ChunkReady)] == [0]

    # One chunk ahead of a viewer at 0: held until a report moves the playhead.
    # The report arrives after the decision to hold, before the wait.
    control.late = Playback(session_id="s", position_seconds=CHUNK_S)
    held = threading.Thread(target=loop.run_once, daemon=True)
    held.start()
    held.join(timeout=10)  # returns at once when the wake-up is kept; bounds the failure only
    woke = not held.is_alive()
    if not woke:
        control.handle(Probe(probe_id=1))  # unblock the lost wait, so the thread ends
        held.join()
    assert woke, "the loop slept through a playback report that freed a paced session"
    assert control.late is None
    loop.run_once()  # the report freed exactly one more chunk
    assert [m.generation_chunk_index for m in sent if isinstance(m, ChunkReady)] == [0, 1]
