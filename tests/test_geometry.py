"""Voxels with a size: each format's geometry read and written back (through app.predict), an
image and its label refused by name when their grids differ (in training and in app.evaluate),
the synthetic generator's --spacing, and grain sizes of a TIFF stack in its unit."""

import json
import logging
import shutil
import subprocess
import sys

import numpy as np
import pytest
from helpers import ROOT, blob_volume, write_dataset
from test_predict import make_checkpoint

from app import evaluate as evaluate_cli
from app import grains as grains_cli
from app import predict as predict_cli
from app.data.dataset import DataError, load_split
from app.data.geometry import Geometry, mismatches, spacing_spread
from app.data.volume_io import VolumeError, VolumeMeta, read_volume, volume_geometry, write_volume

MICRO_CT = Geometry(spacing=(3.0, 0.5, 0.5), unit="um", origin=(10.0, -4.0, 2.5))
TILTED = np.array(
    [[0.0, -0.6, 0.8, 5.0], [0.0, 0.8, 0.6, -2.0], [-1.5, 0.0, 0.0, 7.0], [0, 0, 0, 1.0]]
)  # NIfTI: axis 0 along -z (1.5 mm), axes 1 and 2 rotated in the x-y plane (1 mm)


def meta_for(ext: str) -> VolumeMeta:
    if ext == ".nii.gz":
        return VolumeMeta(ext, affine=TILTED)
    return VolumeMeta(ext, geometry=MICRO_CT, ome=ext == ".ome.zarr")


FORMATS = {  # file extension -> what the format keeps of MICRO_CT / TILTED
    ".nii.gz": Geometry.from_affine(TILTED, "mm"),
    ".tif": Geometry(spacing=MICRO_CT.spacing, unit="um"),  # ImageJ: no origin
    ".zarr": MICRO_CT,  # plain array: this app's geometry attribute
    ".ome.zarr": MICRO_CT,  # an OME-Zarr image: scale and translation
    ".npy": Geometry(),
}


def write(path, array, ext):
    meta = meta_for(ext)
    meta.ext = ".zarr" if ext.endswith("zarr") else ext
    write_volume(path, array, meta)


def close(a: Geometry, b: Geometry) -> bool:
    return a.unit == b.unit and not mismatches(a, b) and (a.spacing is None) == (b.spacing is None)


@pytest.mark.parametrize("ext", list(FORMATS))
def test_each_format_reads_back_its_geometry(tmp_path, ext):
    path = tmp_path / f"v{'.zarr' if ext.endswith('zarr') else ext}"
    write(path, np.zeros((4, 6, 8), np.float32), ext)
    array, meta = read_volume(path)
    assert array.shape == (4, 6, 8)
    assert close(meta.grid, FORMATS[ext]), meta.grid
    assert meta.ome == (ext == ".ome.zarr")
    shape, header_only = volume_geometry(path)
    assert shape == (4, 6, 8) and header_only == meta.grid


@pytest.mark.parametrize("ext", [".nii.gz", ".tif", ".zarr", ".ome.zarr"])
def test_predict_writes_each_output_on_its_inputs_grid(tmp_path, ext, capsys):
    stored = ".zarr" if ext.endswith("zarr") else ext
    inputs = tmp_path / "in"
    inputs.mkdir()
    image, _ = blob_volume((16, 24, 24), np.random.default_rng(0))
    write(inputs / f"vol{stored}", image * 100 + 1000, ext)
    checkpoint = make_checkpoint(tmp_path / "model.pt")
    code = predict_cli.main(
        ["--checkpoint", str(checkpoint), "--input", str(inputs), "--output", str(tmp_path / "o")]
    )
    assert code == 0, capsys.readouterr().err
    for kind in ("probs", "mask"):
        _, meta = read_volume(tmp_path / "o" / f"vol_{kind}{stored}")
        assert close(meta.grid, FORMATS[ext]), (kind, meta.grid)
        assert meta.ome == (ext == ".ome.zarr")


def test_a_truncated_imagej_stack_is_named_not_read_short(tmp_path):
    path = tmp_path / "cut.tif"
    write(path, np.zeros((8, 16, 16), np.float32), ".tif")
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(VolumeError, match=r"cut.tif: cannot read .tif file, corrupt or truncated"):
        read_volume(path)


# --------------------------------------------------------------------------------------------
# Images and labels on one grid

