"""`python -m seedflood ...`: the `seedflood` command."""

import sys

from seedflood.cli import main

sys.exit(main())
