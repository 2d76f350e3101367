"""`python -m miles.cli`: the `miles` command."""

import sys

from miles.cli import main

sys.exit(main())
