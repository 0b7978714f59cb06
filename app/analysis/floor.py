"""The classical floor: the best intensity rule a model has to beat.

A rule is picked on the TRAINING volumes and scored on the VALIDATION volumes, both with global
Dice (TP/FP/FN summed over all voxels of the set, as ``app.metrics`` and the trainer report it):

- ``threshold``: foreground = ``image > lo``;
- ``band``: foreground = ``lo < image < hi`` (a side may be open, ``None``), which catches a
  foreground that is a middle band of intensities (grey matter between CSF and white matter);
- ``otsu``: ``image > t`` with Otsu's threshold (``skimage.filters.threshold_otsu``) of the
  pooled histogram, a reference that uses no labels.

Images are expected normalised the way the trainer normalises them (``app.data.dataset.normalize``),
since that is what the model sees; :func:`floors_from_volumes` takes the trainer's loaded volumes.

The search is O(voxels): one pass bins every training voxel into a fine uniform histogram
(``FINE_BINS`` bins, foreground and all, by arithmetic rather than a search), and cumulative sums
of it give TP and predicted positives of every cut at once. The threshold is the best of all fine
cuts; the band is the best (lo, hi) pair over ``bins`` quantile-placed cuts (plus the best
threshold, so a band is never worse than it), refined one side at a time over all fine cuts. A
rule's reported Dice is then recomputed exactly from the voxels, so ties on a cut cannot skew it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

DEFAULT_BINS = 256  # quantile-placed cuts of the band's pair search
FINE_BINS = 256 * 256  # the uniform histogram all counts are read from
OTSU_BINS = 256
CHUNK = 1 << 22  # voxels binned at a time: bounds the float64/int temporaries to ~64 MiB
REFINE_ROUNDS = 2


@dataclass(frozen=True)
class Floor:
    """One intensity rule, foreground = ``lo < image < hi`` (``None``: unbounded), with its
    global Dice on the set it was picked on and, once scored, on validation."""

    kind: str  # "threshold", "band" or "otsu"
    lo: float | None
    hi: float | None
    train_dice: float
    val_dice: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def rule(self) -> str:
        if self.lo is None and self.hi is None:
            return "every voxel"
        if self.hi is None:
            return f"image > {self.lo:.4g}"
        if self.lo is None:
            return f"image < {self.hi:.4g}"
        return f"{self.lo:.4g} < image < {self.hi:.4g}"

    def describe(self) -> str:
        val = "-" if self.val_dice is None else f"{self.val_dice:.4f}"
        return f"{self.kind:<9} {self.rule():<28} train Dice {self.train_dice:.4f}  val Dice {val}"

    def predict(self, image: np.ndarray) -> np.ndarray:
        mask = np.ones(image.shape, bool)
        if self.lo is not None:
            mask &= image > self.lo
        if self.hi is not None:
            mask &= image < self.hi
        return mask

    def score(self, images: Sequence[np.ndarray], labels: Sequence[np.ndarray]) -> Floor:
        """This rule with ``val_dice`` set to its global Dice on ``images``/``labels``."""
        return dataclasses.replace(self, val_dice=global_dice(self, *check_inputs(images, labels)))


@dataclass(frozen=True)
class Floors:
    """The three rules, each picked on train and scored on val."""

    threshold: Floor
    band: Floor
    otsu: Floor

    def to_dict(self) -> dict[str, Any]:
        return {f.kind: f.to_dict() for f in (self.threshold, self.band, self.otsu)}

    def describe(self) -> str:
        return "\n".join(f.describe() for f in (self.threshold, self.band, self.otsu))


def dice_from_counts(tp: float, fp: float, fn: float) -> float:
    """Dice, 1 when prediction and label are both empty (as ``app.metrics.dice_iou``)."""
    denom = 2 * tp + fp + fn
    return 1.0 if denom == 0 else float(2 * tp / denom)


def global_dice(rule: Floor, images: Sequence[np.ndarray], labels: Sequence[np.ndarray]) -> float:
    """Dice of ``rule`` with TP/FP/FN summed over every voxel of the (checked) set."""
    counts = np.zeros(3, np.int64)
    for image, label in zip(images, labels):
        pred = rule.predict(image)
        tp = int(np.count_nonzero(pred & label))
        counts += (tp, int(np.count_nonzero(pred)) - tp, int(np.count_nonzero(label)) - tp)
    return dice_from_counts(*counts)


def check_inputs(
    images: Sequence[np.ndarray], labels: Sequence[np.ndarray]
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Images as numeric arrays and labels as bool arrays; ValueError naming what is wrong."""
    if len(images) == 0:
        raise ValueError("floor: no images given (empty list)")
    if len(images) != len(labels):
        raise ValueError(f"floor: {len(images)} images but {len(labels)} labels")
    out_images, out_labels = [], []
    for i, (image, label) in enumerate(zip(images, labels)):
        image, label = np.asarray(image), np.asarray(label)
        if image.shape != label.shape:
            raise ValueError(
                f"floor: image {i} has shape {image.shape} but its label has {label.shape}"
            )
        if image.size == 0:
            raise ValueError(f"floor: image {i} is empty (shape {image.shape})")
        if image.dtype.kind not in "biuf":
            raise ValueError(f"floor: image {i} has non-numeric dtype {image.dtype}")
        if image.dtype.kind == "f" and not np.isfinite(image).all():
            raise ValueError(f"floor: image {i} has NaN/Inf voxels")
        if label.dtype != bool:
            # min/max first: np.unique sorts, and is only needed for the message
            if (
                label.dtype.kind not in "biuf"
                or label.min() < 0
                or label.max() > 1
                or (label.dtype.kind == "f" and not np.isin(label, (0, 1)).all())
            ):
                values = np.unique(label)
                shown = ", ".join(str(v) for v in values[:8])
                raise ValueError(
                    f"floor: label {i} is not binary (0/1 or bool); found {values.size} "
                    f"values: {shown}{', ...' if values.size > 8 else ''}"
                )
            label = label.astype(bool)
        out_images.append(image)
        out_labels.append(label)
    return out_images, out_labels


