"""``python -m msprobe_core``: see ``msprobe_core.cli``."""

import sys

from msprobe_core.cli import main

sys.exit(main())
