"""The demo model: a tiny causal video model trained on synthetic scenes.

Worker side (torch). ``scenes`` draws the clips (a coloured shape moving over
a dark background, captioned from its attributes), ``codec`` is the fixed
linear latent codec the served pipeline decodes with, ``objective`` is the
block-causal training forward and loss, ``config`` what a run trains,
``train`` the resumable training command (``rtvideo train-demo``),
``classify`` reads a clip's colour, shape and direction back from raw RGB
frames, ``metrics`` turns a stream's readings into
the evaluation's measures and bars, and ``evaluate`` (``rtvideo eval-demo``)
judges a trained model's chunks through the served pipeline with them.
"""

from pathlib import Path

WEIGHTS = Path(__file__).parent / "weights"
"""The shipped demo model: a servable model directory (``rtvideo serve --model demo``,
the server's default), kept in the repository and read offline."""
