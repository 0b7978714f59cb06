"""Score predicted masks against labels: ``python -m app.evaluate --help``.

Per volume: Dice, IoU, precision, recall and HD95, plus the TP/FP/FN counts; a CSV (one row per
volume) and a JSON summary (mean, median, global figures, every volume).

Policies
--------
- Pairing, by name: a label ``NAME.EXT`` in ``--labels`` is scored against ``NAME_mask.EXT`` or
  ``NAME.EXT`` in ``--pred`` (any extension; both present is an error), or, when neither exists,
  ``NAME_probs.EXT``. A label without a prediction, a prediction without a label, and a pair of
  different shapes are errors (exit status 2), all listed at once, each naming its files.
- Binarisation: labels as the trainer reads them ({0, 1}, {0, 255} or bool); float predictions
  are foreground where > 0.5 (probabilities), integer ones must be {0, 1} / {0, 255} / bool.
- Dice = 2TP / (2TP + FP + FN), IoU = TP / (TP + FP + FN), precision = TP / (TP + FP),
  recall = TP / (TP + FN).
- HD95: symmetric 95th-percentile Hausdorff distance between the surfaces (foreground voxels with
  a background 6-neighbour; outside the volume counts as background): the larger of the two
  directed 95th percentiles (numpy's linear interpolation) of the distances from each surface
  voxel of one mask to the nearest surface voxel of the other, by Euclidean distance transforms.
  Unit: the label's NIfTI voxel spacing (pixdim), in the unit its header names (mm when it names
  none); ``voxel`` for TIFF/NPY labels or with ``--spacing voxel``. The ``hd95_unit`` column says
  which.
- Empty masks: empty in both prediction and label: Dice = IoU = precision = recall = 1,
  HD95 = 0 (nothing to find, nothing found). Empty in exactly one: Dice = IoU = precision =
  recall = 0 and HD95 = inf, written ``null`` in the JSON and ``inf`` in the CSV; such volumes
  are left out of the HD95 mean and median, and ``hd95_excluded`` counts them.
- Summary: ``mean`` and ``median`` over volumes (each volume weighs the same); ``global`` Dice,
  IoU, precision and recall from the counts summed over all volumes (large volumes weigh more;
  the trainer's reported ``dice`` and ``iou`` are these).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from scipy import ndimage

from app.atomic import atomic_write_bytes
from app.data import binarize_label, check_finite
from app.predict import HelpFormatter
from app.volume_io import (
    EXTENSIONS,
    VolumeError,
    VolumeMeta,
    is_volume_file,
    read_volume,
    split_ext,
)

METRICS = ("dice", "iou", "precision", "recall", "hd95")
CSV_COLUMNS = ("name", "prediction", "label", "shape", "tp", "fp", "fn", *METRICS, "hd95_unit")
NIFTI_UNITS = {"mm": "mm", "micron": "um", "meter": "m", "unknown": "mm"}


class EvaluateError(ValueError):
    """The inputs are unusable; each line names a file or flag."""


# ----------------------------------------------------------------------------- figures
def overlap_scores(pred: np.ndarray, label: np.ndarray) -> dict[str, Any]:
    """Counts and overlap scores of two boolean masks, with the empty-mask policy above."""
    tp = int(np.count_nonzero(pred & label))
    fp = int(np.count_nonzero(pred & ~label))
    fn = int(np.count_nonzero(~pred & label))
    return {"tp": tp, "fp": fp, "fn": fn, **scores_from_counts(tp, fp, fn)}


def scores_from_counts(tp: int, fp: int, fn: int) -> dict[str, float]:
    if tp + fp + fn == 0:
        return {"dice": 1.0, "iou": 1.0, "precision": 1.0, "recall": 1.0}

    def ratio(a: int, b: int) -> float:
        return a / b if b else 0.0

    return {
        "dice": ratio(2 * tp, 2 * tp + fp + fn),
        "iou": ratio(tp, tp + fp + fn),
        "precision": ratio(tp, tp + fp),
        "recall": ratio(tp, tp + fn),
    }


def surface(mask: np.ndarray) -> np.ndarray:
    """Foreground voxels with at least one background 6-neighbour (outside is background)."""
    structure = ndimage.generate_binary_structure(mask.ndim, 1)
    return mask & ~ndimage.binary_erosion(mask, structure, border_value=0)


def hd95(pred: np.ndarray, label: np.ndarray, spacing=None) -> float:
    """Symmetric HD95 of two boolean masks: 0 if both are empty, inf if exactly one is."""
    if not pred.any() and not label.any():
        return 0.0
    if not pred.any() or not label.any():
        return math.inf
    # both surfaces lie in the union's bounding box: crop there (exact, and much cheaper)
    box = ndimage.find_objects((pred | label).astype(np.uint8))[0]
    box = tuple(slice(max(s.start - 1, 0), s.stop + 1) for s in box)
    pred_s, label_s = surface(pred[box]), surface(label[box])
    to_label = ndimage.distance_transform_edt(~label_s, sampling=spacing)[pred_s]
    to_pred = ndimage.distance_transform_edt(~pred_s, sampling=spacing)[label_s]
    return float(max(np.percentile(to_label, 95), np.percentile(to_pred, 95)))


# ----------------------------------------------------------------------------- files
@dataclass
class Pair:
    name: str
    prediction: Path
    label: Path


def index_folder(folder: Path, flag: str) -> dict[str, Path]:
    if not folder.is_dir():
        raise EvaluateError(f"{flag} {folder}: no such folder")
    found: dict[str, Path] = {}
    problems = []
    for path in sorted(folder.iterdir()):
        if not is_volume_file(path):
            continue
        name = split_ext(path)[0]
        if name in found:
            problems.append(f"{path}: same name as {found[name]}; names must be unique")
        found[name] = path
    if problems:
        raise EvaluateError("\n".join(problems))
    if not found:
        raise EvaluateError(f"{flag} {folder}: no volumes ({', '.join(EXTENSIONS)}) in this folder")
    return found


def pair_files(pred_dir: Path, labels_dir: Path) -> list[Pair]:
    """Pairs by name (see the module docstring); every problem is reported at once."""
    preds, labels = index_folder(pred_dir, "--pred"), index_folder(labels_dir, "--labels")
    pairs, used, problems = [], set(), []
    for name, label in labels.items():
        masks = [n for n in (f"{name}_mask", name) if n in preds]
        if len(masks) > 1:
            problems.append(
                f"{label}: two predictions match it, {preds[masks[0]]} and "
                f"{preds[masks[1]]}; keep one"
            )
            continue
        chosen = masks[0] if masks else f"{name}_probs" if f"{name}_probs" in preds else None
        if chosen is None:
            problems.append(
                f"{label}: no prediction {name}_mask.*, {name}.* or {name}_probs.* in {pred_dir}"
            )
            continue
        used.update({chosen, f"{name}_probs"})  # the probabilities next to a mask are no extra
        pairs.append(Pair(name, preds[chosen], label))
    problems += [
        f"{path}: prediction without a label in {labels_dir}"
        for n, path in preds.items()
        if n not in used
    ]
    if problems:
        raise EvaluateError("\n".join(problems))
    return pairs


def binarize_prediction(array: np.ndarray, path: Path) -> np.ndarray:
    check_finite(array, path)
    if array.dtype.kind == "f":
        return array > 0.5
    return binarize_label(array, path).astype(bool)


def spacing_of(meta: VolumeMeta, mode: str) -> tuple[tuple[float, ...] | None, str]:
    if mode == "voxel" or meta.header is None:
        return None, "voxel"
    zooms = tuple(float(z) for z in meta.header.get_zooms()[:3])
    if any(not z > 0 for z in zooms):
        return None, "voxel"
    return zooms, NIFTI_UNITS.get(meta.header.get_xyzt_units()[0], "mm")


def evaluate_pair(pair: Pair, spacing_mode: str = "header") -> dict[str, Any]:
    raw_pred, _ = read_volume(pair.prediction)
    raw_label, meta = read_volume(pair.label)
    if raw_pred.shape != raw_label.shape:
        raise VolumeError(
            f"{pair.prediction}: shape {raw_pred.shape} differs from its label "
            f"{pair.label} with shape {raw_label.shape}"
        )
    check_finite(raw_label, pair.label)
    label = binarize_label(raw_label, pair.label).astype(bool)
    pred = binarize_prediction(raw_pred, pair.prediction)
    spacing, unit = spacing_of(meta, spacing_mode)
    return {
        "name": pair.name,
        "prediction": str(pair.prediction),
        "label": str(pair.label),
        "shape": list(label.shape),
        **overlap_scores(pred, label),
        "hd95": hd95(pred, label, spacing),
        "hd95_unit": unit,
    }


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    finite_hd = [r["hd95"] for r in rows if math.isfinite(r["hd95"])]

    def stat(fn, key: str) -> float | None:
        values = finite_hd if key == "hd95" else [r[key] for r in rows]
        return float(fn(values)) if values else None

    totals = {k: sum(r[k] for r in rows) for k in ("tp", "fp", "fn")}
    units = sorted({r["hd95_unit"] for r in rows})
    return {
        "count": len(rows),
        "mean": {k: stat(np.mean, k) for k in METRICS},
        "median": {k: stat(np.median, k) for k in METRICS},
        "global": {**scores_from_counts(**totals), **totals},
        "hd95_unit": units[0] if len(units) == 1 else units,
        "hd95_excluded": len(rows) - len(finite_hd),
        "volumes": [{**r, "hd95": r["hd95"] if math.isfinite(r["hd95"]) else None} for r in rows],
    }


def csv_text(rows: list[dict[str, Any]]) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    for r in rows:
        writer.writerow(
            [
                " ".join(map(str, r[c]))
                if c == "shape"
                else f"{r[c]:.6g}"
                if isinstance(r[c], float)
                else r[c]
                for c in CSV_COLUMNS
            ]
        )
    return out.getvalue()


# ----------------------------------------------------------------------------- the command
DESCRIPTION = """\
Per-volume Dice, IoU, precision, recall and HD95 of predicted masks against labels.

