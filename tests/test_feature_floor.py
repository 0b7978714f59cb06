"""bench/feature_floor.py: the filters, the learned floor against the band it must beat, the
held-in (leave-one-out) scoring, and its errors."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import write_dataset
from scipy import ndimage

from app.analysis.floor import classical_floors

ROOT = Path(__file__).resolve().parents[1]


def load_bench():
    spec = importlib.util.spec_from_file_location(
        "bench_feature_floor", ROOT / "bench/feature_floor.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_feature_floor"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


ff = load_bench()


def noisy_spheres(rng, shape=(12, 24, 24), shift=0.0, noise=0.9):
    """Spheres of intensity 1 in background 0, under noise a single voxel cannot see through;
    ``shift`` adds a constant, as a scanner with another offset would."""
    zz, yy, xx = np.indices(shape)
    label = np.zeros(shape, bool)
    for _ in range(3):
        c = rng.uniform((3, 6, 6), np.array(shape) - (3, 6, 6))
        r = rng.uniform(3, 5)
        label |= (zz - c[0]) ** 2 + (yy - c[1]) ** 2 + (xx - c[2]) ** 2 <= r * r
    image = label.astype(np.float32) + rng.normal(0, noise, shape).astype(np.float32) + shift
    return image, label


def test_the_filters_are_the_image_and_its_scipy_filters_voxel_by_voxel():
    image = np.random.default_rng(0).random((6, 8, 10)).astype(np.float32)
    feats = ff.filter_features(image)
    names = ff.filter_names()
    assert feats.shape == (image.size, len(names)) and feats.dtype == np.float32
    np.testing.assert_array_equal(feats[:, 0], image.reshape(-1))
    col = names.index("gaussian 1.6")
    expect = ndimage.gaussian_filter(image, 1.6, mode="reflect")
    np.testing.assert_allclose(feats[:, col].reshape(image.shape), expect, rtol=1e-6)
    col = names.index("laplacian 0.7")
    expect = ndimage.gaussian_laplace(image, 0.7, mode="reflect")
    np.testing.assert_allclose(feats[:, col].reshape(image.shape), expect, rtol=1e-5, atol=1e-6)


def test_the_learned_floor_sees_through_noise_that_defeats_the_band():
    rng = np.random.default_rng(1)
    train = [noisy_spheres(rng) for _ in range(2)]
    val = [noisy_spheres(rng) for _ in range(2)]
    band = classical_floors(*zip(*train), *zip(*val)).band.val_dice
    found = ff.feature_floor(*zip(*train), *zip(*val), samples_per_volume=4000)
    assert found.val_dice > band + 0.15, (found.val_dice, band)
    assert found.val_dice > 0.8
    assert found.leave_one_out is None


def test_leave_one_out_scores_each_val_volume_with_its_neighbours_in_training():
    """Val volumes on another intensity offset than train: the plain floor fails on them; the
    held-in one, fitted with the other val volume, does not."""
    rng = np.random.default_rng(2)
    train = [noisy_spheres(rng, noise=0.3) for _ in range(2)]
    val = [noisy_spheres(rng, noise=0.3, shift=3.0) for _ in range(2)]
    found = ff.feature_floor(*zip(*train), *zip(*val), leave_one_out=True, samples_per_volume=4000)
    assert [s.name for s in found.leave_one_out] == ["val 0", "val 1"]
    held_in = ff.global_dice(found.leave_one_out)
    assert found.val_dice < 0.6 and held_in > 0.9, (found.val_dice, held_in)


def test_bad_inputs_name_what_is_wrong():
    image = np.zeros((4, 4, 4), np.float32)
    with pytest.raises(ValueError, match=r"training volume 0: image .* label .* differ"):
        ff.feature_floor([image], [np.zeros((4, 4, 5), bool)], [image], [image > 0])
    with pytest.raises(ValueError, match="one class only"):
        ff.feature_floor([image], [image > 0], [image], [image > 0])
    with pytest.raises(ValueError, match="no validation volumes"):
        ff.feature_floor([image], [image > 0], [], [])


def test_the_command_prints_the_floor_of_a_data_root(tmp_path, capsys):
    root = tmp_path / "data"
    write_dataset(root, n_train=2, n_val=1, shape=(8, 24, 24))
    assert ff.main(["--data", str(root), "--samples-per-volume", "2000"]) == 0
    out = capsys.readouterr().out
    assert "<- the feature floor" in out and "train global Dice" in out
    assert ff.main(["--data", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "missing" in err and len(err.splitlines()) == 1
