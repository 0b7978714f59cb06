"""app.analysis.floor against brute force: every candidate rule scored directly with numpy."""

from __future__ import annotations

import json

import numpy as np
import pytest

from app.analysis.floor import (
    Floor,
    best_band,
    best_threshold,
    classical_floors,
    floors_from_volumes,
    otsu,
)


def brute_dice(images, labels, lo=None, hi=None) -> float:
    """Global Dice of ``lo < image < hi`` written out independently of app.analysis.floor."""
    tp = fp = fn = 0
    for image, label in zip(images, labels):
        pred = np.full(image.shape, True)
        if lo is not None:
            pred = pred & (image > lo)
        if hi is not None:
            pred = pred & (image < hi)
        truth = label == 1
        tp += int((pred & truth).sum())
        fp += int((pred & ~truth).sum())
        fn += int((~pred & truth).sum())
    return 1.0 if tp + fp + fn == 0 else 2 * tp / (2 * tp + fp + fn)


def random_set(rng, shapes, noise=0.6):
    """Foreground brighter than background on average, with overlapping noisy intensities."""
    images, labels = [], []
    for shape in shapes:
        label = (rng.random(shape) < 0.3).astype(np.uint8)
        images.append((label + rng.normal(0, noise, shape)).astype(np.float32))
        labels.append(label)
    return images, labels


def middle_band_set(rng, shapes):
    """Foreground is the middle of three intensity classes: no single threshold isolates it."""
    images, labels = [], []
    for shape in shapes:
        cls = rng.integers(0, 3, shape)
        images.append((cls + rng.normal(0, 0.15, shape)).astype(np.float32))
        labels.append((cls == 1).astype(np.uint8))
    return images, labels


def test_threshold_matches_brute_force_on_continuous_data():
    rng = np.random.default_rng(0)
    images, labels = random_set(rng, [(6, 10, 10), (5, 9, 11)])
    values = np.unique(np.concatenate([im.ravel() for im in images]))
    brute = max(brute_dice(images, labels, lo=t) for t in values)
    found = best_threshold(images, labels, bins=64)
    assert found.kind == "threshold" and found.hi is None
    # the reported Dice is the true Dice of the reported rule, and near the optimum
    assert found.train_dice == pytest.approx(brute_dice(images, labels, lo=found.lo), abs=1e-12)
    assert brute - 0.01 <= found.train_dice <= brute + 1e-12


@pytest.mark.parametrize("seed", range(8))
def test_threshold_and_band_exact_on_discrete_data(seed):
    """With fewer distinct values than bins every cut is a candidate: the optimum is exact,
    including the voxels that sit on the cut values (strict inequalities on both sides)."""
    rng = np.random.default_rng(seed)
    p_fg = rng.random(12)  # arbitrary foreground probability per intensity value
    images, labels = [], []
    for shape in [(4, 8, 8), (3, 7, 9)]:
        image = rng.integers(0, 12, shape)
        images.append(image.astype(np.float32))
        labels.append((rng.random(shape) < p_fg[image]).astype(np.uint8))
    values = np.unique(np.concatenate([im.ravel() for im in images]))
    bounds = [None, *values.tolist()]
    brute_t = max(brute_dice(images, labels, lo=t) for t in values[:-1])
    brute_b = max(
        brute_dice(images, labels, lo, hi)
        for lo in bounds
        for hi in bounds
        if lo is None or hi is None or lo < hi
    )
    threshold, band = best_threshold(images, labels), best_band(images, labels)
    assert threshold.train_dice == pytest.approx(brute_t, abs=1e-12)
    assert band.train_dice == pytest.approx(brute_b, abs=1e-12)
    assert band.train_dice == pytest.approx(brute_dice(images, labels, band.lo, band.hi))
    assert band.train_dice >= threshold.train_dice


def test_band_matches_brute_force_and_beats_threshold_on_middle_band():
    rng = np.random.default_rng(2)
    images, labels = middle_band_set(rng, [(6, 12, 12), (6, 10, 14)])
    values = np.unique(np.concatenate([im.ravel() for im in images]))
    grid = np.quantile(values, np.linspace(0, 1, 61))
    brute = max(brute_dice(images, labels, lo, hi) for lo in grid for hi in grid if lo < hi)
    band = best_band(images, labels, bins=128)
    threshold = best_threshold(images, labels, bins=128)
    assert band.kind == "band" and band.lo is not None and band.hi is not None
    assert 0.25 < band.lo < 0.75 and 1.25 < band.hi < 1.75  # the gaps around class 1
    assert band.train_dice >= brute - 0.01
    assert band.train_dice == pytest.approx(brute_dice(images, labels, band.lo, band.hi))
    assert band.train_dice > 0.95
    assert threshold.train_dice < 0.75  # > t always takes the bright class too
    assert band.train_dice > threshold.train_dice + 0.2


