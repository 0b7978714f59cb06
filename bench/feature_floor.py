"""The learned floor of a data root, under the benchmark's old name and flags:

    python bench/feature_floor.py --data DIR [--normalization raw] [--leave-one-out]

The learned floor (gradient-boosted trees on multi-scale filter features, ilastik's recipe) is a
command of the product now, ``python -m app.learned_floor`` (:mod:`app.analysis.learned_floor`).
This wrapper keeps the benchmark's flags: ``--data`` for ``--data-root``, and the files' own
(``raw``) intensities unless ``--normalization`` says otherwise.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from app.analysis.learned_floor import main as learned_floor_main  # noqa: E402


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    args = [  # --data DIR or --data=DIR
        a.replace("--data", "--data-root", 1) if a.split("=")[0] == "--data" else a for a in args
    ]
    if not any(a.split("=")[0] == "--normalization" for a in args):
        args += ["--normalization", "raw"]
    return learned_floor_main(args)


if __name__ == "__main__":
    sys.exit(main())