@dataclass(frozen=True)
class Histogram:
    """Voxel counts (all, foreground) in ``FINE_BINS`` uniform bins; bin ``j`` starts at
    ``cut(j)``. ``above[:, j]`` counts the voxels in bins ``>= j``: ``image > cut(j)`` up to
    voxels lying exactly on the cut. ``above[:, 0]`` is every voxel, ``above[:, FINE_BINS]`` 0."""

    low: float
    width: float
    counts: np.ndarray  # (2, FINE_BINS) int64: all voxels, foreground voxels

    def cut(self, j: int) -> float:
        return self.low + j * self.width

    @property
    def above(self) -> np.ndarray:
        total = self.counts.sum(1, keepdims=True)
        return np.concatenate([total, total - np.cumsum(self.counts, 1)], 1)


def histogram(images: Sequence[np.ndarray], labels: Sequence[np.ndarray]) -> Histogram:
    """One pass over the (checked) voxels. The range is padded by half a bin so the extreme
    values sit mid-bin: a cut between occupied bins then separates distinct values."""
    vmin = min(float(im.min()) for im in images)
    vmax = max(float(im.max()) for im in images)
    width = (vmax - vmin) / (FINE_BINS - 1) if vmax > vmin else 1.0
    low = vmin - width / 2
    counts = np.zeros(2 * FINE_BINS, np.int64)
    for image, label in zip(images, labels):
        values, fg = image.ravel(), label.ravel()
        for start in range(0, values.size, CHUNK):
            v = values[start : start + CHUNK].astype(np.float64)
            index = np.minimum(((v - low) / width).astype(np.intp), FINE_BINS - 1)
            counts += np.bincount(2 * index + fg[start : start + CHUNK], minlength=2 * FINE_BINS)
    background, foreground = counts.reshape(FINE_BINS, 2).T
    return Histogram(low, width, np.stack([background + foreground, foreground]))


def _dice(tp: np.ndarray, predicted: np.ndarray, positives: int) -> np.ndarray:
    denom = predicted + positives  # 2TP + FP + FN = predicted positives + label positives
    return np.where(denom == 0, 1.0, 2 * tp / np.maximum(denom, 1))


def _threshold_cut(hist: Histogram) -> int:
    """Fine cut j in 1..FINE_BINS-1 maximising the Dice of ``bin >= j``."""
    above = hist.above
    dice = _dice(above[1, 1:-1], above[0, 1:-1], above[1, 0])
    return 1 + int(np.argmax(dice))


def _quantile_cuts(hist: Histogram, bins: int) -> np.ndarray:
    """Up to ``bins`` fine cuts: below every occupied bin when few are occupied (discrete data:
    every separation of distinct values), else at ``bins`` quantiles of the voxel counts."""
    occupied = np.flatnonzero(hist.counts[0])
    if occupied.size <= bins + 1:
        return occupied[1:]
    cum = np.cumsum(hist.counts[0])
    targets = cum[-1] * np.arange(1, bins + 1) / (bins + 1)
    return np.unique(np.clip(np.searchsorted(cum, targets) + 1, 1, FINE_BINS - 1))