MISMATCHES = {  # what the label's file says instead of the image's, and the phrase expected
    "spacing": (np.diag([1.0, 1.0, 1.0, 1.0]), "spacing (0.5, 0.5, 0.5) vs (1, 1, 1) mm"),
    "origin": (
        np.array([[0.5, 0, 0, 4.0], [0, 0.5, 0, 0], [0, 0, 0.5, 0], [0, 0, 0, 1]]),
        "origin",
    ),
    "orientation": (np.diag([-0.5, 0.5, 0.5, 1.0]), "orientation"),
}


def relabel(root, affine=None, shape=None, ext=".nii.gz"):
    """Rewrite train vol_00's label with another affine or shape (the voxels kept or cut)."""
    path = root / "train_patches/labels/vol_00.nii.gz"
    label, meta = read_volume(path)
    if shape is not None:
        label = label[: shape[0], : shape[1], : shape[2]]
    path.unlink()
    target = path.with_name(f"vol_00{ext}")
    write_volume(target, label, VolumeMeta(ext, affine=meta.affine if affine is None else affine))
    return target


@pytest.mark.parametrize("kind", [*MISMATCHES, "shape"])
def test_training_refuses_a_label_on_another_grid_naming_both_files(tmp_path, kind):
    root = write_dataset(tmp_path / "d", n_train=2, n_val=1)  # 0.5 mm, origin 0
    if kind == "shape":
        relabel(root, shape=(16, 32, 30))
        phrase = "shape (16, 32, 32) vs (16, 32, 30)"
    else:
        affine, phrase = MISMATCHES[kind]
        relabel(root, affine)
    with pytest.raises(DataError) as err:
        load_split(root, "train", "zscore")
    message = str(err.value)
    assert "images/vol_00.nii.gz: its label" in message and "labels/vol_00.nii.gz" in message
    assert "lies on another grid" in message and phrase in message, message
    assert "vol_01" not in message


def test_every_mismatch_of_a_pair_and_every_pair_is_reported_at_once(tmp_path):
    root = write_dataset(tmp_path / "d", n_train=2, n_val=1)
    relabel(root, np.diag([1.0, 1.0, -1.0, 1.0]))
    path = root / "train_patches/labels/vol_01.nii.gz"
    label, _ = read_volume(path)
    path.unlink()
    write_volume(path, label, VolumeMeta(".nii.gz", affine=np.diag([0.5, 0.5, 0.7, 1.0])))
    with pytest.raises(DataError) as err:
        load_split(root, "train", "zscore")
    first, second = str(err.value).splitlines()
    assert "spacing" in first and "orientation" in first and "vol_00" in first
    assert "spacing (0.5, 0.5, 0.5) vs (0.5, 0.5, 0.7)" in second and "vol_01" in second


def test_a_label_without_geometry_takes_its_images(tmp_path):
    root = write_dataset(tmp_path / "d", n_train=1, n_val=1)
    path = root / "train_patches/labels/vol_00.nii.gz"
    label, _ = read_volume(path)
    path.unlink()
    write_volume(path.with_name("vol_00.npy"), label, VolumeMeta(".npy"))
    (volume,) = load_split(root, "train", "zscore")
    assert volume.grid.spacing == (0.5, 0.5, 0.5)


def test_the_mmap_path_refuses_a_label_on_another_grid(tmp_path):
    from app.data.lazy import index_split

    root = write_dataset(tmp_path / "d", n_train=2, n_val=1, ext=".npy")
    image, _ = read_volume(root / "train_patches/images/vol_00.npy")
    label, _ = read_volume(root / "train_patches/labels/vol_00.npy")
    for kind, array, grid in (("images", image, MICRO_CT), ("labels", label, Geometry())):
        (root / f"train_patches/{kind}/vol_00.npy").unlink()
        write_volume(
            root / f"train_patches/{kind}/vol_00.tif", array, VolumeMeta(".tif", geometry=grid)
        )
    index_split(root, tmp_path / "index")  # a label with no geometry: the image's
    label_path = root / "train_patches/labels/vol_00.tif"
    label_path.unlink()
    other = Geometry(spacing=(1.0, 0.5, 0.5), unit="um")
    write_volume(label_path, label, VolumeMeta(".tif", geometry=other))
    with pytest.raises(DataError, match=r"vol_00.tif lies on another grid: spacing \(3, 0.5"):
        index_split(root, tmp_path / "index")


def test_spacings_far_apart_are_warned_about_with_the_range(tmp_path, caplog):
    root = write_dataset(tmp_path / "d", n_train=2, n_val=1)
    for kind in ("images", "labels"):
        path = root / f"train_patches/{kind}/vol_01.nii.gz"
        array, _ = read_volume(path)
        path.unlink()
        write_volume(path, array, VolumeMeta(".nii.gz", affine=np.diag([2.0, 2.0, 2.0, 1.0])))
    with caplog.at_level(logging.WARNING, logger="app.data"):
        load_split(root, "train", "zscore")
    assert "voxel sizes range from 0.5 to 2 mm" in caplog.text
    near = [Geometry((1.0, 1.0, 1.0), "mm"), Geometry((1.5, 1.5, 1.5), "mm")]
    assert spacing_spread(near) is None


