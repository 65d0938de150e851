"""``python -m trainfast``: the ``trainfast`` command line."""

import sys

from trainfast.cli import main

sys.exit(main())
