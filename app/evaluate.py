"""``python -m app.evaluate``: the command lives in :mod:`app.analysis.evaluate`."""

import sys

from app.analysis.evaluate import main

if __name__ == "__main__":
    sys.exit(main())
