"""``python -m qerl.export``."""

import sys

from qerl.export.cli import main

sys.exit(main())
