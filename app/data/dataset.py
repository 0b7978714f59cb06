"""IronGrain volumes: pairing, validation, normalisation and patch sampling (augmentation:
``app.data.augment``).

Layout: ``ROOT/{train,val}_patches/{images,labels}/NAME.ext``; a label shares its image's NAME.
Every file is checked when the split is loaded, and all problems are reported at once, each line
naming its file, before any training starts.

Policies:

- Labels: ``{0, 1}``, ``{0, 255}`` or bool; stored as uint8 ``{0, 1}``. With ``--num-classes K
  >= 2``, integer class maps ``0..K-1`` (0 = background), stored as uint8; a value outside
  ``0..K-1`` or a fractional float value is refused, a float map of whole numbers is read with a
  warning, and a foreground class absent from a whole split is warned about
  (``app.labels``: the label scheme reads and checks every label).
- Normalisation (:class:`Normalization`): per volume (z-score, or clipping to the 0.5-99.5
  percentiles scaled to [0, 1]), or one clip and z-score fitted on the training set (``dataset``).
- A volume smaller than the training patch is padded, centred, to the patch size: the image with
  its own minimum (CT background is dark) and the label with 0. Validation and prediction pad the
  same way and crop the result back, so padded voxels never count in a metric.
- Validation is deterministic: every val volume is evaluated whole (see ``app.engine.inference``).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import albumentations as A
import numpy as np
import torch
from torch.utils.data import Dataset

from app.atomic import os_cause
from app.data.augment import Augment
from app.data.geometry import Geometry, mismatches, spacing_spread
from app.data.volume_io import EXTENSIONS, VolumeError, is_volume_file, read_volume, split_ext
from app.labels import FOREGROUND_SAMPLES, label_scheme

log = logging.getLogger(__name__)
SPLITS = {"train": "train_patches", "val": "val_patches"}


class DataError(ValueError):
    """The dataset is unusable; each line of the message names a file or folder."""


@dataclass
class Volume:
    name: str
    image: np.ndarray  # float32, normalised
    label: np.ndarray  # uint8 {0, 1}
    image_path: Path
    foreground: np.ndarray = field(repr=False)  # flat indices of sampled foreground voxels
    # K >= 2: flat indices of sampled voxels of each foreground class 1..K-1 (empty: binary)
    class_voxels: list[np.ndarray] = field(default_factory=list, repr=False)
    grid: Geometry = field(default_factory=Geometry, repr=False)  # the image's, as read

    def foreground_centre(self, rng: np.random.Generator) -> tuple[int, ...]:
        """A sampled foreground voxel; K >= 2: of a class picked uniformly among those present,
        so that a rare phase is centred as often as a common one."""
        present = [v for v in self.class_voxels if v.size]
        voxels = present[int(rng.integers(len(present)))] if present else self.foreground
        return np.unravel_index(int(rng.choice(voxels)), self.image.shape)

    # what PatchDataset reads, shared with app.data.lazy.LazyVolume (patches read from disk)
    @property
    def shape(self) -> tuple[int, ...]:
        return self.image.shape

    @property
    def has_foreground(self) -> bool:
        return self.foreground.size > 0

    def patch(self, window: tuple[slice, ...]) -> tuple[np.ndarray, np.ndarray]:
        return self.image[window], self.label[window]

    def sampled(self) -> Volume:
        return self

    def in_memory(self) -> Volume:
        return self


def check_finite(array: np.ndarray, path: Path) -> None:
    if array.dtype.kind == "f":
        bad = int(np.count_nonzero(~np.isfinite(array)))
        if bad:
            raise VolumeError(f"{path}: {bad} NaN/Inf voxel(s); clean the volume first")


def normalize(image: np.ndarray, mode: str) -> np.ndarray:
    """Per-volume normalisation (``zscore`` or ``percentile``); see :class:`Normalization`."""
    return Normalization(mode)(image)


def intensity_sample(images: list[np.ndarray], per_volume: int = 1_000_000) -> np.ndarray:
    """About ``per_volume`` evenly strided voxels of each image, pooled: enough for percentiles
    and moments of large sets."""
    return np.concatenate([im.ravel()[:: max(1, im.size // per_volume)] for im in images])


@dataclass(frozen=True)
class Normalization:
    """How intensities are scaled before the network sees them.

    ``zscore`` and ``percentile`` use each volume's own statistics. ``dataset`` (nnU-Net's CT
    scheme) clips every volume to the 0.5-99.5 percentiles of the training set and z-scores it
    with the training set's mean and std of the clipped values: one scale for all volumes, so an
    intensity means the same tissue everywhere. Per-volume z-scores break that when volumes hold
    different fractions of each tissue (MNI152 slabs: 6-77% brain), and a network then has to
    learn each volume's shift. The fitted statistics travel in the checkpoint (``to_dict``).
    ``raw`` (internal) leaves intensities as read.
    """

    mode: str
    low: float | None = None
    high: float | None = None
    mean: float | None = None
    std: float | None = None

    PER_VOLUME = ("zscore", "percentile")

    def __post_init__(self) -> None:
        if self.mode not in (*self.PER_VOLUME, "dataset", "raw"):
            raise ValueError(f"unknown normalisation {self.mode!r}")
        if self.mode == "dataset" and None in (self.low, self.high, self.mean, self.std):
            raise ValueError("dataset normalisation needs statistics fitted on the training set")

    @classmethod
    def fit(cls, mode: str, images: list[np.ndarray]) -> Normalization:
        """``mode`` ready to apply; ``dataset`` takes its statistics from ``images``."""
        if mode != "dataset":
            return cls(mode)
        if not images:
            raise DataError("dataset normalisation needs training volumes to fit its statistics")
        sample = intensity_sample(images).astype(np.float64)
        low, high = np.percentile(sample, (0.5, 99.5))
        clipped = np.clip(sample, low, high)
        return cls(mode, float(low), float(high), float(clipped.mean()), float(clipped.std()))

    def __call__(self, image: np.ndarray) -> np.ndarray:
        image = image.astype(np.float32, copy=False)
        if self.mode == "raw":
            return image
        if self.mode == "zscore":
            mean, std = float(image.mean(dtype=np.float64)), float(image.std(dtype=np.float64))
            return ((image - mean) / max(std, 1e-8)).astype(np.float32)
        if self.mode == "percentile":
            low, high = np.percentile(image, (0.5, 99.5))
            return ((np.clip(image, low, high) - low) / max(high - low, 1e-8)).astype(np.float32)
        clipped = np.clip(image, self.low, self.high)
        return ((clipped - self.mean) / max(self.std, 1e-8)).astype(np.float32)

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def saved_in(cls, state: dict[str, Any] | None) -> Normalization | None:
        """A checkpoint's normalisation (``None`` for checkpoints written before it was kept)."""
        saved = (state or {}).get("normalization")
        return cls(**saved) if saved else None

    def describe(self) -> str:
        if self.mode != "dataset":
            return f"{self.mode} normalisation"
        return (
            f"dataset normalisation (clip {self.low:.4g}..{self.high:.4g}, "
            f"mean {self.mean:.4g}, std {self.std:.4g})"
        )


