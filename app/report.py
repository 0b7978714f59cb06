"""``python -m app.report``: the command lives in :mod:`app.analysis.report`."""

import sys

from app.analysis.report import main

if __name__ == "__main__":
    sys.exit(main())
