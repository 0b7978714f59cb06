"""--data-access mmap: training patches read from disk, the streaming index, app.convert."""

import errno
import json
import os

import numpy as np
import pytest
import tifffile
import torch
from helpers import blob_volume, write_dataset

from app.data.dataset import load_train_val
from app.data.lazy import (
    LazyVolume,
    MappedArray,
    PatchScale,
    index_split,
    load_mapped_train_val,
    open_mapped,
    read_index,
)
from app.data.volume_io import VolumeError
from app.train import main


def run(args):
    return main([str(a) for a in args])


@pytest.fixture
def npy_data(tmp_path):
    return write_dataset(tmp_path / "npy", n_train=3, n_val=2, shape=(20, 36, 40), ext=".npy")


def test_open_mapped_reads_npy_and_uncompressed_tiff_by_region(tmp_path):
    array = np.arange(5 * 6 * 7, dtype=np.int16).reshape(5, 6, 7)
    np.save(tmp_path / "a.npy", array)
    tifffile.imwrite(tmp_path / "a.tif", array)
    window = (slice(1, 4), slice(2, 5), slice(0, 7, 2))
    for name in ("a.npy", "a.tif"):
        mapped = open_mapped(tmp_path / name)
        assert mapped.shape == (5, 6, 7)
        assert np.array_equal(mapped[window], array[window])


@pytest.mark.parametrize(
    ("write", "message"),
    [
        (lambda p: np.save(p / "v.npy", np.asfortranarray(np.zeros((4, 8, 8)))), "Fortran-order"),
        (lambda p: (p / "v.nii.gz").write_bytes(b"x"), ".nii.gz cannot be memory-mapped"),
        (lambda p: np.save(p / "v.npy", np.zeros((4, 8))), "expected a 3D numeric array"),
    ],
)
def test_what_cannot_be_mapped_says_how_to_convert_it(tmp_path, write, message):
    write(tmp_path)
    (path,) = tmp_path.iterdir()
    with pytest.raises(VolumeError, match=message) as caught:
        open_mapped(path)
    assert str(path) in str(caught.value)


def test_lazy_patches_match_the_in_memory_ones(npy_data, tmp_path):
    memory, _, _ = load_train_val(npy_data, "zscore")
    index_split(npy_data, tmp_path / "index")
    lazy, _, _ = load_mapped_train_val(npy_data, "zscore", 0, tmp_path / "index")
    window = (slice(2, 18), slice(3, 35), slice(5, 37))
    for a, b in zip(memory, lazy):
        image_a, label_a = a.patch(window)
        image_b, label_b = b.patch(window)
        np.testing.assert_allclose(image_a, image_b, atol=1e-5)
        assert np.array_equal(label_a, label_b)
        assert b.index.foreground == int(a.label.sum())


def test_foreground_centres_are_uniform_over_the_foreground(tmp_path):
    image, label = blob_volume((12, 40, 36), np.random.default_rng(3))
    np.save(tmp_path / "i.npy", image)
    np.save(tmp_path / "l.npy", label)
    root = tmp_path / "root" / "train_patches"
    for kind, array in (("images", image), ("labels", label)):
        (root / kind).mkdir(parents=True)
        np.save(root / kind / "v.npy", array)
    index_split(tmp_path / "root", tmp_path / "index")
    index = read_index(tmp_path / "index", "v")
    volume = LazyVolume("v", open_mapped(root / "images/v.npy"), open_mapped(root / "labels/v.npy"),
                        root / "images/v.npy", PatchScale(), index)  # fmt: skip
    rng = np.random.default_rng(0)
    draws = [volume.foreground_centre(rng) for _ in range(4000)]
    assert all(label[d] for d in draws)
    # uniform over the foreground voxels: any part of it gets its share of the draws
    for part in (np.s_[:6], np.s_[:, :20], np.s_[:, :, 18:]):
        share = label[part].sum() / label.sum()
        inside = np.zeros(label.shape, bool)
        inside[part] = True
        drawn = np.mean([inside[d] for d in draws])
        assert drawn == pytest.approx(share, abs=0.04)  # 5 sigma at 4000 draws


def test_mmap_training_runs_and_reuses_its_index(npy_data, tmp_path, tiny_args):
    run_dir = tmp_path / "run"
    args = [*tiny_args, "--data-root", npy_data, "--output-dir", run_dir, "--data-access", "mmap"]
    assert run([*args, "--epochs", 1]) == 0
    entry = run_dir / "data_index" / "vol_00.json"
    saved = json.loads(entry.read_text())
    assert saved["foreground"] > 0 and saved["std"] > 0
    stamp = entry.stat().st_mtime_ns
    assert run([*args, "--epochs", 2]) == 0
    assert entry.stat().st_mtime_ns == stamp  # unchanged files are not indexed again
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records] == [1, 2] and 0 <= records[-1]["dice"] <= 1


def test_mmap_dataset_normalisation_matches_memory_within_sampling(npy_data, tmp_path):
    _, _, memory = load_train_val(npy_data, "dataset")
    index_split(npy_data, tmp_path / "index")
    _, _, lazy = load_mapped_train_val(npy_data, "dataset", 0, tmp_path / "index")
    assert lazy.mean == pytest.approx(memory.mean, abs=0.05)
    assert lazy.std == pytest.approx(memory.std, rel=0.05)


def test_mmap_bad_label_is_named(npy_data, tmp_path, tiny_args, capsys):
    np.save(npy_data / "train_patches/labels/vol_01.npy", np.full((20, 36, 40), 7, np.uint8))
    args = [*tiny_args, "--data-root", npy_data, "--output-dir", tmp_path / "run"]
    assert run([*args, "--data-access", "mmap"]) == 2
    err = capsys.readouterr().err
    assert "vol_01.npy: labels must be binary" in err and "Traceback" not in err


