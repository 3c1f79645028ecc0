"""The demo model as served: a tiny causal video model trained on synthetic scenes.

Worker side (torch). ``WEIGHTS`` is the shipped model directory and ``codec``
the fixed linear latent codec (with its causal decoder refiner) the served
pipeline decodes with. What trains and judges the model is ``rtvideo.training.demo``.
"""

from pathlib import Path

WEIGHTS = Path(__file__).parent / "weights"
"""The shipped demo model: a servable model directory (``rtvideo serve --model demo``,
the server's default), kept in the repository and read offline."""
