"""``python -m rtvideo.cli``: the ``rtvideo`` command."""

import sys

from rtvideo.cli.main import main

sys.exit(main())
