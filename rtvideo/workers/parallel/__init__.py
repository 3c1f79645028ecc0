"""Temporal pipeline parallelism: the transformer's blocks split over ranks.

Worker processes, torch-side. ``group`` starts and joins the ranks
(``torch.distributed``: gloo on a CPU, NCCL on GPUs) and watches them;
``link`` moves a micro-step's activations from rank to rank;
``partition`` splits the blocks by measured cost; ``ring`` is rank 0's
runner (the engine's micro-steps, executed as the first stage of the ring);
``follower`` is the loop of every other rank.
"""
