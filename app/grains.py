"""``python -m app.grains``: the command lives in :mod:`app.analysis.grains`."""

import sys

from app.analysis.grains import main

if __name__ == "__main__":
    sys.exit(main())