def test_a_data_root_lost_mid_run_is_one_line(npy_data, tmp_path, tiny_args, capsys, monkeypatch):
    real = np.memmap
    calls = {"n": 0}

    def memmap(path, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] > 40:  # after the index and a few patches: the volume is gone
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real(path, *args, **kwargs)

    run_dir = tmp_path / "run"
    args = [*tiny_args, "--data-root", npy_data, "--output-dir", run_dir, "--data-access", "mmap"]
    assert run([*args, "--epochs", 1]) == 0
    last = (run_dir / "checkpoints/last.pt").read_bytes()
    capsys.readouterr()
    monkeypatch.setattr(np, "memmap", memmap)
    assert run([*args, "--epochs", 3]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "cannot read: Permission denied (EACCES)" in lines[0]
    assert str(npy_data) in lines[0] and "Traceback" not in err
    assert (run_dir / "checkpoints/last.pt").read_bytes() == last


def test_convert_makes_nifti_trainable_with_mmap(tmp_path, tiny_args, capsys):
    from app.convert import main as convert

    source = write_dataset(tmp_path / "nii", n_train=2, n_val=1)
    out = tmp_path / "npy"
    assert convert(["--data-root", str(source), "--out", str(out)]) == 0
    assert "converted 6 volume(s)" in capsys.readouterr().out
    assert convert(["--data-root", str(source), "--out", str(out)]) == 0
    assert "converted 0 volume(s)" in capsys.readouterr().out  # already up to date
    image = np.load(out / "train_patches/images/vol_00.npy")
    import nibabel as nib

    original = np.asarray(nib.load(source / "train_patches/images/vol_00.nii.gz").dataobj)
    assert np.array_equal(image, original)
    args = [*tiny_args, "--data-root", out, "--output-dir", tmp_path / "run", "--epochs", 1]
    assert run([*args, "--data-access", "mmap"]) == 0


def test_mapped_array_pickles_small():
    import pickle

    mapped = MappedArray("/data/v.npy", "<f4", (512, 512, 512), 128)
    assert len(pickle.dumps(mapped)) < 300 and torch is not None


def test_compressed_and_tiled_tiff_are_read_by_strips_and_tiles(tmp_path):
    array = np.arange(16 * 64 * 48, dtype=np.float32).reshape(16, 64, 48)
    tifffile.imwrite(tmp_path / "tiled.tif", array, tile=(32, 32), compression="zlib")
    tifffile.imwrite(tmp_path / "strips.tif", array, compression="zlib", photometric="minisblack")
    window = (slice(2, 11), slice(10, 50), slice(5, 41, 2))
    for name in ("tiled.tif", "strips.tif"):
        region = open_mapped(tmp_path / name)
        assert type(region).__name__ == "TiffRegion" and region.shape == array.shape
        assert np.array_equal(region[window], array[window])
        assert sum(b - a for a, b in region.slabs()) == array.shape[0]


def test_zarr_and_ome_zarr_are_read_by_region(tmp_path):
    import zarr

    from app.data.volume_io import VolumeMeta, read_volume, write_volume, zarr_array

    array = np.arange(12 * 20 * 24, dtype=np.float32).reshape(12, 20, 24)
    write_volume(tmp_path / "a.zarr", array, VolumeMeta(".zarr"))
    write_volume(tmp_path / "a.zarr", array + 1, VolumeMeta(".zarr"))  # replaced whole
    assert np.array_equal(read_volume(tmp_path / "a.zarr")[0], array + 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.zarr"]  # no temporaries left
    # an OME-Zarr image: the full-resolution level of its multiscales, chunked and compressed
    group = zarr.open_group(str(tmp_path / "ome.zarr"), mode="w")
    group.create_array("0", shape=array.shape, dtype=array.dtype, chunks=(4, 8, 8))[...] = array
    group.create_array("1", shape=(6, 10, 12), dtype=array.dtype)
    group.attrs["multiscales"] = [{"datasets": [{"path": "0"}, {"path": "1"}]}]
    assert zarr_array(tmp_path / "ome.zarr").shape == array.shape
    window = (slice(1, 9), slice(3, 17), slice(0, 24, 3))
    for name, expected in (("a.zarr", array + 1), ("ome.zarr", array)):
        region = open_mapped(tmp_path / name)
        assert region.shape == (12, 20, 24) and np.array_equal(region[window], expected[window])
    zarr.open_group(str(tmp_path / "plain.zarr"), mode="w")
    with pytest.raises(VolumeError, match="without OME-Zarr multiscales"):
        open_mapped(tmp_path / "plain.zarr")


def test_zarr_data_root_trains_by_patches_like_the_in_memory_path(tmp_path, tiny_args):
    root = write_dataset(tmp_path / "zarr", n_train=2, n_val=1, shape=(20, 36, 40), ext=".zarr")
    memory, _, _ = load_train_val(root, "zscore")
    index_split(root, tmp_path / "index")
    lazy, _, _ = load_mapped_train_val(root, "zscore", 0, tmp_path / "index")
    window = (slice(2, 18), slice(3, 35), slice(5, 37))
    for a, b in zip(memory, lazy):
        np.testing.assert_allclose(a.patch(window)[0], b.patch(window)[0], atol=1e-5)
        assert np.array_equal(a.patch(window)[1], b.patch(window)[1])
    run_dir = tmp_path / "run"
    args = [*tiny_args, "--data-root", root, "--output-dir", run_dir, "--data-access", "mmap"]
    assert run([*args, "--epochs", 1]) == 0
    assert json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])["epoch"] == 1
