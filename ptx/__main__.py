"""``python -m ptx``: see :mod:`ptx.cli`."""
import sys

from .cli import main

sys.exit(main())
