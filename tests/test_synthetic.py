"""Tests for the standalone synthetic data generator datasets/make_synthetic.py."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "datasets" / "make_synthetic.py"
SHAPE = (16, 48, 48)


def _load_module():
    # by path: datasets/ is deliberately not a package (it would shadow Hugging Face datasets)
    spec = importlib.util.spec_from_file_location("irongrain_make_synthetic", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ms = _load_module()


def _read(path: Path) -> np.ndarray:
    name = path.name
    if name.endswith(".nii.gz"):
        import nibabel as nib

        return np.asarray(nib.load(path).dataobj)
    if name.endswith(".tif"):
        import tifffile

        return tifffile.imread(path)
    if name.endswith(".npy"):
        return np.load(path)
    raise AssertionError(f"unexpected file {path}")


@pytest.fixture(scope="module")
def volume():
    return ms.make_volume(SHAPE, np.random.default_rng(123))


def test_volume_shape_dtype_and_binary_label(volume):
    image, label = volume
    assert image.shape == SHAPE and label.shape == SHAPE
    assert image.dtype == np.float32 and label.dtype == np.uint8
    assert set(np.unique(label).tolist()) == {0, 1}
    assert np.isfinite(image).all()


def test_deterministic_for_a_seed():
    a = ms.make_volume(SHAPE, np.random.default_rng(7))
    b = ms.make_volume(SHAPE, np.random.default_rng(7))
    c = ms.make_volume(SHAPE, np.random.default_rng(8))
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    assert not np.array_equal(a[1], c[1])


@pytest.mark.parametrize("seed", range(4))
def test_grain_fraction_in_range(seed):
    _, label = ms.make_volume((24, 64, 64), np.random.default_rng(seed))
    assert 0.25 <= label.mean() <= 0.55


def test_grains_are_many_and_varied():
    from scipy import ndimage as ndi

    _, label = ms.make_volume((32, 96, 96), np.random.default_rng(0))
    components, n = ndi.label(label)
    sizes = np.bincount(components.ravel())[1:]
    assert n >= 20
    # a range of sizes, not one repeated sphere
    assert np.percentile(sizes, 90) > 4 * np.percentile(sizes, 10)


def test_global_threshold_does_not_solve_it(volume):
    image, label = volume
    threshold, dice = ms.best_threshold_dice(image, label)
    assert 0.3 < dice < 0.8
    assert image.min() <= threshold <= image.max()


def test_threshold_search_is_exact_on_a_separable_volume():
    rng = np.random.default_rng(0)
    label = (rng.random(SHAPE) < 0.4).astype(np.uint8)
    image = (label + 0.1 * rng.random(SHAPE)).astype(np.float32)
    # candidates are intensity quantiles, so the gap itself need not be among them
    res = ms.threshold_search(image, label)
    assert res.dice > 0.99 and res.above
    res = ms.threshold_search(-image, label)  # grain darker than the matrix
    assert res.dice > 0.99 and not res.above
    # pooled over several volumes, same answer
    assert ms.best_threshold_dice([image, image], [label, label])[1] > 0.99


@pytest.mark.parametrize("fmt", ["nii.gz", "tif", "npy"])
def test_generate_layout_and_pairing(tmp_path, fmt):
    lines = []
    ms.generate(tmp_path, n_train=2, n_val=1, shape=SHAPE, seed=3, fmt=fmt, log=lines.append)
    for split, n in (("train_patches", 2), ("val_patches", 1)):
        images = sorted(p.name for p in (tmp_path / split / "images").iterdir())
        labels = sorted(p.name for p in (tmp_path / split / "labels").iterdir())
        assert images == labels == [f"grain_{i:03d}.{fmt}" for i in range(n)]
        for name in images:
            image = _read(tmp_path / split / "images" / name)
            label = _read(tmp_path / split / "labels" / name)
            assert image.shape == label.shape == SHAPE
            assert image.dtype == np.float32 and label.dtype == np.uint8
            assert set(np.unique(label).tolist()) <= {0, 1}
    assert not list(tmp_path.rglob("*.tmp"))
    assert any(line.startswith("train_patches: 2 image/label pairs") for line in lines)
    assert any(line.startswith("best global threshold Dice on val:") for line in lines)
    # the same seed writes the same volume; a val volume does not depend on --n-train
    image, label = ms.make_volume(SHAPE, ms._volume_rng(3, 1, 0))
    np.testing.assert_array_equal(
        _read(tmp_path / "val_patches/images" / f"grain_000.{fmt}"), image
    )
    np.testing.assert_array_equal(
        _read(tmp_path / "val_patches/labels" / f"grain_000.{fmt}"), label
    )
    # the instance map beside them: one id per grain, 1..N, exactly where the label is
    instances = _read(tmp_path / "val_patches/instances" / f"grain_000.{fmt}")
    assert instances.dtype == np.uint16 and instances.shape == SHAPE
    np.testing.assert_array_equal(instances > 0, label > 0)
    assert np.array_equal(np.unique(instances), np.arange(instances.max() + 1))
    assert instances.max() > 10


def test_nifti_header_has_voxel_spacing(tmp_path):
    import nibabel as nib

    ms.generate(tmp_path, 1, 1, SHAPE, seed=0, fmt="nii.gz", log=lambda _: None)
    img = nib.load(tmp_path / "train_patches/images/grain_000.nii.gz")
    assert img.shape == SHAPE
    assert img.header.get_zooms() == pytest.approx((ms.VOXEL_SIZE_MM,) * 3)


def test_refuses_to_mix_with_stale_files(tmp_path):
    ms.generate(tmp_path, 3, 1, SHAPE, seed=0, fmt="npy", log=lambda _: None)
    with pytest.raises(FileExistsError, match="would not write"):
        ms.generate(tmp_path, 2, 1, SHAPE, seed=0, fmt="npy", log=lambda _: None)
    # rerunning the same command is fine (hidden files are ignored, as the trainer does);
    # --overwrite removes the generator's own extras
    (tmp_path / "train_patches/images/.DS_Store").write_bytes(b"")
    ms.generate(tmp_path, 3, 1, SHAPE, seed=0, fmt="npy", log=lambda _: None)
    ms.generate(tmp_path, 2, 1, SHAPE, seed=0, fmt="npy", overwrite=True, log=lambda _: None)
    assert sorted(p.name for p in (tmp_path / "train_patches/images").iterdir()) == [
        ".DS_Store",
        "grain_000.npy",
        "grain_001.npy",
    ]
    # never deletes files it did not make
    (tmp_path / "train_patches/images/scan.nii.gz").write_bytes(b"")
    with pytest.raises(FileExistsError, match="not made by this generator"):
        ms.generate(tmp_path, 2, 1, SHAPE, seed=0, fmt="npy", overwrite=True, log=lambda _: None)
    assert (tmp_path / "train_patches/images/scan.nii.gz").exists()


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120
    )


def test_cli_writes_a_data_set(tmp_path):
    out = tmp_path / "data"
    res = _cli("--out", str(out), "--n-train", "1", "--n-val", "1", "--shape", *map(str, SHAPE))
    assert res.returncode == 0, res.stderr
    assert "best global threshold Dice on val:" in res.stdout
    assert (out / "train_patches/images/grain_000.nii.gz").is_file()
    assert (out / "val_patches/labels/grain_000.nii.gz").is_file()


BAD_ARGS = [
    (["--shape", "0", "48", "48"], "--shape"),
    (["--shape", "16", "-4", "48"], "--shape"),
    (["--shape", "16", "48"], "--shape"),
    (["--n-val", "0"], "--n-val"),
    (["--n-train", "0"], "--n-train"),
    (["--seed", "-1"], "--seed"),
    (["--format", "png"], "--format"),
]


@pytest.mark.parametrize(("args", "message"), BAD_ARGS)
def test_main_rejects_bad_arguments(tmp_path, capsys, args, message):
    out = tmp_path / "data"
    with pytest.raises(SystemExit) as exc:
        ms.main(["--out", str(out), "--n-train", "1", "--shape", "16", "48", "48", *args])
    assert exc.value.code != 0
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_cli_rejects_bad_arguments(tmp_path):
    res = _cli("--out", str(tmp_path / "data"), "--n-val", "0", "--shape", "16", "48", "48")
    assert res.returncode == 2
    assert "--n-val must be at least 1" in res.stderr
    assert not (tmp_path / "data").exists()


def test_script_does_not_import_a_datasets_package():
    text = SCRIPT.read_text()
    assert "from datasets" not in text and "import datasets" not in text
    assert not (SCRIPT.parent / "__init__.py").exists()


@pytest.mark.parametrize("phases", [3, 4])
def test_phases_label_each_grain_with_its_phase_and_keep_the_image(phases):
    plain = ms.make_grain_volume(SHAPE, np.random.default_rng(5))
    phased = ms.make_grain_volume(SHAPE, np.random.default_rng(5), phases)
    assert np.array_equal(plain.image, phased.image)  # only the labels change
    assert np.array_equal(plain.instances, phased.instances)
    assert np.array_equal(phased.label > 0, plain.label > 0)
    assert set(np.unique(phased.label)) == set(range(phases))
    for grain in np.unique(plain.instances)[1:]:  # one phase per grain
        assert np.unique(phased.label[plain.instances == grain]).size == 1


def test_multi_threshold_search_is_exact_on_separable_classes():
    label = np.repeat(np.array([0, 2, 1], np.uint8), 1000)
    image = np.repeat(np.array([0.0, 1.0, 2.0], np.float32), 1000)
    image += np.random.default_rng(0).uniform(-0.2, 0.2, image.size).astype(np.float32)
    result = ms.multi_threshold_search([image], [label], 3)
    # the cuts lie on a grid of intensity quantiles: a few voxels at each edge may fall wrong
    assert result.mean_dice > 0.98 and min(result.dice) > 0.98
    assert result.order == (0, 2, 1) and 0.1 < result.cuts[0] < 0.9 < 1.1 < result.cuts[1] < 1.9


def test_cli_phases_prints_the_multi_threshold_floor(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--out",
            str(tmp_path / "p"),
            "--n-train",
            "1",
            "--n-val",
            "1",
            "--shape",
            "16",
            "32",
            "32",
            "--phases",
            "3",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "best multi-threshold floor on val: mean foreground Dice" in out
    assert "--num-classes 3 --class-names matrix oxide goethite" in out
    label = _read(tmp_path / "p/val_patches/labels/grain_000.nii.gz")
    assert label.dtype == np.uint8 and label.max() <= 2
