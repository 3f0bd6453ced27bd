"""`python -m kvpilot.router`: the router process (see cli.py for the flags)."""

import sys

from .cli import main

sys.exit(main())
