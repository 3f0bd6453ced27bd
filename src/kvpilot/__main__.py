"""`python -m kvpilot`: the `kvpilot` console script (cli.py)."""

import sys

from kvpilot.cli import main

sys.exit(main())