def pair_files(split_dir: Path) -> list[tuple[str, Path, Path]]:
    """(name, image, label) for each image, checking the folders and the one-to-one pairing."""
    images_dir, labels_dir = split_dir / "images", split_dir / "labels"
    for folder in (images_dir, labels_dir):
        if not folder.is_dir():
            raise DataError(
                f"{folder}: folder is missing (expected layout ROOT/{split_dir.name}/"
                "{images,labels}/NAME.ext)"
            )

    def index(folder: Path) -> dict[str, Path]:
        found: dict[str, Path] = {}
        try:
            paths = sorted(folder.iterdir())
        except OSError as exc:
            raise DataError(f"{folder}: cannot list this folder: {os_cause(exc)}") from exc
        for path in paths:
            if not is_volume_file(path):
                continue
            name = split_ext(path)[0]
            if name in found:
                raise DataError(f"{path}: same name as {found[name]}; names must be unique")
            found[name] = path
        if not found:
            raise DataError(f"{folder}: no volumes ({', '.join(EXTENSIONS)}) in this folder")
        return found

    images, labels = index(images_dir), index(labels_dir)
    problems = [
        f"{images[n]}: no label named {n}.* in {labels_dir}" for n in images if n not in labels
    ]
    problems += [
        f"{labels[n]}: label without an image named {n}.* in {images_dir}"
        for n in labels
        if n not in images
    ]
    if problems:
        raise DataError("\n".join(problems))
    return [(name, images[name], labels[name]) for name in images]


def load_volume_pair(
    name: str,
    image_path: Path,
    label_path: Path,
    normalization: Normalization | str,
    rng: np.random.Generator,
    num_classes: int = 1,
) -> Volume:
    if isinstance(normalization, str):
        normalization = Normalization(normalization)
    image, image_meta = read_volume(image_path)
    check_finite(image, image_path)
    label, label_meta = read_volume(label_path)
    check_finite(label, label_path)
    check_same_grid(
        image_path, image.shape, image_meta.grid, label_path, label.shape, label_meta.grid
    )
    label, foreground, voxels = label_scheme(num_classes).read_label(label, label_path, rng)
    return Volume(
        name, normalization(image), label, image_path, foreground, voxels, grid=image_meta.grid
    )


def check_same_grid(
    image_path: Path,
    image_shape: tuple[int, ...],
    image_grid: Geometry,
    label_path: Path,
    label_shape: tuple[int, ...],
    label_grid: Geometry,
) -> None:
    """An image and its label lie on the same voxel grid: shape, and the spacing, origin and
    orientation both files state (``app.data.geometry``'s tolerances), or a VolumeError naming both
    files and every difference."""
    found = [] if image_shape == label_shape else [f"shape {image_shape} vs {label_shape}"]
    found += mismatches(image_grid, label_grid)
    if found:
        raise VolumeError(
            f"{image_path}: its label {label_path} lies on another grid: " + "; ".join(found)
        )


