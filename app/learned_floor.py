"""``python -m app.learned_floor``: the command lives in :mod:`app.analysis.learned_floor`."""

import sys

from app.analysis.learned_floor import main

if __name__ == "__main__":
    sys.exit(main())
