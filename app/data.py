"""IronGrain volumes: pairing, validation, normalisation, patch sampling and augmentation.

Layout: ``ROOT/{train,val}_patches/{images,labels}/NAME.ext``; a label shares its image's NAME.
Every file is checked when the split is loaded, and all problems are reported at once, each line
naming its file, before any training starts.

Policies:

- Labels: ``{0, 1}``, ``{0, 255}`` or bool; stored as uint8 ``{0, 1}``.
- Normalisation is per volume: z-score, or clipping to the 0.5-99.5 percentiles scaled to [0, 1].
- A volume smaller than the training patch is padded, centred, to the patch size: the image with
  its own minimum (CT background is dark) and the label with 0. Validation and prediction pad the
  same way and crop the result back, so padded voxels never count in a metric.
- Validation is deterministic: every val volume is evaluated whole (see ``app.inference``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from scipy import ndimage
from torch.utils.data import Dataset

from app.volume_io import EXTENSIONS, VolumeError, is_volume_file, read_volume, split_ext

os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")  # no PyPI call from every worker
import albumentations as A

SPLITS = {"train": "train_patches", "val": "val_patches"}
FOREGROUND_SAMPLES = 10_000  # candidate centres kept per volume for foreground oversampling


class DataError(ValueError):
    """The dataset is unusable; each line of the message names a file or folder."""


@dataclass
class Volume:
    name: str
    image: np.ndarray  # float32, normalised
    label: np.ndarray  # uint8 {0, 1}
    image_path: Path
    foreground: np.ndarray = field(repr=False)  # flat indices of sampled foreground voxels


def binarize_label(array: np.ndarray, path: Path) -> np.ndarray:
    if array.dtype == bool:
        return array.astype(np.uint8)
    values = np.unique(array)
    if np.isin(values, (0, 1)).all():
        return array.astype(np.uint8)
    if np.isin(values, (0, 255)).all():
        return (array == 255).astype(np.uint8)
    shown = ", ".join(f"{v:g}" for v in values[:8]) + (", ..." if values.size > 8 else "")
    raise VolumeError(
        f"{path}: labels must be binary ({{0, 1}}, {{0, 255}} or bool); found {values.size} "
        f"values: {shown}"
    )


def check_finite(array: np.ndarray, path: Path) -> None:
    if array.dtype.kind == "f":
        bad = int(np.count_nonzero(~np.isfinite(array)))
        if bad:
            raise VolumeError(f"{path}: {bad} NaN/Inf voxel(s); clean the volume first")


def normalize(image: np.ndarray, mode: str) -> np.ndarray:
    image = image.astype(np.float32, copy=False)
    if mode == "zscore":
        mean, std = float(image.mean(dtype=np.float64)), float(image.std(dtype=np.float64))
        return ((image - mean) / max(std, 1e-8)).astype(np.float32)
    if mode == "percentile":
        low, high = np.percentile(image, (0.5, 99.5))
        return ((np.clip(image, low, high) - low) / max(high - low, 1e-8)).astype(np.float32)
    raise ValueError(f"unknown normalisation {mode!r}")


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
        for path in sorted(folder.iterdir()):
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
    name: str, image_path: Path, label_path: Path, normalization: str, rng: np.random.Generator
) -> Volume:
    image, _ = read_volume(image_path)
    check_finite(image, image_path)
    label, _ = read_volume(label_path)
    check_finite(label, label_path)
    if image.shape != label.shape:
        raise VolumeError(
            f"{image_path}: shape {image.shape} differs from its label "
            f"{label_path} with shape {label.shape}"
        )
    label = binarize_label(label, label_path)
    foreground = np.flatnonzero(label)
    if foreground.size > FOREGROUND_SAMPLES:
        foreground = rng.choice(foreground, FOREGROUND_SAMPLES, replace=False)
    return Volume(name, normalize(image, normalization), label, image_path, foreground)


def load_split(root: Path | str, split: str, normalization: str, seed: int = 0) -> list[Volume]:
    """Load and check every pair of a split; all problems are raised together."""
    root = Path(root)
    if not root.is_dir():
        raise DataError(f"{root}: data root is missing (--data-root); see datasets/README.md")
    pairs = pair_files(root / SPLITS[split])
    rng = np.random.default_rng(seed)
    volumes, problems = [], []
    for name, image_path, label_path in pairs:
        try:
            volumes.append(load_volume_pair(name, image_path, label_path, normalization, rng))
        except VolumeError as exc:
            problems.append(str(exc))
    if problems:
        raise DataError("\n".join(problems))
    return volumes


class Augment:
    """Random flips and intensity changes applied identically to a patch and its label.

    Flips use albumentations (``HorizontalFlip``/``VerticalFlip`` on ``volume`` + ``mask3d``).
    The depth flip and the intensity changes are written here: albumentations 2.0.8 has no depth
    flip, its brightness/contrast and noise transforms raise ``KeyError: 'images'`` on the
    ``volume`` target, and its blur clips float volumes to [0, 1], which destroys z-scored data.
    """

    def __init__(self) -> None:
        self.flips = A.Compose([A.HorizontalFlip(p=0.5), A.VerticalFlip(p=0.5)])

    def __call__(self, image: np.ndarray, label: np.ndarray, rng: np.random.Generator):
        self.flips.set_random_seed(int(rng.integers(2**31)))
        out = self.flips(volume=image, mask3d=label)
        image, label = out["volume"], out["mask3d"]
        if rng.random() < 0.5:
            image, label = image[::-1], label[::-1]
        if rng.random() < 0.3:  # brightness and contrast
            image = image * rng.uniform(0.85, 1.15) + rng.uniform(-0.15, 0.15)
        if rng.random() < 0.15:
            image = image + rng.normal(0.0, rng.uniform(0.0, 0.1), image.shape)
        if rng.random() < 0.15:
            image = ndimage.gaussian_filter(image, sigma=rng.uniform(0.5, 1.0))
        return np.ascontiguousarray(image, dtype=np.float32), np.ascontiguousarray(label)


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
    ):
        self.patch_size = tuple(patch_size)
        self.volumes = []
        for vol in volumes:
            if any(a < p for a, p in zip(vol.image.shape, self.patch_size)):
                pad = A.PadIfNeeded3D(
                    min_zyx=self.patch_size,
                    position="center",
                    fill=float(vol.image.min()),
                    fill_mask=0,
                    p=1.0,
                )
                out = pad(volume=vol.image, mask3d=vol.label)
                foreground = np.flatnonzero(out["mask3d"])[:FOREGROUND_SAMPLES]
                vol = Volume(vol.name, out["volume"], out["mask3d"], vol.image_path, foreground)
            self.volumes.append(vol)
        self.samples_per_volume = samples_per_volume
        self.foreground_fraction = foreground_fraction
        self.augment = Augment() if augment else None
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.volumes) * self.samples_per_volume

    def patch_start(self, vol: Volume, rng: np.random.Generator) -> list[int]:
        shape, size = vol.image.shape, self.patch_size
        if vol.foreground.size and rng.random() < self.foreground_fraction:
            centre = np.unravel_index(int(rng.choice(vol.foreground)), shape)
            return [int(np.clip(c - s // 2, 0, d - s)) for c, s, d in zip(centre, size, shape)]
        return [int(rng.integers(0, d - s + 1)) for s, d in zip(size, shape)]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        rng = np.random.default_rng([self.seed, self.epoch, index])
        vol = self.volumes[index // self.samples_per_volume]
        window = tuple(slice(s, s + p) for s, p in zip(self.patch_start(vol, rng), self.patch_size))
        image, label = vol.image[window], vol.label[window]
        if self.augment is not None:
            image, label = self.augment(image, label, rng)
        return (
            torch.from_numpy(np.ascontiguousarray(image))[None],
            torch.from_numpy(label.astype(np.float32))[None],
        )
