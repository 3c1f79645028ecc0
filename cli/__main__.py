"""``python -m cli``: the ``rtvideo`` command."""

import sys

from cli.main import main

sys.exit(main())
