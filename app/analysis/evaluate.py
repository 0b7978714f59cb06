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
  Unit: the voxel size the label's file states, in its unit (NIfTI: mm unless the header names
  another; ImageJ/OME TIFF; zarr; ``app.volume_io``); ``voxel`` for a label that states none
  (``.npy``, a plain TIFF) or with ``--spacing voxel``. The ``hd95_unit`` column says which.
- Grid: a prediction must lie on its label's grid (shape, and the spacing, origin and
  orientation both files state), or the pair is an error naming both files.
- Empty masks: empty in both prediction and label: Dice = IoU = precision = recall = 1,
  HD95 = 0 (nothing to find, nothing found). Empty in exactly one: Dice = IoU = precision =
  recall = 0 and HD95 = inf, written ``null`` in the JSON and ``inf`` in the CSV; such volumes
  are left out of the HD95 mean and median, and ``hd95_excluded`` counts them.
- Summary: ``mean`` and ``median`` over volumes (each volume weighs the same); ``global`` Dice,
  IoU, precision and recall from the counts summed over all volumes (large volumes weigh more;
  the trainer's reported ``dice`` and ``iou`` are these).
- Grains (on unless ``--no-grains``; see :mod:`app.analysis.grains`): the predicted mask is split
  into grains by the distance-map watershed, and so is the label unless an instance map gives the
  true grains: ``--instances DIR`` with ``NAME.EXT`` maps (0 background, one id per grain), by
  default the ``instances`` folder beside ``--labels`` when there is one (the synthetic
  generator writes it). Grains under ``--grain-min-size`` voxels are left out on both sides.
  Per volume: grain counts, one-to-one matches at IoU >= 0.5, object precision, recall and F1,
  merged and split grains, the count error (predicted - true), and the size-distribution error
  (predicted - true d10/d50/d90 of the equivalent diameters, and their Wasserstein distance) in
  the spacing's unit. The summary pools them: summed counts, and the errors of the pooled
  distributions. ``grains.truth`` says where the true grains came from.
- Label maps (``--num-classes K >= 2``, names from ``--class-names``): labels and predictions are
  integer class maps ``0..K-1`` (0 = background; a fractional float map, such as probabilities,
  or a value outside the range is an error naming the file, as in training), paired by name as
  above (``NAME_probs_CLASS.EXT`` files beside the map are no extra). Per volume and per
  foreground class: the counts, Dice, IoU, precision and recall of ``pred == c`` against
  ``label == c``; the summary gives each class's mean over volumes and its global figures from
  summed counts (the trainer's ``dice/CLASS``), and their mean over the foreground classes (the
  trainer's ``dice``). HD95 and the grain figures are binary-only and left out; the CSV has one
  row per volume and class.

Size (over 500 lines): the two evaluations (binary masks with HD95 and grains; label maps per
class) share the pairing of files, the CSV and JSON writers and the command; apart, each would
import the other's half.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import io
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from scipy import ndimage

from app.analysis import grains
from app.analysis.cli import HelpFormatter, add_spacing_argument
from app.atomic import atomic_write_bytes
from app.data.dataset import check_finite, check_same_grid
from app.data.volume_io import (
    EXTENSIONS,
    VolumeError,
    is_volume_file,
    read_volume,
    split_ext,
    voxel_spacing,
)
from app.labels import (
    LabelScheme,
    binarize_label,
    check_class_label,
    label_scheme,
    name_problems,
    scheme_of_names,
)

METRICS = ("dice", "iou", "precision", "recall", "hd95")
GRAIN_COLUMNS = (
    "true_grains",
    "pred_grains",
    "matched_grains",
    "object_precision",
    "object_recall",
    "object_f1",
    "merged_grains",
    "split_grains",
    "grain_count_error",
    "d10_error",
    "d50_error",
    "d90_error",
    "d50_error_by_volume",
    "wasserstein",
    "grain_unit",
)
GRAIN_PREFIX = "grain-"  # --grain-min-size, --grain-h, --grain-smooth
CSV_COLUMNS = ("name", "prediction", "label", "shape", "tp", "fp", "fn", *METRICS, "hd95_unit")


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
    instances: Path | None = None  # the true grains; None: the label's watershed


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


def pair_files(pred_dir: Path, labels_dir: Path, classes: list[str] = ()) -> list[Pair]:
    """Pairs by name (see the module docstring); every problem is reported at once. With
    ``classes`` (K >= 2) a label map is required and the per-class probabilities are skipped."""
    scheme = scheme_of_names(classes)
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
        # binary: the probabilities stand in for a missing mask; K >= 2: a label map is needed,
        # and its per-class probabilities (any names) are no extra
        fallback, options, extra = scheme.choose(
            binary=(f"{name}_probs", f"{name}_mask.*, {name}.* or {name}_probs.*", ()),
            classes=(None, f"{name}_mask.* or {name}.*", f"{name}_probs_"),
        )
        chosen = masks[0] if masks else fallback if fallback in preds else None
        used.update(n for n in preds if extra and n.startswith(extra))
        if chosen is None:
            problems.append(f"{label}: no prediction {options} in {pred_dir}")
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


def instances_folder(choice: Path | None, labels_dir: Path) -> Path | None:
    """``--instances``, else the ``instances`` folder beside ``--labels`` if there is one."""
    if choice is not None:
        if not choice.is_dir():
            raise EvaluateError(f"--instances {choice}: no such folder")
        return choice
    beside = labels_dir.parent / "instances"
    return beside if beside.is_dir() else None


def attach_instances(pairs: list[Pair], folder: Path) -> list[Pair]:
    """Each pair with its instance map ``NAME.EXT`` from ``folder``; all gaps named at once."""
    maps = index_folder(folder, "--instances")
    missing = [
        f"{p.label}: no instance map {p.name}.* in {folder}" for p in pairs if p.name not in maps
    ]
    if missing:
        raise EvaluateError("\n".join(missing))
    return [dataclasses.replace(p, instances=maps[p.name]) for p in pairs]


def binarize_prediction(array: np.ndarray, path: Path) -> np.ndarray:
    check_finite(array, path)
    if array.dtype.kind == "f":
        return array > 0.5
    return binarize_label(array, path).astype(bool)


def grain_scores(
    pred: np.ndarray, truth: np.ndarray, params: grains.GrainParams, spacing, unit: str
) -> dict[str, Any]:
    """Object-level figures of one volume (see the module docstring); ``_diameters`` keeps the
    predicted and true equivalent diameters for the pooled distributions."""
    predicted = grains.split_grains(pred, params, spacing)
    match = grains.match_grains(predicted, truth)
    pred_d = grains.equivalent_diameters(predicted, spacing)
    true_d = grains.equivalent_diameters(truth, spacing)
    errors = grains.distribution_error(pred_d, true_d)
    return {
        "true_grains": match.n_true,
        "pred_grains": match.n_pred,
        "matched_grains": match.matched,
        **match.scores,
        "merged_grains": match.merged,
        "split_grains": match.split,
        "grain_count_error": match.n_pred - match.n_true,
        **{k: errors[k] for k in GRAIN_COLUMNS if k in errors},
        "grain_unit": unit,
        "_diameters": (pred_d, true_d),
    }


def evaluate_pair(
    pair: Pair, spacing_mode: str = "header", grain_params: grains.GrainParams | None = None
) -> dict[str, Any]:
    """One volume's figures; ``grain_params`` None leaves the grains out."""
    raw_pred, pred_meta = read_volume(pair.prediction)
    raw_label, meta = read_volume(pair.label)
    check_same_grid(
        pair.prediction, raw_pred.shape, pred_meta.grid, pair.label, raw_label.shape, meta.grid
    )
    check_finite(raw_label, pair.label)
    label = binarize_label(raw_label, pair.label).astype(bool)
    pred = binarize_prediction(raw_pred, pair.prediction)
    spacing, unit = voxel_spacing(meta, spacing_mode)
    row = {
        "name": pair.name,
        "prediction": str(pair.prediction),
        "label": str(pair.label),
        "shape": list(label.shape),
        **overlap_scores(pred, label),
        "hd95": hd95(pred, label, spacing),
        "hd95_unit": unit,
    }
    if grain_params is not None:
        truth = grains.true_instances(label, pair.label, pair.instances, grain_params, spacing)
        row.update(grain_scores(pred, truth, grain_params, spacing, unit))
    return row


CLASS_CSV_COLUMNS = ("name", "class", "tp", "fp", "fn", "dice", "iou", "precision", "recall")


def evaluate_classes_pair(pair: Pair, classes: list[str]) -> dict[str, Any]:
    """One volume's per-class figures of a label map (``classes``: background first)."""
    raw_pred, pred_meta = read_volume(pair.prediction)
    raw_label, label_meta = read_volume(pair.label)
    check_same_grid(
        pair.prediction,
        raw_pred.shape,
        pred_meta.grid,
        pair.label,
        raw_label.shape,
        label_meta.grid,
    )
    label = check_class_label(raw_label, pair.label, len(classes))
    pred = check_class_label(raw_pred, pair.prediction, len(classes))
    return {
        "name": pair.name,
        "prediction": str(pair.prediction),
        "label": str(pair.label),
        "shape": list(label.shape),
        "classes": {
            name: overlap_scores(pred == c, label == c)
            for c, name in enumerate(classes[1:], start=1)
        },
    }


def summarize_classes(rows: list[dict[str, Any]], classes: list[str]) -> dict[str, Any]:
    """Per class: mean over volumes and global figures from summed counts; then their mean over
    the foreground classes."""
    scores = ("dice", "iou", "precision", "recall")
    mean, glob = {}, {}
    for name in classes[1:]:
        per_volume = [r["classes"][name] for r in rows]
        mean[name] = {k: float(np.mean([v[k] for v in per_volume])) for k in scores}
        totals = {k: sum(v[k] for v in per_volume) for k in ("tp", "fp", "fn")}
        glob[name] = {**scores_from_counts(**totals), **totals}
    return {
        "count": len(rows),
        "classes": list(classes),
        "mean_foreground": {
            "global": {k: float(np.mean([glob[n][k] for n in glob])) for k in scores},
            "mean": {k: float(np.mean([mean[n][k] for n in mean])) for k in scores},
        },
        "global": glob,
        "mean": mean,
        "volumes": rows,
    }


def classes_csv_text(rows: list[dict[str, Any]]) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(CLASS_CSV_COLUMNS)
    for r in rows:
        for name, v in r["classes"].items():
            writer.writerow(
                [r["name"], name, v["tp"], v["fp"], v["fn"]]
                + [f"{v[k]:.6g}" for k in CLASS_CSV_COLUMNS[5:]]
            )
    return out.getvalue()


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    finite_hd = [r["hd95"] for r in rows if math.isfinite(r["hd95"])]

    def stat(fn, key: str) -> float | None:
        values = finite_hd if key == "hd95" else [r[key] for r in rows]
        return float(fn(values)) if values else None

    totals = {k: sum(r[k] for r in rows) for k in ("tp", "fp", "fn")}
    units = sorted({r["hd95_unit"] for r in rows})
    summary = {
        "count": len(rows),
        "mean": {k: stat(np.mean, k) for k in METRICS},
        "median": {k: stat(np.median, k) for k in METRICS},
        "global": {**scores_from_counts(**totals), **totals},
        "hd95_unit": units[0] if len(units) == 1 else units,
        "hd95_excluded": len(rows) - len(finite_hd),
        "volumes": [
            {
                **{k: v for k, v in r.items() if not k.startswith("_")},
                "hd95": r["hd95"] if math.isfinite(r["hd95"]) else None,
            }
            for r in rows
        ],
    }
    if rows and "_diameters" in rows[0]:
        summary["grains"] = summarize_grains(rows)
    return summary


def summarize_grains(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Pooled object figures: counts summed over volumes, errors of the pooled distributions."""
    counts = {
        k: sum(r[k] for r in rows)
        for k in ("true_grains", "pred_grains", "matched_grains", "merged_grains", "split_grains")
    }
    pred_d = np.concatenate([r["_diameters"][0] for r in rows])
    true_d = np.concatenate([r["_diameters"][1] for r in rows])
    units = sorted({r["grain_unit"] for r in rows})
    return {
        **counts,
        **grains.object_scores(
            counts["matched_grains"], counts["pred_grains"], counts["true_grains"]
        ),
        "grain_count_error": counts["pred_grains"] - counts["true_grains"],
        "mean_object_f1": float(np.mean([r["object_f1"] for r in rows])),
        **grains.distribution_error(pred_d, true_d),
        "unit": units[0] if len(units) == 1 else units,
        "predicted_size_distribution": grains.size_distribution(pred_d),
        "true_size_distribution": grains.size_distribution(true_d),
    }


def csv_text(rows: list[dict[str, Any]]) -> str:
    columns = CSV_COLUMNS + (GRAIN_COLUMNS if rows and "object_f1" in rows[0] else ())
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(columns)
    for r in rows:
        writer.writerow(
            [
                " ".join(map(str, r[c]))
                if c == "shape"
                else f"{r[c]:.6g}"
                if isinstance(r[c], float)
                else ""
                if r[c] is None
                else r[c]
                for c in columns
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
distances, in the voxel size and unit the label's file states (NIfTI, ImageJ/OME
TIFF, zarr), in voxels for labels that state none or with --spacing voxel; the
hd95_unit field says which. Writes the JSON summary (--out: mean, median, global figures from summed
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
        help="folder of predictions (e.g. the --output of app.analysis.predict)",
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
    add_spacing_argument(parser, "HD95 and grain sizes (the label's file)")
    parser.add_argument(
        "--num-classes",
        metavar="K",
        type=int,
        default=1,
        help="1: binary masks; K >= 2: label maps 0..K-1 scored per class (no HD95 or grains)",
    )
    parser.add_argument(
        "--class-names",
        metavar="NAME",
        nargs="*",
        default=[],
        help="the K class names, background first (default: class0 ... classK-1)",
    )
    grain = parser.add_argument_group("grains (object-level figures, see app.analysis.grains)")
    grain.add_argument(
        "--no-grains", action="store_true", help="voxel figures only (faster on big volumes)"
    )
    grain.add_argument(
        "--instances",
        metavar="DIR",
        type=Path,
        help="true grain instance maps NAME.EXT (default: LABELS/../instances when it "
        "exists, else the watershed of each label)",
    )
    grains.add_grain_arguments(grain, prefix=GRAIN_PREFIX)
    return parser


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.out.suffix.lower() != ".json":
        raise EvaluateError(f"--out {args.out}: must end with .json (the CSV takes its stem)")
    return labels_of(args).choose(binary=run_masks, classes=run_classes)(args)


def run_masks(args: argparse.Namespace) -> dict[str, Any]:
    """:func:`run` for binary masks: overlap, HD95 and, unless ``--no-grains``, grains."""
    pairs = pair_files(args.pred, args.labels)
    grain_params, truth = None, None
    if not args.no_grains:
        try:
            grain_params = grains.params_from_args(args, GRAIN_PREFIX)
        except grains.GrainError as exc:
            raise EvaluateError(str(exc)) from exc
        folder = instances_folder(args.instances, args.labels)
        if folder is not None:
            pairs = attach_instances(pairs, folder)
        truth = f"instance maps in {folder}" if folder else "watershed of the labels"
    rows, problems = [], []
    for pair in pairs:
        try:
            rows.append(evaluate_pair(pair, args.spacing, grain_params))
        except VolumeError as exc:
            problems.append(str(exc))
    if problems:
        raise EvaluateError("\n".join(problems))
    summary = {"pred": str(args.pred), "labels": str(args.labels), **summarize(rows)}
    if grain_params is not None:
        summary["grains"] = {
            "truth": truth,
            "params": dataclasses.asdict(grain_params),
            **summary["grains"],
        }
    try:
        atomic_write_bytes(args.out.with_suffix(".csv"), csv_text(rows).encode())
        atomic_write_bytes(args.out, (json.dumps(summary, indent=2) + "\n").encode())
    except OSError as exc:
        raise EvaluateError(f"--out {args.out}: cannot write ({exc.strerror or exc})") from exc
    return summary


def labels_of(args: argparse.Namespace) -> LabelScheme:
    """Label maps with ``--num-classes K >= 2`` or ``--class-names`` (which then must name K
    distinct classes, background first), else binary masks."""
    k, names = args.num_classes, list(args.class_names)
    if any(field == "class_names" for field, _ in name_problems(max(k, 1), names)):
        raise EvaluateError(
            f"--num-classes {k} --class-names {' '.join(names) or '(none)'}: label maps need "
            "K >= 2 and, when named, K distinct names, background first"
        )
    return label_scheme(k, names)


def run_classes(args: argparse.Namespace) -> dict[str, Any]:
    """:func:`run` for label maps: per-class figures, no HD95 or grains."""
    classes = labels_of(args).names
    rows, problems = [], []
    for pair in pair_files(args.pred, args.labels, classes):
        try:
            rows.append(evaluate_classes_pair(pair, classes))
        except VolumeError as exc:
            problems.append(str(exc))
    if problems:
        raise EvaluateError("\n".join(problems))
    summary = {
        "pred": str(args.pred),
        "labels": str(args.labels),
        **summarize_classes(rows, classes),
    }
    try:
        atomic_write_bytes(args.out.with_suffix(".csv"), classes_csv_text(rows).encode())
        atomic_write_bytes(args.out, (json.dumps(summary, indent=2) + "\n").encode())
    except OSError as exc:
        raise EvaluateError(f"--out {args.out}: cannot write ({exc.strerror or exc})") from exc
    return summary


def report_line(summary: dict[str, Any]) -> str:
    if "classes" in summary:
        per_class = ", ".join(f"{name} {v['dice']:.4f}" for name, v in summary["global"].items())
        return (
            f"{summary['count']} volume(s): mean foreground global Dice "
            f"{summary['mean_foreground']['global']['dice']:.4f}, IoU "
            f"{summary['mean_foreground']['global']['iou']:.4f}; global Dice per class: "
            f"{per_class}"
        )
    mean, glob = summary["mean"], summary["global"]
    hd = "n/a" if mean["hd95"] is None else f"{mean['hd95']:.3g}"
    unit = summary["hd95_unit"]
    return (
        f"{summary['count']} volume(s): global Dice {glob['dice']:.4f}, IoU "
        f"{glob['iou']:.4f}; mean Dice {mean['dice']:.4f}, IoU {mean['iou']:.4f}, precision "
        f"{mean['precision']:.4f}, recall {mean['recall']:.4f}, HD95 {hd} "
        f"{unit if isinstance(unit, str) else '/'.join(unit)}"
        f" ({summary['hd95_excluded']} volume(s) with HD95 = inf left out)"
        + ("" if "grains" not in summary else "\n" + grains_line(summary["grains"]))
    )


def grains_line(figures: dict[str, Any]) -> str:
    d50 = figures["d50_error"]
    return (
        f"grains: {figures['pred_grains']} predicted, {figures['true_grains']} true "
        f"({figures['truth']}); object F1 {figures['object_f1']:.4f} (precision "
        f"{figures['object_precision']:.4f}, recall {figures['object_recall']:.4f}), "
        f"{figures['merged_grains']} merged, {figures['split_grains']} split; d50 error "
        f"{'n/a' if d50 is None else f'{d50:+.3g}'} {figures['unit']}"
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
