"""``commit_from_last_step`` (a pipeline option of causal Wan): a chunk's commit
writes the keys and values its last denoise step computed instead of running
a clean pass at t = 0. In process, the tiny preset on the CPU, through the
worker's own chunk driver."""

from __future__ import annotations

import pytest

from rtvideo.engine.messages import StartSession
from rtvideo.workers.chunk_driver import ChunkDriver
from rtvideo.workers.pipelines.causal_wan import build

START = dict(prompt="a red fox", seed=9, width=32, height=32, num_inference_steps=3)


def run(pipeline, sessions: list[str], chunks: int) -> dict[str, list[bytes]]:
    driver = ChunkDriver(pipeline)
    driver.open(*(StartSession(session_id=sid, **START) for sid in sessions))
    made = driver.run(sessions, chunks)
    driver.release(*sessions)
    return {sid: [out.payload for out in outs] for sid, outs in made.items()}


def test_the_commit_runs_no_forward_and_later_chunks_attend_to_the_last_steps_keys():
    default = build("tiny", device="cpu", warm_up_chunks=0, max_batch_rows=2)
    last = build("tiny", device="cpu", warm_up_chunks=0, max_batch_rows=2, commit_from_last_step=True)
    forwards = []
    last.transformer.blocks[0].register_forward_pre_hook(lambda *_: forwards.append(1))
    made = run(last, ["a"], 3)["a"]
    assert len(forwards) == 3 * 3  # a forward a denoise step, none for the three commits
    reference = run(default, ["a"], 3)["a"]
    assert made[0] == reference[0]  # the first chunk attends to nothing committed
    assert made[1] != reference[1] and made[2] != reference[2]  # later ones to the last steps' keys
    assert run(last, ["a"], 3)["a"] == made  # deterministic
    together = run(last, ["a", "b"], 3)  # two sessions a forward, their commits as one batch
    assert together["a"] == together["b"] == made


def test_it_runs_on_one_rank_only():
    pipeline = build("tiny", device="cpu", warm_up_chunks=0, commit_from_last_step=True)
    with pytest.raises(ValueError, match=r"commit_from_last_step: .* runs on one rank \(--pp 1\)"):
        pipeline.own_blocks(range(0, 1), most_per_rank=1)
