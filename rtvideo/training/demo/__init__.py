"""The demo model's training and evaluation; the model as served (its weights
and codec) is ``rtvideo.workers.demo``.

``scenes`` draws the clips (a coloured shape moving over a dark background,
captioned from its attributes), ``objective`` is the block-causal training
forward and loss, ``config`` what a run trains, ``train`` the resumable
training command (``rtvideo train-demo``), ``refine`` trains the codec's
causal decoder refiner (``rtvideo refine-demo-decoder``), ``classify`` reads a
clip's colour, shape and direction back from raw RGB frames, ``metrics`` turns
a stream's readings into the evaluation's measures and bars, and ``evaluate``
(``rtvideo eval-demo``) judges a trained model's chunks through the served
pipeline with them.
"""