def warn_spacing_spread(volumes: list[Volume], split_dir: Path) -> None:
    spread = spacing_spread([vol.grid for vol in volumes])
    if spread is not None:
        low, high, unit = spread
        log.warning(
            "%s: voxel sizes range from %.4g to %.4g %s (cube-equivalent side): the network sees "
            "the same structure at scales %.1fx apart; resample the volumes to one spacing",
            split_dir,
            low,
            high,
            unit,
            high / low,
        )


def load_split(
    root: Path | str,
    split: str,
    normalization: Normalization | str,
    seed: int = 0,
    num_classes: int = 1,
) -> list[Volume]:
    """Load and check every pair of a split; all problems are raised together."""
    root = Path(root)
    if not root.is_dir():
        raise DataError(f"{root}: data root is missing (--data-root); see datasets/README.md")
    if isinstance(normalization, str):
        normalization = Normalization(normalization)
    pairs = pair_files(root / SPLITS[split])
    rng = np.random.default_rng(seed)
    volumes, problems = [], []
    for name, image_path, label_path in pairs:
        try:
            volumes.append(
                load_volume_pair(name, image_path, label_path, normalization, rng, num_classes)
            )
        except VolumeError as exc:
            problems.append(str(exc))
    if problems:
        raise DataError("\n".join(problems))
    scheme = label_scheme(num_classes)
    scheme.check_split([vol.label for vol in volumes], root / SPLITS[split] / "labels")
    if split == "train":
        warn_spacing_spread(volumes, root / SPLITS[split])
    return volumes


def load_train_val(
    root: Path | str,
    mode: str,
    seed: int = 0,
    fitted: Normalization | None = None,
    with_train: bool = True,
    num_classes: int = 1,
) -> tuple[list[Volume], list[Volume], Normalization]:
    """Both splits, normalised alike: ``fitted`` (a resumed run's) or fitted here on train."""
    train = load_split(root, "train", "raw", seed, num_classes) if with_train else []
    if fitted is None:
        if mode == "dataset" and not with_train:
            raise DataError(f"{root}: dataset normalisation needs the training split to fit it")
        fitted = Normalization.fit(mode, [vol.image for vol in train])
    for vol in train:
        vol.image = fitted(vol.image)
    return train, load_split(root, "val", fitted, seed, num_classes), fitted


class PatchDataset(Dataset):
    """``samples_per_volume`` random patches per volume per epoch.

    Each sample's randomness comes from (seed, epoch, index) alone, so a run is reproducible
    whatever the number of workers or processes, and a resumed run draws what the uninterrupted
    one would have drawn. Call :meth:`set_epoch` before iterating (workers are not persistent,
    so they see it).
    """

    def __init__(
        self,
        volumes: list[Volume],
        patch_size: tuple[int, int, int],
        samples_per_volume: int,
        foreground_fraction: float,
        augment: bool,
        seed: int,
        augment_level: str = "basic",
    ):
        self.patch_size = tuple(patch_size)
        self.volumes = []
        for vol in volumes:
            if any(a < p for a, p in zip(vol.shape, self.patch_size)):
                vol = vol.in_memory()  # small: padded once, here
                pad = A.PadIfNeeded3D(
                    min_zyx=self.patch_size,
                    position="center",
                    fill=float(vol.image.min()),
                    fill_mask=0,
                    p=1.0,
                )
                out = pad(volume=vol.image, mask3d=vol.label)
                foreground = np.flatnonzero(out["mask3d"])[:FOREGROUND_SAMPLES]
                voxels = [  # the same classes, at their padded indices
                    np.flatnonzero(out["mask3d"] == c)[:FOREGROUND_SAMPLES]
                    for c in range(1, len(vol.class_voxels) + 1)
                ]
                vol = Volume(
                    vol.name, out["volume"], out["mask3d"], vol.image_path, foreground, voxels
                )
            self.volumes.append(vol)
        self.samples_per_volume = samples_per_volume
        self.foreground_fraction = foreground_fraction
        self.augment = Augment(augment_level) if augment else None
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.volumes) * self.samples_per_volume

    def patch_start(self, vol: Volume, rng: np.random.Generator) -> list[int]:
        shape, size = vol.shape, self.patch_size
        if vol.has_foreground and rng.random() < self.foreground_fraction:
            centre = vol.foreground_centre(rng)
            return [int(np.clip(c - s // 2, 0, d - s)) for c, s, d in zip(centre, size, shape)]
        return [int(rng.integers(0, d - s + 1)) for s, d in zip(size, shape)]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        rng = np.random.default_rng([self.seed, self.epoch, index])
        vol = self.volumes[index // self.samples_per_volume]
        window = tuple(slice(s, s + p) for s, p in zip(self.patch_start(vol, rng), self.patch_size))
        image, label = vol.patch(window)
        if self.augment is not None:
            image, label = self.augment(image, label, rng)
        return (
            torch.from_numpy(np.ascontiguousarray(image))[None],
            torch.from_numpy(label.astype(np.float32))[None],
        )
