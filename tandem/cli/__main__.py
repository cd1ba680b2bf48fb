"""`python -m tandem.cli`: the `tandem` command without its installed entry point."""

import sys

from tandem.cli import main

sys.exit(main())
