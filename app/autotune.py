"""``python -m app.autotune``: the command lives in :mod:`app.precision.auto`."""

import sys

from app.precision.auto import main

if __name__ == "__main__":
    sys.exit(main())
