"""Training-patch augmentation, applied identically to a patch and its label.

Six levels (``--augment-level``), geometric and/or intensity changes:

- ``flips``: random flips on the three axes only, for data whose absolute intensity is the label's
  main cue (a calibrated scale, as CT or a template): the intensity changes of ``basic`` move
  voxels across that boundary.
- ``rot90``: ``flips`` and a random quarter turn in the H-W plane: all 16 orientations that
  keep the depth axis, for voxels square in-plane (it needs a patch with H == W). Exact, like
  the flips: no resampling, and no cost.
- ``gamma``: ``flips`` and MONAI's gamma change of the image (p 0.3, gamma 0.7-1.5, the patch's
  mean and std kept): it moves the mid intensities against the ends, as the grey/CSF edge moves
  along z in MNI152, without the blur of ``basic``. The planner's level under ``dataset``
  normalisation when a third of the patches are centred on rare foreground; with uniform patches
  it picks ``flips`` (a stronger gamma, p 0.6 and 0.5-2.0, cost 0.01 Dice there).
- ``spatial``: ``flips`` after MONAI's rotation, scaling and elastic deformation (as in ``full``),
  still with the intensities untouched.
- ``basic``: random flips on the three axes, brightness/contrast, Gaussian noise and blur.
- ``full``: ``basic`` after MONAI's dictionary transforms (``monai.transforms``): a random
  rotation (up to 15 degrees about each axis) and scaling (up to 15%) in one resampling, an
  elastic deformation, and a gamma change of the image. The image is resampled bilinearly and the
  label with nearest neighbour on the same grid, so they stay aligned; both are padded by
  reflection, so a rotated patch has no empty corners.

All randomness comes from the ``numpy.random.Generator`` passed in (the dataset derives it from
seed, epoch and index), so a run is reproducible whatever the number of workers or processes.

The flips and the basic intensity changes are written here. albumentations 2.0.8 has no depth
flip, and ``Compose.set_random_seed`` hands every transform the same seed, so its
``HorizontalFlip`` and ``VerticalFlip`` (both p=0.5) always agree: 4 of the 8 mirrorings, never
one in-plane axis alone. Its brightness/contrast and noise transforms raise ``KeyError:
'images'`` on the ``volume`` target, and its blur clips float volumes to [0, 1], which destroys
z-scored data.
"""

from __future__ import annotations

import math

import numpy as np
from scipy import ndimage

LEVELS = ("flips", "rot90", "gamma", "spatial", "basic", "full")  # every level flips
WITH_DEFORMATION = ("spatial", "full")
WITH_INTENSITY = ("basic", "full")
MAX_ROTATION = math.radians(15.0)
MAX_SCALING = 0.15


def spatial_transforms(
    affine_p: float = 0.3, elastic_p: float = 0.1, gamma_p: float = 0.3
):  # -> monai.transforms.Compose (imported lazily: MONAI takes a second to import)
    """MONAI's rotation + scaling, elastic deformation and (unless ``gamma_p`` is 0) gamma, on
    keys ``image`` and ``label`` of channel-first arrays."""
    from monai.transforms import Compose, Rand3DElasticd, RandAffined

    keys, modes = ("image", "label"), ("bilinear", "nearest")
    transforms = [
        RandAffined(
            keys,
            prob=affine_p,
            rotate_range=(MAX_ROTATION,) * 3,
            scale_range=(MAX_SCALING,) * 3,
            mode=modes,
            padding_mode="reflection",
        ),
        # Offsets drawn per voxel in [magnitude], smoothed by a Gaussian of sigma voxels:
        # displacements of about 1-2 voxels that vary over about 10 voxels.
        Rand3DElasticd(
            keys,
            sigma_range=(5.0, 7.0),
            magnitude_range=(50.0, 100.0),
            prob=elastic_p,
            mode=modes,
            padding_mode="reflection",
        ),
    ]
    if gamma_p > 0:
        transforms.append(gamma_transform(gamma_p))
    return Compose(transforms)


def gamma_transform(p: float = 0.3):
    """MONAI's gamma change of the image (key ``image``); ``retain_stats``: the patch keeps its
    mean and std, so z-scored data stays z-scored."""
    from monai.transforms import RandAdjustContrastd

    return RandAdjustContrastd("image", prob=p, gamma=(0.7, 1.5), retain_stats=True)


class Augment:
    """``level`` augmentation of a ``(D, H, W)`` float32 patch and its uint8 label."""

    def __init__(self, level: str = "basic") -> None:
        if level not in LEVELS:
            raise ValueError(f"unknown augmentation level {level!r}; choose {', '.join(LEVELS)}")
        self.level = level
        self.intensity = level in WITH_INTENSITY
        self.spatial = (
            spatial_transforms(gamma_p=0.3 if self.intensity else 0.0)
            if level in WITH_DEFORMATION
            else None
        )
        self.gamma = gamma_transform() if level == "gamma" else None

    def __call__(self, image: np.ndarray, label: np.ndarray, rng: np.random.Generator):
        if self.spatial is not None:
            image, label = self.deform(image, label, int(rng.integers(2**31)))
        flipped = tuple(axis for axis in range(3) if rng.random() < 0.5)
        image, label = np.flip(image, flipped), np.flip(label, flipped)
        if self.level == "rot90":
            if image.shape[1] != image.shape[2]:
                raise ValueError(f"rot90 needs patches square in H-W, got {image.shape}")
            turns = int(rng.integers(4))
            image, label = np.rot90(image, turns, (1, 2)), np.rot90(label, turns, (1, 2))
        if self.intensity:
            image = self.change_intensity(image, rng)
        if self.gamma is not None:
            self.gamma.set_random_state(seed=int(rng.integers(2**31)))
            image = np.asarray(self.gamma({"image": np.ascontiguousarray(image)[None]})["image"])[0]
        return np.ascontiguousarray(image, dtype=np.float32), np.ascontiguousarray(label)

    @staticmethod
    def change_intensity(image: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        if rng.random() < 0.3:  # brightness and contrast
            image = image * rng.uniform(0.85, 1.15) + rng.uniform(-0.15, 0.15)
        if rng.random() < 0.15:
            image = image + rng.normal(0.0, rng.uniform(0.0, 0.1), image.shape)
        if rng.random() < 0.15:
            image = ndimage.gaussian_filter(image, sigma=rng.uniform(0.5, 1.0))
        return image

    def deform(self, image: np.ndarray, label: np.ndarray, seed: int):
        self.spatial.set_random_state(seed=seed)
        out = self.spatial({"image": image[None], "label": label[None].astype(np.float32)})
        deformed = np.asarray(out["image"])[0]
        # nearest neighbour keeps the label's values; rounding (not > 0.5) keeps class maps
        return deformed.astype(np.float32), np.rint(np.asarray(out["label"])[0]).astype(np.uint8)