def _band_cuts(hist: Histogram, bins: int, threshold_cut: int) -> tuple[int, int]:
    """(lo, hi) fine cuts, 0 <= lo < hi <= FINE_BINS (0 and FINE_BINS: open), maximising the
    Dice of ``lo <= bin < hi``."""
    above = hist.above
    positives = above[1, 0]

    def dice(lo, hi):
        return _dice(above[1, lo] - above[1, hi], above[0, lo] - above[0, hi], positives)

    cuts = np.unique(np.concatenate([[0, threshold_cut, FINE_BINS], _quantile_cuts(hist, bins)]))
    grid = np.where(cuts[:, None] < cuts[None, :], dice(cuts[:, None], cuts[None, :]), -1.0)
    a, b = np.unravel_index(int(np.argmax(grid)), grid.shape)
    lo, hi = int(cuts[a]), int(cuts[b])
    for _ in range(REFINE_ROUNDS):  # each side over every fine cut, the other fixed
        lows = np.arange(hi)
        lo = int(lows[np.argmax(dice(lows, hi))])
        highs = np.arange(lo + 1, FINE_BINS + 1)
        hi = int(highs[np.argmax(dice(lo, highs))])
    return lo, hi


def _exact(kind: str, lo: float | None, hi: float | None, images, labels) -> Floor:
    rule = Floor(kind, lo, hi, 0.0)
    return dataclasses.replace(rule, train_dice=global_dice(rule, images, labels))


def pick_floors(
    images: Sequence[np.ndarray], labels: Sequence[np.ndarray], bins: int = DEFAULT_BINS
) -> Floors:
    """Threshold, band and Otsu rules picked on this set, from one histogram pass."""
    if bins < 2:
        raise ValueError(f"floor: bins must be at least 2, got {bins}")
    images, labels = check_inputs(images, labels)
    hist = histogram(images, labels)
    t = _threshold_cut(hist)
    lo, hi = _band_cuts(hist, bins, t)
    return Floors(
        _exact("threshold", hist.cut(t), None, images, labels),
        _exact(
            "band",
            None if lo == 0 else hist.cut(lo),
            None if hi == FINE_BINS else hist.cut(hi),
            images,
            labels,
        ),
        _exact("otsu", _otsu_threshold(hist), None, images, labels),
    )


def _otsu_threshold(hist: Histogram) -> float:
    from skimage.filters import threshold_otsu

    coarse = hist.counts[0].reshape(OTSU_BINS, -1).sum(1)
    step = hist.width * (FINE_BINS // OTSU_BINS)
    if np.count_nonzero(coarse) < 2:  # one intensity: nothing to split
        return hist.cut(FINE_BINS // 2)
    centres = hist.low + (np.arange(OTSU_BINS) + 0.5) * step
    return float(threshold_otsu(hist=(coarse, centres)))


def best_threshold(images, labels, bins: int = DEFAULT_BINS) -> Floor:
    """The ``image > t`` with the highest global Dice on this set."""
    return pick_floors(images, labels, bins).threshold


def best_band(images, labels, bins: int = DEFAULT_BINS) -> Floor:
    """The ``lo < image < hi`` (a side may be open) with the highest global Dice on this set;
    a threshold is a band open above, so it is never worse than :func:`best_threshold`."""
    return pick_floors(images, labels, bins).band


def otsu(images, labels) -> Floor:
    """``image > t`` with Otsu's threshold of the pooled histogram (labels only score it)."""
    return pick_floors(images, labels).otsu


def classical_floors(
    train_images: Sequence[np.ndarray],
    train_labels: Sequence[np.ndarray],
    val_images: Sequence[np.ndarray],
    val_labels: Sequence[np.ndarray],
    bins: int = DEFAULT_BINS,
) -> Floors:
    """Threshold, band and Otsu rules picked on train, each scored on val."""
    picked = pick_floors(train_images, train_labels, bins)
    val_images, val_labels = check_inputs(val_images, val_labels)
    return Floors(
        *(
            dataclasses.replace(f, val_dice=global_dice(f, val_images, val_labels))
            for f in (picked.threshold, picked.band, picked.otsu)
        )
    )


def floors_from_volumes(train_volumes, val_volumes, bins: int = DEFAULT_BINS) -> Floors:
    """:func:`classical_floors` of the trainer's loaded volumes (``app.data.dataset.load_split``),
    whose images are already normalised as the model sees them."""
    return classical_floors(
        [v.image for v in train_volumes],
        [v.label for v in train_volumes],
        [v.image for v in val_volumes],
        [v.label for v in val_volumes],
        bins,
    )


def class_floors_from_volumes(
    train_volumes, val_volumes, classes: Sequence[str], bins: int = DEFAULT_BINS
) -> dict[str, Floor]:
    """For ``--num-classes K >= 2`` (``classes``: the names, background first): each foreground
    class's own best band (``class c`` = ``lo < image < hi``), picked on train against every other
    class and scored on val. A multi-threshold rule (K-1 cuts of the intensity axis, one interval
    per class) gives each class one band, so per class it cannot beat this floor."""
    floors = {}
    for c, name in enumerate(classes[1:], start=1):
        floors[name] = classical_floors(
            [v.image for v in train_volumes],
            [v.label == c for v in train_volumes],
            [v.image for v in val_volumes],
            [v.label == c for v in val_volumes],
            bins,
        ).band
    return floors
