"""``python -m rtvideo``: the ``rtvideo`` command, as ``python -m rtvideo.cli`` is."""

import sys

from rtvideo.cli.main import main

sys.exit(main())
