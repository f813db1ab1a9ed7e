"""``python -m offload``: the command line (see offload/cli.py)."""
import sys

from offload.cli import main

sys.exit(main())
