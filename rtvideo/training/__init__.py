"""Training: what makes a model's weights, apart from what serves them (``workers``).

Offline commands that run torch in their own process. They import
``workers`` (the served pipeline, its presets and codecs) and ``engine``;
nothing that serves imports them. ``demo`` trains and judges the demo model.
"""