def test_units_are_converted_before_comparing():
    in_mm = Geometry(spacing=(0.003, 0.0005, 0.0005), unit="mm")
    assert mismatches(MICRO_CT, in_mm) == []
    assert mismatches(MICRO_CT, Geometry(spacing=(3.0, 0.5, 0.5), unit="mm"))


def test_evaluate_refuses_a_prediction_on_another_grid(tmp_path, capsys):
    rng = np.random.default_rng(0)
    _, label = blob_volume((8, 16, 16), rng)
    for folder, affine in (("pred", np.diag([0.5, 0.5, 0.5, 1.0])), ("labels", np.eye(4))):
        (tmp_path / folder).mkdir()
        write_volume(tmp_path / folder / "a.nii.gz", label, VolumeMeta(".nii.gz", affine=affine))
    code = evaluate_cli.main(
        ["--pred", str(tmp_path / "pred"), "--labels", str(tmp_path / "labels"),
         "--out", str(tmp_path / "e.json"), "--no-grains"]
    )  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2
    assert "pred/a.nii.gz: its label" in err and "spacing (0.5, 0.5, 0.5) vs (1, 1, 1) mm" in err


# --------------------------------------------------------------------------------------------
# Synthetic data with a voxel size, and grains in its unit


@pytest.mark.parametrize("fmt", ["nii.gz", "tif"])
def test_make_synthetic_writes_its_spacing_and_scans_grains_by_it(tmp_path, fmt):
    out = tmp_path / "s"
    cmd = [sys.executable, str(ROOT / "datasets/make_synthetic.py"), "--out", str(out),
           "--n-train", "1", "--n-val", "1", "--shape", "24", "48", "48",
           "--format", fmt]  # fmt: skip
    subprocess.run([*cmd, "--spacing", "0.03", "0.01", "0.01"], check=True, capture_output=True)
    _, meta = read_volume(out / f"train_patches/images/grain_000.{fmt}")
    _, label_meta = read_volume(out / f"train_patches/labels/grain_000.{fmt}")
    assert meta.grid.spacing == pytest.approx((0.03, 0.01, 0.01)) and meta.grid.unit == "mm"
    assert mismatches(meta.grid, label_meta.grid) == []
    # a grain three times as thick in z as in y: its runs of voxels along z are shorter
    label, _ = read_volume(out / f"train_patches/labels/grain_000.{fmt}")
    thick = run_lengths(label, axis=0)
    square = run_lengths(label, axis=1)
    assert thick < 0.55 * square, (thick, square)
    iso = tmp_path / "iso"
    subprocess.run([*cmd[:3], str(iso), *cmd[4:]], check=True, capture_output=True)
    iso_label, _ = read_volume(iso / f"train_patches/labels/grain_000.{fmt}")
    assert 0.8 < run_lengths(iso_label, axis=0) / run_lengths(iso_label, axis=1) < 1.25


def run_lengths(mask: np.ndarray, axis: int) -> float:
    """Mean length of the foreground runs along ``axis``."""
    m = np.moveaxis(mask != 0, axis, -1).reshape(-1, mask.shape[axis]).astype(np.int8)
    starts = np.diff(np.pad(m, ((0, 0), (1, 0))), axis=1) == 1
    return float(m.sum() / starts.sum())


def test_grain_sizes_of_a_tiff_stack_are_in_its_unit(tmp_path, capsys):
    mask = np.zeros((12, 24, 24), np.uint8)
    mask[2:8, 4:12, 4:12] = 1
    mask[3:9, 14:22, 12:20] = 1
    (tmp_path / "in").mkdir()
    write_volume(tmp_path / "in/a_mask.tif", mask, VolumeMeta(".tif", geometry=MICRO_CT))
    code = grains_cli.main(["--input", str(tmp_path / "in"), "--output", str(tmp_path / "g")])
    assert code == 0, capsys.readouterr().err
    summary = json.loads((tmp_path / "g/grains.json").read_text())
    assert "um" in json.dumps(summary)
    header = (tmp_path / "g/a_grains.csv").read_text().splitlines()[0]
    assert "diameter_um" in header.replace("equivalent_", ""), header
    shutil.rmtree(tmp_path / "g")
