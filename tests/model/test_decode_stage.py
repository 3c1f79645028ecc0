"""The decode stage on the causal Wan pipeline (tiny, CPU, in process): decoding
on a thread of its own while the next chunks denoise changes no frame."""

from __future__ import annotations

from rtvideo.engine.messages import StartSession
from rtvideo.workers.chunk_driver import ChunkDriver
from rtvideo.workers.pipelines.causal_wan import build


def test_overlapped_decodes_give_the_frames_of_in_line_ones():
    pipeline = build("tiny", device="cpu", warm_up_chunks=0, max_batch_rows=2)
    made = []
    for overlap in (False, True):
        driver = ChunkDriver(pipeline, overlap_decode=overlap)
        starts = [StartSession(session_id=f"s{i}", prompt=f"prompt {i}", seed=i, num_inference_steps=2) for i in (0, 1)]
        driver.open(*starts)
        first = driver.run(["s0", "s1"], 2)
        then = driver.run(["s0", "s1"], 2, interactions={"s0": ("a storm", 2)})
        driver.release("s0", "s1")
        driver.close()
        made.append({sid: [c.payload for c in first[sid] + then[sid]] for sid in first})
        assert pipeline.held_sessions() == ()
    in_line, overlapped = made
    assert in_line == overlapped and all(len(chunks) == 4 for chunks in in_line.values())
