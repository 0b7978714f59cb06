"""Augmentation: the label follows the image through every spatial transform."""

from __future__ import annotations

import numpy as np
import pytest

from app.data.augment import Augment
from app.data.dataset import PatchDataset, load_split

SHAPE = (16, 32, 32)


def ellipsoid() -> tuple[np.ndarray, np.ndarray]:
    z, y, x = np.mgrid[: SHAPE[0], : SHAPE[1], : SHAPE[2]]
    label = ((z - 7) ** 2 / 30 + (y - 15) ** 2 / 80 + (x - 13) ** 2 / 50 < 1).astype(np.uint8)
    return label.astype(np.float32), label


def test_full_level_keeps_the_label_on_the_image():
    # the image is its label: wherever the transforms move a voxel of one, the other follows,
    # up to the interpolation of the boundary
    image, label = ellipsoid()
    augment = Augment("full")
    moved = 0
    for seed in range(12):
        out_image, out_label = augment.deform(image, label, seed)
        assert out_image.shape == out_label.shape == SHAPE
        assert out_image.dtype == np.float32 and out_label.dtype == np.uint8
        assert set(np.unique(out_label)) <= {0, 1}
        boundary = ((out_image > 0.05) & (out_image < 0.95)).sum()
        disagree = ((out_image > 0.5) != out_label.astype(bool)).sum()
        assert disagree <= max(4, 0.25 * boundary)
        moved += not np.array_equal(out_label, label)
    assert moved >= 3  # rotation/scaling (p=0.3) and elastic (p=0.1) did happen


def test_whole_call_is_aligned_and_reproducible():
    image, label = ellipsoid()
    augment = Augment("full")
    first = augment(image, label, np.random.default_rng(7))
    again = augment(image, label, np.random.default_rng(7))
    np.testing.assert_array_equal(first[0], again[0])
    np.testing.assert_array_equal(first[1], again[1])
    for seed in range(8):  # flips follow; intensity changes leave the foreground brighter
        out_image, out_label = augment(image, label, np.random.default_rng(seed))
        inside, outside = out_image[out_label == 1], out_image[out_label == 0]
        assert inside.mean() > outside.mean() + 0.5


def test_flips_level_only_flips():
    # every output is one of the 8 mirrorings of the input, label and image alike, with the
    # intensities unchanged (basic's brightness/noise/blur would change them)
    rng = np.random.default_rng(0)
    image = rng.random(SHAPE, dtype=np.float32)
    label = (image > 0.5).astype(np.uint8)
    mirrorings = [
        tuple(axis for axis, flip in zip(range(3), bits) if flip) for bits in np.ndindex(2, 2, 2)
    ]
    augment = Augment("flips")
    seen = set()
    for seed in range(24):
        out_image, out_label = augment(image, label, np.random.default_rng(seed))
        matches = [a for a in mirrorings if np.array_equal(out_image, np.flip(image, a))]
        assert len(matches) == 1, f"seed {seed}: not a pure mirroring of the input"
        np.testing.assert_array_equal(out_label, np.flip(label, matches[0]))
        seen.add(matches[0])
    assert len(seen) >= 6  # all three axes do get flipped


def test_rot90_level_turns_and_flips_image_and_label_together():
    # every output is one of the 16 orientations that keep the depth axis (4 quarter turns in
    # H-W of the 4 in-plane mirrorings, each with or without a depth flip), label alike
    rng = np.random.default_rng(0)
    image = rng.random((4, 6, 6), dtype=np.float32)
    label = (image > 0.5).astype(np.uint8)
    orientations = [
        (flips, turns)
        for flips in [tuple(a for a, f in zip(range(3), b) if f) for b in np.ndindex(2, 2, 2)]
        for turns in range(4)
    ]

    def orient(volume, flips, turns):
        return np.rot90(np.flip(volume, flips), turns, (1, 2))

    distinct = {orient(image, *o).tobytes() for o in orientations}
    assert len(distinct) == 16  # 32 pairs, each orientation reached twice
    augment = Augment("rot90")
    seen = set()
    for seed in range(64):
        out_image, out_label = augment(image, label, np.random.default_rng(seed))
        match = next(o for o in orientations if np.array_equal(out_image, orient(image, *o)))
        np.testing.assert_array_equal(out_label, orient(label, *match))
        seen.add(out_image.tobytes())
    assert len(seen) >= 12
    with pytest.raises(ValueError, match="square in H-W"):
        augment(np.zeros((4, 6, 8), np.float32), np.zeros((4, 6, 8), np.uint8), rng)


def test_unknown_level_is_refused():
    with pytest.raises(ValueError, match="augmentation level 'strong'"):
        Augment("strong")


def test_dataset_draws_full_patches(dataset):
    volumes = load_split(dataset, "train", "zscore")
    patches = PatchDataset(volumes, (16, 16, 16), 2, 0.5, True, 0, "full")
    image, label = patches[0]
    assert image.shape == label.shape == (1, 16, 16, 16)
    assert set(label.unique().tolist()) <= {0.0, 1.0}


def test_gamma_level_changes_intensities_monotonically_and_keeps_the_label_aligned():
    rng = np.random.default_rng(1)
    image = rng.normal(size=(4, 8, 8)).astype(np.float32)
    label = (image > 0.3).astype(np.uint8)
    augment = Augment("gamma")
    changed = 0
    for seed in range(20):
        out_image, out_label = augment(image, label, np.random.default_rng(seed))
        # a monotonic change after a mirroring: the label still marks the brightest voxels
        threshold = out_image[out_label.astype(bool)].min()
        assert out_label.sum() == label.sum()
        np.testing.assert_array_equal(out_label, (out_image >= threshold).astype(np.uint8))
        changed += not np.allclose(np.sort(out_image.ravel()), np.sort(image.ravel()))
    assert 0 < changed < 20  # p 0.3
