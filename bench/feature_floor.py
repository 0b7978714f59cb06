"""A learned classical floor: a pixel classifier on multi-scale filter features.

    python bench/feature_floor.py --data DIR [--normalization raw] [--leave-one-out]

The intensity band of ``app.analysis.floor`` is the floor that needs no learning. This is the next
one up, the recipe of ilastik's pixel classification: every voxel described by filters of the image
at several scales (Gaussian smoothing, gradient magnitude, Laplacian of Gaussian and the eigenvalues
of the Hessian of Gaussian; scipy.ndimage), and a gradient-boosted tree classifier
(scikit-learn's ``HistGradientBoostingClassifier``) fitted on a sample of the training voxels.
It is picked on the training volumes and scored on the validation volumes with global Dice, the
same split and metric as the trainer, so its figure stands beside the model's. It trains in a
minute on the CPU and sees no more context than its largest filter: the cheap learned reference
a deep model is measured against.

``--leave-one-out`` scores each validation volume a second time, with a classifier fitted on the
training volumes plus the other validation volumes: the Dice the same learner reaches when it has
seen data like the volume it is scored on. The gap between the two says how much of the error is
the split (validation data unlike the training data) rather than the learner. On the MNI152 task
of ``bench/real_data.py`` it is the gap between the inferior and the superior half of the brain.

A benchmark, not a test: figures hold on the data and machine that produced them.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy import ndimage

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from app.analysis.floor import dice_from_counts  # noqa: E402

SMOOTHING_SIGMAS = (0.7, 1.0, 1.6, 2.5, 3.5, 5.0)  # voxels; ilastik's scales, and 2.5
EDGE_SIGMAS = (0.7, 1.6, 3.5)  # gradient magnitude and Laplacian of Gaussian
HESSIAN_SIGMAS = (1.0, 1.6, 3.5)  # eigenvalues of the Hessian of Gaussian: sheets, tubes, blobs
SAMPLES_PER_VOLUME = 150_000  # training voxels drawn from each volume
FILTERS_IN_WORDS = (
    f"the image; Gaussian at sigma {', '.join(map(str, SMOOTHING_SIGMAS))}; gradient magnitude "
    f"and Laplacian of Gaussian at {', '.join(map(str, EDGE_SIGMAS))}; Hessian eigenvalues at "
    f"{', '.join(map(str, HESSIAN_SIGMAS))}"
)
TREES = 300
LEAVES = 63


def filter_names() -> list[str]:
    return (
        ["image"]
        + [f"gaussian {s}" for s in SMOOTHING_SIGMAS]
        + [f"{name} {s}" for s in EDGE_SIGMAS for name in ("gradient", "laplacian")]
        + [f"hessian eigenvalue {k} {s}" for s in HESSIAN_SIGMAS for k in (1, 2, 3)]
    )


def hessian_eigenvalues(image: np.ndarray, sigma: float) -> np.ndarray:
    """(*shape, 3) eigenvalues, ascending, of the Hessian of ``image`` smoothed by ``sigma``."""
    hessian = np.empty((*image.shape, 3, 3), np.float32)
    for i, j in itertools.combinations_with_replacement(range(3), 2):
        order = [0, 0, 0]
        order[i] += 1
        order[j] += 1
        second = ndimage.gaussian_filter(image, sigma, order=order, mode="reflect")
        hessian[..., i, j] = hessian[..., j, i] = second
    return np.linalg.eigvalsh(hessian)


def filter_features(image: np.ndarray) -> np.ndarray:
    """(voxels, features) float32: the image and its filters at every scale, voxel by voxel.
    Borders are reflected, as a slab cut from a larger volume continues past its edge."""
    image = np.asarray(image, np.float32)
    columns = [image]
    columns += [ndimage.gaussian_filter(image, s, mode="reflect") for s in SMOOTHING_SIGMAS]
    for s in EDGE_SIGMAS:
        columns.append(ndimage.gaussian_gradient_magnitude(image, s, mode="reflect"))
        columns.append(ndimage.gaussian_laplace(image, s, mode="reflect"))
    for s in HESSIAN_SIGMAS:
        columns += list(np.moveaxis(hessian_eigenvalues(image, s), -1, 0))
    return np.stack([c.reshape(-1) for c in columns], axis=1)


@dataclass
class Scored:
    name: str
    tp: int
    fp: int
    fn: int

    @property
    def dice(self) -> float:
        return dice_from_counts(self.tp, self.fp, self.fn)


def check_pairs(images: Sequence[np.ndarray], labels: Sequence[np.ndarray], what: str) -> None:
    if len(images) == 0:
        raise ValueError(f"feature floor: no {what} volumes")
    if len(images) != len(labels):
        raise ValueError(f"feature floor: {len(images)} {what} images but {len(labels)} labels")
    for i, (image, label) in enumerate(zip(images, labels)):
        if np.shape(image) != np.shape(label):
            raise ValueError(
                f"feature floor: {what} volume {i}: image {np.shape(image)} and label "
                f"{np.shape(label)} differ in shape"
            )


def fit(
    features: Sequence[np.ndarray],
    labels: Sequence[np.ndarray],
    samples_per_volume: int = SAMPLES_PER_VOLUME,
    seed: int = 0,
):
    """A classifier fitted on up to ``samples_per_volume`` voxels drawn from each volume
    (``features`` from :func:`filter_features`); every volume weighs the same."""
    from sklearn.ensemble import HistGradientBoostingClassifier

    rng = np.random.default_rng(seed)
    xs, ys = [], []
    for feats, label in zip(features, labels):
        label = np.asarray(label).reshape(-1) > 0
        take = rng.choice(label.size, min(label.size, samples_per_volume), replace=False)
        xs.append(feats[take])
        ys.append(label[take])
    y = np.concatenate(ys)
    if y.all() or not y.any():
        raise ValueError("feature floor: the training labels hold one class only")
    classifier = HistGradientBoostingClassifier(
        max_iter=TREES, max_leaf_nodes=LEAVES, random_state=seed
    )
    return classifier.fit(np.concatenate(xs), y)


def score(classifier, features: np.ndarray, label: np.ndarray, name: str) -> Scored:
    predicted = classifier.predict(features).astype(bool)
    truth = np.asarray(label).reshape(-1) > 0
    tp = int(np.count_nonzero(predicted & truth))
    return Scored(name, tp, int(np.count_nonzero(predicted)) - tp, int(truth.sum()) - tp)


def global_dice(scored: Sequence[Scored]) -> float:
    return dice_from_counts(*(sum(getattr(s, k) for s in scored) for k in ("tp", "fp", "fn")))


@dataclass
class FeatureFloor:
    train: list[Scored]
    val: list[Scored]
    leave_one_out: list[Scored] | None = None

    @property
    def val_dice(self) -> float:
        return global_dice(self.val)


def feature_floor(
    train_images: Sequence[np.ndarray],
    train_labels: Sequence[np.ndarray],
    val_images: Sequence[np.ndarray],
    val_labels: Sequence[np.ndarray],
    names: tuple[Sequence[str], Sequence[str]] | None = None,
    leave_one_out: bool = False,
    samples_per_volume: int = SAMPLES_PER_VOLUME,
    seed: int = 0,
) -> FeatureFloor:
    """Fit on train, score train and val; with ``leave_one_out``, score each val volume again
    with a classifier fitted on train plus the other val volumes."""
    check_pairs(train_images, train_labels, "training")
    check_pairs(val_images, val_labels, "validation")
    train_names, val_names = names or (
        [f"train {i}" for i in range(len(train_images))],
        [f"val {i}" for i in range(len(val_images))],
    )
    train_feats = [filter_features(im) for im in train_images]
    val_feats = [filter_features(im) for im in val_images]
    classifier = fit(train_feats, train_labels, samples_per_volume, seed)
    result = FeatureFloor(
        train=[score(classifier, *z) for z in zip(train_feats, train_labels, train_names)],
        val=[score(classifier, *z) for z in zip(val_feats, val_labels, val_names)],
    )
    if leave_one_out:
        result.leave_one_out = []
        for k in range(len(val_feats)):
            others = [i for i in range(len(val_feats)) if i != k]
            held_in = fit(
                train_feats + [val_feats[i] for i in others],
                list(train_labels) + [val_labels[i] for i in others],
                samples_per_volume,
                seed,
            )
            result.leave_one_out.append(score(held_in, val_feats[k], val_labels[k], val_names[k]))
    return result


def data_root_floor(root: Path | str, normalization: str = "raw", **options) -> FeatureFloor:
    """:func:`feature_floor` of a data root in the trainer's layout, its images normalised as
    ``normalization`` (``app.data.dataset.load_train_val``); ``options`` go to
    :func:`feature_floor`."""
    from app.data.dataset import load_train_val

    train, val, _ = load_train_val(root, normalization)
    return feature_floor(
        [v.image for v in train],
        [v.label for v in train],
        [v.image for v in val],
        [v.label for v in val],
        names=([v.name for v in train], [v.name for v in val]),
        **options,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    parser.add_argument("--data", type=Path, required=True, help="data root (the trainer's)")
    parser.add_argument(
        "--normalization",
        default="raw",
        choices=("raw", "dataset", "percentile", "zscore"),
        help="the images as the trainer would normalise them (default raw: the files' own)",
    )
    parser.add_argument("--leave-one-out", action="store_true", help="see above")
    parser.add_argument("--samples-per-volume", type=int, default=SAMPLES_PER_VOLUME)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    from app.data.dataset import DataError
    from app.data.volume_io import VolumeError

    started = time.perf_counter()
    try:
        found = data_root_floor(
            args.data,
            args.normalization,
            leave_one_out=args.leave_one_out,
            samples_per_volume=args.samples_per_volume,
            seed=args.seed,
        )
    except (DataError, VolumeError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(
        f"feature floor: {len(filter_names())} filters ({FILTERS_IN_WORDS}), gradient-boosted "
        f"trees ({TREES} x {LEAVES} leaves) on {args.samples_per_volume} voxels per training "
        f"volume; {args.normalization} images; {time.perf_counter() - started:.1f} s"
    )
    held_in = {s.name: s for s in found.leave_one_out or []}
    print(f"  {'volume':<32} {'Dice':>7}" + (f" {'held-in':>8}" if held_in else ""))
    for split, rows in (("train", found.train), ("val", found.val)):
        for s in rows:
            extra = f" {held_in[s.name].dice:8.4f}" if s.name in held_in else ""
            print(f"  {split + ' ' + s.name:<32} {s.dice:7.4f}{extra}")
    print(f"  train global Dice {global_dice(found.train):.4f}")
    print(f"  val   global Dice {found.val_dice:.4f}  <- the feature floor")
    if found.leave_one_out:
        print(
            f"  val   global Dice {global_dice(found.leave_one_out):.4f} with each val volume's "
            "neighbours in training (--leave-one-out)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
