"""The learned floor: a pixel classifier on multi-scale filter features, fitted on a data root's
training split and scored on its validation split.

    python -m app.learned_floor --data-root DIR [--normalization MODE] [--leave-one-out] [--run R]

The band of :mod:`app.analysis.floor` (logged by the trainer as ``floor_dice``) needs no
learning. This is the next floor up, ilastik's pixel classification: each voxel described by 22
filters of the image at several scales (Gaussians, gradient magnitude, Laplacian of Gaussian,
Hessian eigenvalues; scipy.ndimage), and scikit-learn's ``HistGradientBoostingClassifier`` fitted
on a sample of the training voxels. The data are loaded as the trainer loads them (the same
split and normalisation) and scored with global Dice, so the figure stands beside the model's.

With ``--run RUN_DIR`` the data root, normalisation and seed default to the run's
``config.yaml``, and the result goes to ``RUN_DIR/learned_floor.json`` (written atomically),
where ``python -m app.report`` finds it and draws it beside the val Dice curve. The trainer does
not fit it: it costs minutes on large data.

``--leave-one-out`` scores each validation volume a second time, with a classifier fitted on the
training volumes plus the other validation volumes: the Dice the same learner reaches when it has
seen data like the volume it is scored on. The gap between the two says how much of the error is
the split (validation data unlike the training data) rather than the learner.

Cost: one volume's features are held at a time (88 bytes a voxel), besides the loaded volumes
and the samples; a training volume's are computed twice (to sample, then to score). The time and
the peak resident memory (``ru_maxrss`` of the process) are printed and saved.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from app.analysis.cli import LEARNED_FLOOR_JSON, HelpFormatter, RunDirError, run_config
from app.analysis.filter_features import FILTERS_IN_WORDS, filter_features, filter_names
from app.analysis.floor import dice_from_counts
from app.atomic import atomic_write_bytes, os_cause, probe_writable
from app.labels import label_scheme

SAMPLES_PER_VOLUME = 150_000  # training voxels drawn from each volume
TREES = 300  # at most: scikit-learn stops early on a held-out tenth past 10,000 samples
LEAVES = 63
NORMALIZATIONS = ("raw", "zscore", "percentile", "dataset")
MEMORY_SOURCE = "ru_maxrss: peak resident memory of the whole process"


class LearnedFloorError(ValueError):
    """The inputs cannot give a learned floor; the message names the flag or file."""


# ----------------------------------------------------------------------------- fit and score
@dataclass
class Scored:
    name: str
    tp: int
    fp: int
    fn: int

    @property
    def dice(self) -> float:
        return dice_from_counts(self.tp, self.fp, self.fn)


def global_dice(scored: Sequence[Scored]) -> float:
    return dice_from_counts(*(sum(getattr(s, k) for s in scored) for k in ("tp", "fp", "fn")))


def check_pairs(images: Sequence[np.ndarray], labels: Sequence[np.ndarray], what: str) -> None:
    if len(images) == 0:
        raise LearnedFloorError(f"learned floor: no {what} volumes")
    if len(images) != len(labels):
        raise LearnedFloorError(
            f"learned floor: {len(images)} {what} images but {len(labels)} labels"
        )
    for i, (image, label) in enumerate(zip(images, labels)):
        if np.shape(image) != np.shape(label):
            raise LearnedFloorError(
                f"learned floor: {what} volume {i}: image {np.shape(image)} and label "
                f"{np.shape(label)} differ in shape"
            )


def draw(features: np.ndarray, label: np.ndarray, n: int, rng: np.random.Generator):
    """Up to ``n`` voxels of one volume, drawn without replacement: (features, truth)."""
    truth = np.asarray(label).reshape(-1) > 0
    take = rng.choice(truth.size, min(truth.size, n), replace=False)
    return features[take], truth[take]


def fit(samples: Sequence[tuple[np.ndarray, np.ndarray]], seed: int):
    """A classifier fitted on the pooled (features, truth) samples of :func:`draw`."""
    from sklearn.ensemble import HistGradientBoostingClassifier

    y = np.concatenate([s[1] for s in samples])
    if y.all() or not y.any():
        raise LearnedFloorError("learned floor: the training labels hold one class only")
    classifier = HistGradientBoostingClassifier(
        max_iter=TREES, max_leaf_nodes=LEAVES, random_state=seed
    )
    return classifier.fit(np.concatenate([s[0] for s in samples]), y)


def score(classifier, features: np.ndarray, label: np.ndarray, name: str) -> Scored:
    predicted = classifier.predict(features).astype(bool)
    truth = np.asarray(label).reshape(-1) > 0
    tp = int(np.count_nonzero(predicted & truth))
    return Scored(name, tp, int(np.count_nonzero(predicted)) - tp, int(truth.sum()) - tp)


@dataclass
class LearnedFloor:
    train: list[Scored]
    val: list[Scored]
    leave_one_out: list[Scored] | None
    voxels_sampled: int  # training voxels the (first) classifier was fitted on
    trees: int  # fitted (early stopping may stop short of TREES)
    seconds: dict[str, float]

    @property
    def val_dice(self) -> float:
        return global_dice(self.val)

    @property
    def train_dice(self) -> float:
        return global_dice(self.train)

    @property
    def leave_one_out_dice(self) -> float | None:
        return None if self.leave_one_out is None else global_dice(self.leave_one_out)


def learned_floor(
    train_images: Sequence[np.ndarray],
    train_labels: Sequence[np.ndarray],
    val_images: Sequence[np.ndarray],
    val_labels: Sequence[np.ndarray],
    names: tuple[Sequence[str], Sequence[str]] | None = None,
    leave_one_out: bool = False,
    samples_per_volume: int = SAMPLES_PER_VOLUME,
    seed: int = 0,
) -> LearnedFloor:
    """Fit on train, score train and val; with ``leave_one_out``, score each val volume again
    with a classifier fitted on train plus the other val volumes. One volume's features are
    held at a time (recomputed to score), besides the samples."""
    check_pairs(train_images, train_labels, "training")
    check_pairs(val_images, val_labels, "validation")
    if samples_per_volume < 1:
        raise LearnedFloorError(f"--samples-per-volume must be at least 1: {samples_per_volume}")
    train_names, val_names = names or (
        [f"train {i}" for i in range(len(train_images))],
        [f"val {i}" for i in range(len(val_images))],
    )
    seconds, rng = {"filters": 0.0, "fit": 0.0, "predict": 0.0}, np.random.default_rng(seed)

    @contextmanager
    def stage(name: str) -> Iterator[None]:  # seconds per stage, summed over volumes
        started = time.perf_counter()
        yield
        seconds[name] += time.perf_counter() - started

    def features(image: np.ndarray) -> np.ndarray:
        with stage("filters"):
            return filter_features(image)

    train_samples = [
        draw(features(im), lab, samples_per_volume, rng)
        for im, lab in zip(train_images, train_labels)
    ]
    with stage("fit"):
        classifier = fit(train_samples, seed)

    def scored(model, image, label, name) -> Scored:
        feats = features(image)
        with stage("predict"):
            return score(model, feats, label, name)

    train = [scored(classifier, *z) for z in zip(train_images, train_labels, train_names)]
    val, val_samples = [], []
    for image, label, name in zip(val_images, val_labels, val_names):
        feats = features(image)
        with stage("predict"):
            val.append(score(classifier, feats, label, name))
        if leave_one_out:
            val_samples.append(draw(feats, label, samples_per_volume, rng))
        del feats
    held_in = None
    if leave_one_out:
        held_in = []
        for k, (image, label, name) in enumerate(zip(val_images, val_labels, val_names)):
            others = [s for i, s in enumerate(val_samples) if i != k]
            with stage("fit"):
                model = fit(train_samples + others, seed)
            held_in.append(scored(model, image, label, name))
    return LearnedFloor(
        train,
        val,
        held_in,
        voxels_sampled=sum(len(s[1]) for s in train_samples),
        trees=int(classifier.n_iter_),
        seconds=seconds,
    )


# ----------------------------------------------------------------------------- a data root
@dataclass
class Settings:
    data_root: Path
    normalization: str
    seed: int
    leave_one_out: bool
    samples_per_volume: int
    run_dir: Path | None


@dataclass
class DataSize:
    train_volumes: int
    val_volumes: int
    train_voxels: int
    val_voxels: int
    largest_volume: tuple[int, ...]


def data_root_floor(
    root: Path | str, normalization: str = "raw", seed: int = 0, **options
) -> tuple[LearnedFloor, DataSize]:
    """:func:`learned_floor` of a data root in the trainer's layout, loaded as the trainer
    loads it (``app.data.dataset.load_train_val``, binary labels), its images normalised as
    ``normalization``; ``options`` go to :func:`learned_floor`."""
    from app.data.dataset import DataError, load_train_val

    started = time.perf_counter()
    try:
        train, val, _ = load_train_val(root, normalization, seed)
    except DataError as exc:
        if "labels must be binary" not in str(exc):
            raise
        raise DataError(
            f"{exc}\nthe learned floor is of binary masks: multi-class (--num-classes K) data "
            "sets are not supported"
        ) from exc
    loaded_s = time.perf_counter() - started
    found = learned_floor(
        [v.image for v in train],
        [v.label for v in train],
        [v.image for v in val],
        [v.label for v in val],
        names=([v.name for v in train], [v.name for v in val]),
        seed=seed,
        **options,
    )
    found.seconds = {"load": loaded_s, **found.seconds}
    size = DataSize(
        len(train),
        len(val),
        sum(v.image.size for v in train),
        sum(v.image.size for v in val),
        max((v.image.shape for v in train + val), key=np.prod),
    )
    return found, size


def peak_rss_mib() -> float:
    """Peak resident memory of this process so far, MiB (Linux reports ru_maxrss in KiB)."""
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib / (1 << 20 if sys.platform == "darwin" else 1 << 10)


def result_record(
    found: LearnedFloor, size: DataSize, settings: Settings, wall_s: float
) -> dict[str, Any]:
    """What ``learned_floor.json`` holds."""
    per_volume = {
        split: [{"name": s.name, "dice": s.dice} for s in rows]
        for split, rows in (
            ("train", found.train),
            ("val", found.val),
            ("leave_one_out", found.leave_one_out or []),
        )
    }
    return {
        "val_dice": found.val_dice,
        "train_dice": found.train_dice,
        "leave_one_out_dice": found.leave_one_out_dice,
        "volumes": per_volume,
        "fit_s": found.seconds.get("fit", 0.0),
        "seconds": {**found.seconds, "total": wall_s},
        "peak_memory_mib": peak_rss_mib(),
        "peak_memory_source": MEMORY_SOURCE,
        "voxels_sampled": found.voxels_sampled,
        "trees": found.trees,
        "data": {**asdict(size), "largest_volume": list(size.largest_volume)},
        "features": filter_names(),
        "classifier": f"HistGradientBoostingClassifier, up to {TREES} trees of {LEAVES} leaves",
        "settings": {
            **{k: v for k, v in asdict(settings).items() if k != "run_dir"},
            "data_root": str(settings.data_root),
        },
    }


def save_record(run_dir: Path, record: dict[str, Any]) -> Path:
    """``record`` as ``RUN_DIR/learned_floor.json``, written atomically; its path."""
    path = run_dir / LEARNED_FLOOR_JSON
    atomic_write_bytes(path, (json.dumps(record, indent=2) + "\n").encode())
    return path


def fit_and_record(
    settings: Settings,
) -> tuple[LearnedFloor, DataSize, dict[str, Any], Path | None]:
    """:func:`data_root_floor` as ``settings`` ask; its ``learned_floor.json`` record, written
    into ``settings.run_dir`` when one is set (the path, else None)."""
    started = time.perf_counter()
    found, size = data_root_floor(
        settings.data_root,
        settings.normalization,
        settings.seed,
        leave_one_out=settings.leave_one_out,
        samples_per_volume=settings.samples_per_volume,
    )
    record = result_record(found, size, settings, time.perf_counter() - started)
    path = None if settings.run_dir is None else save_record(settings.run_dir, record)
    return found, size, record, path


# ----------------------------------------------------------------------------- the command
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m app.learned_floor",
        description=__doc__.split("\n\n")[0] + "\n(ilastik's recipe: see docs/results.md).",
        epilog="With --run RUN_DIR: RUN_DIR/learned_floor.json, drawn by python -m app.report.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument(
        "--data-root",
        metavar="DIR",
        type=Path,
        help="data root in the trainer's layout (default: data_root of RUN_DIR/config.yaml)",
    )
    parser.add_argument(
        "--normalization",
        choices=NORMALIZATIONS,
        help="the images as the trainer normalises them (default: the run's, else the "
        "trainer's default); raw: the files' own intensities",
    )
    parser.add_argument(
        "--run",
        metavar="RUN_DIR",
        type=Path,
        help="a run directory of app.train: its settings are the defaults, and "
        f"{LEARNED_FLOOR_JSON} is written there",
    )
    parser.add_argument(
        "--leave-one-out", action="store_true", help="also score each val volume held in"
    )
    parser.add_argument(
        "--samples-per-volume",
        metavar="N",
        type=int,
        default=SAMPLES_PER_VOLUME,
        help="training voxels drawn from each volume",
    )
    parser.add_argument(
        "--seed", type=int, help="seed of the samples and the trees (default: the run's, else 0)"
    )
    return parser


def resolve(args: argparse.Namespace) -> Settings:
    """The settings: flags, else the run's config.yaml, else the trainer's defaults. Checks the
    run directory (it exists, can be written, is of binary labels) before anything is fitted."""
    config: dict[str, Any] = {}
    if args.run is not None:
        if not args.run.is_dir():
            raise LearnedFloorError(f"--run {args.run}: no such run directory")
        config = run_config(args.run)
        classes = config.get("num_classes", 1)
        if label_scheme(int(classes)).choose(binary=False, classes=True):
            raise LearnedFloorError(
                f"{args.run / 'config.yaml'}: num_classes {classes}; the learned floor is of "
                "binary masks, multi-class runs are not supported"
            )
        try:
            probe_writable(args.run)
        except OSError as exc:
            raise LearnedFloorError(
                f"--run {args.run}: cannot write {LEARNED_FLOOR_JSON} there: {os_cause(exc)}"
            ) from exc
    root = args.data_root or config.get("data_root")
    if root is None:
        raise LearnedFloorError("--data-root DIR is needed (or --run RUN_DIR with a config.yaml)")
    normalization = args.normalization or config.get("normalization")
    if normalization is None:
        from app.config import Config

        normalization = Config().normalization
    if normalization not in NORMALIZATIONS:
        raise LearnedFloorError(
            f"{args.run / 'config.yaml'}: normalization {normalization!r} is not one of "
            f"{', '.join(NORMALIZATIONS)}; pass --normalization"
        )
    seed = args.seed if args.seed is not None else config.get("seed", 0)
    return Settings(
        Path(root), normalization, int(seed), args.leave_one_out, args.samples_per_volume, args.run
    )


def print_result(found: LearnedFloor, size: DataSize, record: dict[str, Any]) -> None:
    settings = record["settings"]
    print(
        f"learned floor: {len(record['features'])} filters ({FILTERS_IN_WORDS}), gradient-boosted "
        f"trees ({found.trees} of up to {TREES}, {LEAVES} leaves) on {found.voxels_sampled} "
        f"training voxels; {settings['normalization']} images"
    )
    held_in = {s.name: s for s in found.leave_one_out or []}
    print(f"  {'volume':<32} {'Dice':>7}" + (f" {'held-in':>8}" if held_in else ""))
    for split, rows in (("train", found.train), ("val", found.val)):
        for s in rows:
            extra = f" {held_in[s.name].dice:8.4f}" if s.name in held_in else ""
            print(f"  {split + ' ' + s.name:<32} {s.dice:7.4f}{extra}")
    print(f"  train global Dice {found.train_dice:.4f}")
    print(f"  val   global Dice {found.val_dice:.4f}  <- the learned floor")
    if found.leave_one_out_dice is not None:
        print(
            f"  val   global Dice {found.leave_one_out_dice:.4f} with each val volume's "
            "neighbours in training (--leave-one-out)"
        )
    seconds = record["seconds"]
    stages = ", ".join(f"{k} {v:.1f} s" for k, v in seconds.items() if k != "total")
    print(
        f"cost: {seconds['total']:.1f} s ({stages}); peak memory {record['peak_memory_mib']:.0f} "
        f"MiB ({MEMORY_SOURCE}); {size.train_voxels + size.val_voxels} voxels in "
        f"{size.train_volumes} + {size.val_volumes} volumes, largest "
        f"{'x'.join(map(str, size.largest_volume))}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from app.data.dataset import DataError
    from app.data.volume_io import VolumeError

    try:
        found, size, record, path = fit_and_record(resolve(args))
    except (LearnedFloorError, RunDirError, DataError, VolumeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"error: {exc.filename or ''}: {os_cause(exc)}", file=sys.stderr)
        return 2
    print_result(found, size, record)
    if path is not None:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
