"""``python -m trainers.cli.planner``: the same as ``trainers plan``."""

import sys

from trainers.cli.planner.output import main

sys.exit(main())
