"""``python -m trainers.tools.planner``: the same as ``trainers plan``."""

import sys

from trainers.tools.planner.output import main

sys.exit(main())
