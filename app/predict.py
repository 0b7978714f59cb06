"""``python -m app.predict``: the command lives in :mod:`app.analysis.predict`."""

import sys

from app.analysis.predict import main

if __name__ == "__main__":
    sys.exit(main())