Pairing by name: label NAME.EXT <- prediction NAME_mask.EXT or NAME.EXT, else
NAME_probs.EXT (any extension). Float predictions are foreground where > 0.5.
Missing, extra or mismatched files are errors (exit status 2), all listed at once.

Empty in both prediction and label: Dice = IoU = precision = recall = 1, HD95 = 0.
Empty in exactly one: Dice = IoU = precision = recall = 0, HD95 = inf, written as
null in the JSON and inf in the CSV, left out of the HD95 mean and median and
counted in hd95_excluded.

HD95: the larger of the two directed 95th percentiles of surface-to-surface
distances, in the label's NIfTI spacing unit (mm unless its header names another),
in voxels for TIFF/NPY labels or with --spacing voxel; the hd95_unit field says
which. Writes the JSON summary (--out: mean, median, global figures from summed
counts, every volume) and a CSV with one row per volume next to it."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m app.evaluate",
        description=DESCRIPTION,
        formatter_class=HelpFormatter,
    )
    parser.add_argument(
        "--pred",
        metavar="DIR",
        type=Path,
        required=True,
        help="folder of predictions (e.g. the --output of app.predict)",
    )
    parser.add_argument(
        "--labels", metavar="DIR", type=Path, required=True, help="folder of labels NAME.EXT"
    )
    parser.add_argument(
        "--out",
        metavar="FILE.json",
        type=Path,
        required=True,
        help="JSON summary to write (FILE.json); the CSV goes to FILE.csv",
    )
    parser.add_argument(
        "--spacing",
        choices=["header", "voxel"],
        default="header",
        help="HD95 in the label's NIfTI spacing, or in voxels",
    )
    return parser


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.out.suffix.lower() != ".json":
        raise EvaluateError(f"--out {args.out}: must end with .json (the CSV takes its stem)")
    pairs = pair_files(args.pred, args.labels)
    rows, problems = [], []
    for pair in pairs:
        try:
            rows.append(evaluate_pair(pair, args.spacing))
        except VolumeError as exc:
            problems.append(str(exc))
    if problems:
        raise EvaluateError("\n".join(problems))
    summary = {"pred": str(args.pred), "labels": str(args.labels), **summarize(rows)}
    try:
        atomic_write_bytes(args.out.with_suffix(".csv"), csv_text(rows).encode())
        atomic_write_bytes(args.out, (json.dumps(summary, indent=2) + "\n").encode())
    except OSError as exc:
        raise EvaluateError(f"--out {args.out}: cannot write ({exc.strerror or exc})") from exc
    return summary


def report_line(summary: dict[str, Any]) -> str:
    mean, glob = summary["mean"], summary["global"]
    hd = "n/a" if mean["hd95"] is None else f"{mean['hd95']:.3g}"
    unit = summary["hd95_unit"]
    return (
        f"{summary['count']} volume(s): global Dice {glob['dice']:.4f}, IoU "
        f"{glob['iou']:.4f}; mean Dice {mean['dice']:.4f}, IoU {mean['iou']:.4f}, precision "
        f"{mean['precision']:.4f}, recall {mean['recall']:.4f}, HD95 {hd} "
        f"{unit if isinstance(unit, str) else '/'.join(unit)}"
        f" ({summary['hd95_excluded']} volume(s) with HD95 = inf left out)"
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        summary = run(args)
    except (EvaluateError, VolumeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(report_line(summary))
    print(f"wrote {args.out} and {args.out.with_suffix('.csv')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