def test_val_score_uses_global_counts_not_a_mean_of_volumes():
    rule = Floor("threshold", 0.5, None, train_dice=1.0)
    # volume A: 100 foreground voxels all found; volume B: 1 foreground voxel, 1 false positive
    img_a, lab_a = np.ones((1, 10, 10), np.float32), np.ones((1, 10, 10), np.uint8)
    img_b = np.zeros((1, 2, 2), np.float32)
    lab_b = np.zeros((1, 2, 2), np.uint8)
    img_b[0, 0, 0] = 1.0  # predicted, not foreground
    lab_b[0, 1, 1] = 1  # foreground, missed
    scored = rule.score([img_a, img_b], [lab_a, lab_b])
    # global: TP 100, FP 1, FN 1 -> 200 / 202; the mean of per-volume Dice would be 0.5
    assert scored.val_dice == pytest.approx(200 / 202)
    assert scored.train_dice == 1.0 and scored.lo == 0.5


def test_classical_floors_pick_on_train_and_score_on_val():
    rng = np.random.default_rng(3)
    train = middle_band_set(rng, [(4, 10, 10)] * 2)
    # val is shifted: the band picked on train must be applied unchanged
    val_images, val_labels = middle_band_set(rng, [(4, 10, 10)])
    val_images = [im + 0.4 for im in val_images]
    floors = classical_floors(*train, val_images, val_labels, bins=128)
    for f in (floors.threshold, floors.band, floors.otsu):
        assert f.val_dice == pytest.approx(brute_dice(val_images, val_labels, f.lo, f.hi))
    assert floors.band.val_dice < floors.band.train_dice - 0.1
    assert set(floors.to_dict()) == {"threshold", "band", "otsu"}
    json.dumps(floors.to_dict())  # plain data
    assert len(floors.describe().splitlines()) == 3
    assert "<" in floors.band.describe() and "val Dice" in floors.band.describe()


def test_otsu_splits_two_classes():
    rng = np.random.default_rng(4)
    label = (rng.random((4, 16, 16)) < 0.5).astype(np.uint8)
    image = (label * 10 + rng.normal(0, 1, label.shape)).astype(np.float32)
    found = otsu([image], [label])
    assert found.kind == "otsu" and 3 < found.lo < 7
    assert found.train_dice == pytest.approx(brute_dice([image], [label], lo=found.lo))


def test_accepts_trainer_volumes_and_bool_labels():
    from types import SimpleNamespace

    rng = np.random.default_rng(5)
    images, labels = random_set(rng, [(4, 8, 8)] * 3)
    volumes = [SimpleNamespace(image=i, label=lab.astype(bool)) for i, lab in zip(images, labels)]
    floors = floors_from_volumes(volumes[:2], volumes[2:])
    direct = classical_floors(images[:2], labels[:2], images[2:], labels[2:])
    assert floors == direct


@pytest.mark.parametrize(
    "images, labels, message",
    [
        ([], [], "no images"),
        ([np.zeros((2, 2, 2))], [], "1 images but 0 labels"),
        ([np.zeros((2, 2, 2))], [np.zeros((2, 2, 3), np.uint8)], "shape"),
        ([np.zeros((2, 2, 2))], [np.full((2, 2, 2), 255, np.uint8)], "not binary"),
        ([np.zeros((2, 2, 2))], [np.full((2, 2, 2), 0.5)], "not binary"),
        ([np.full((2, 2, 2), np.nan)], [np.zeros((2, 2, 2), np.uint8)], "NaN"),
        ([np.zeros((0, 2, 2))], [np.zeros((0, 2, 2), np.uint8)], "empty"),
    ],
)
def test_errors_name_the_problem(images, labels, message):
    for fn in (best_threshold, best_band, otsu):
        with pytest.raises(ValueError, match=message):
            fn(images, labels)
    with pytest.raises(ValueError, match=message):
        Floor("threshold", 0.0, None, 1.0).score(images, labels)


def test_band_is_near_optimal_even_with_few_quantile_cuts():
    """The pair search over ``bins`` cuts is refined over the fine histogram: a coarse grid of
    candidates still ends near the brute-force optimum, and never below the threshold."""
    rng = np.random.default_rng(6)
    images, labels = middle_band_set(rng, [(6, 12, 12)])
    images = [im + rng.normal(0, 0.2, im.shape).astype(np.float32) for im in images]
    grid = np.quantile(images[0], np.linspace(0, 1, 81))
    brute = max(brute_dice(images, labels, lo, hi) for lo in grid for hi in grid if lo < hi)
    for bins in (2, 3, 8):
        band = best_band(images, labels, bins=bins)
        assert band.train_dice >= brute - 0.005, bins
        assert band.train_dice >= best_threshold(images, labels, bins=bins).train_dice
