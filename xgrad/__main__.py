"""``python -m xgrad``: the ``xgrad`` command, for an environment whose scripts are not on
the path (the same entry point as the installed command)."""

import sys

from xgrad.cli import main

if __name__ == "__main__":
    sys.exit(main())
