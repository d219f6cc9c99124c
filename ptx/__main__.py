"""``python -m ptx``: see :mod:`ptx.cli`."""
import sys

from ptx.cli import main

sys.exit(main())
