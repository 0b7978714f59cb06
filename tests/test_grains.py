"""app.analysis.grains: splitting touching grains, per-grain properties, size distributions,
matching."""

from __future__ import annotations

import csv
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
from skimage.morphology import h_maxima as skimage_h_maxima

from app.analysis import grains
from app.analysis.masks import clean_mask
from app.data.volume_io import VolumeMeta, write_volume

ROOT = Path(__file__).resolve().parents[1]


def spheres(shape, centres, radii, spacing=(1.0, 1.0, 1.0)) -> np.ndarray:
    """Instance map of balls (physical radii; a voxel goes to the ball it is deepest in)."""
    grid = np.stack(np.indices(shape), axis=-1) * np.asarray(spacing)
    best = np.full(shape, np.inf)
    out = np.zeros(shape, np.int32)
    for i, (c, r) in enumerate(zip(centres, radii, strict=True), start=1):
        rho = np.linalg.norm(grid - np.asarray(c) * np.asarray(spacing), axis=-1) / r
        win = (rho <= 1) & (rho < best)
        best[win], out[win] = rho[win], i
    return out


def test_h_maxima_is_skimages():
    from scipy import ndimage

    rng = np.random.default_rng(0)
    for _ in range(3):
        image = ndimage.gaussian_filter(rng.standard_normal((12, 20, 20)), 1.5).astype(np.float32)
        for h in (0.01, 0.05):
            assert np.array_equal(grains.h_maxima(image, h), skimage_h_maxima(image, h) > 0)


def test_touching_spheres_are_recovered_with_their_diameters():
    # a chain and a cluster of touching balls of known radii (centres 0.8-0.9 of r1 + r2 apart)
    centres = [(16, 14, 12), (16, 14, 26.4), (16, 14, 40.5), (16, 31, 20), (16, 31, 34)]
    radii = [7.0, 9.0, 6.5, 8.0, 8.5]
    truth = spheres((32, 48, 52), centres, radii)
    mask = truth > 0
    assert grains.split_grains(mask, grains.GrainParams(h=100)).max() < 5  # touching indeed
    found = grains.split_grains(mask)
    assert found.max() == len(radii)
    match = grains.match_grains(found, truth)
    assert match.matched == 5 and match.merged == 0 and match.split == 0
    table = grains.grain_table(found)
    diameters = sorted(table["diameter_voxels"])
    # the watershed cuts along the distance map's valleys, not the truth's contacts: 6 %
    assert diameters == pytest.approx(sorted(2 * np.array(radii)), rel=0.06)
    assert not table["touches_border"].any()


def test_physical_units_from_anisotropic_spacing():
    spacing = (2.0, 0.5, 0.5)  # mm; the balls are round in mm, flat in voxels
    truth = spheres((16, 48, 80), [(8, 24, 22), (8, 24, 50)], [7.0, 7.5], spacing)
    found = grains.split_grains(truth > 0, spacing=spacing)
    assert found.max() == 2
    table = grains.grain_table(found, spacing=spacing, unit="mm")
    assert table["diameter_mm"] == pytest.approx([14.0, 15.0], rel=0.06)
    assert table["volume_mm3"] == pytest.approx(table["volume_voxels"] * 0.5)
    assert table["centroid_z_mm"] == pytest.approx(table["centroid_z"] * 2.0)


def test_grain_table_columns_on_a_hand_made_map():
    instances = np.zeros((6, 8, 10), np.int32)
    instances[0:2, 0:2, 0:2] = 1  # 8 voxels in the corner: touches the border
    instances[2:5, 3:6, 4:7] = 2  # 27 voxels inside
    image = np.where(instances == 2, 3.0, 1.0).astype(np.float32)
    table = grains.grain_table(instances, image)
    assert list(table["volume_voxels"]) == [8, 27]
    assert list(table["touches_border"]) == [True, False]
    assert table["mean_intensity"] == pytest.approx([1.0, 3.0])
    assert table["diameter_voxels"] == pytest.approx(np.cbrt(6 * np.array([8, 27]) / np.pi))
    assert [table[f"bbox_{a}0"][1] for a in "zyx"] == [2, 3, 4]
    assert [table[f"bbox_{a}1"][1] for a in "zyx"] == [5, 6, 7]
    assert [table[f"centroid_{a}"][1] for a in "zyx"] == pytest.approx([3, 4, 5])


def test_matching_merge_split_missed_and_false_grains():
    true = np.zeros((4, 10, 40), np.int32)
    true[:, :, 0:4] = 1  # found exactly
    true[:, :, 6:10] = 2  # \ merged into one predicted grain (IoU 0.4 each)
    true[:, :, 10:14] = 3  # /
    true[:, :, 16:25] = 4  # split into three predicted grains (IoU 1/3 each)
    true[:, :, 27:31] = 5  # missed
    pred = np.zeros_like(true)
    pred[:, :, 0:4] = 7  # ids need not be consecutive
    pred[:, :, 5:15] = 2
    pred[:, :, 16:19] = 3
    pred[:, :, 19:22] = 4
    pred[:, :, 22:25] = 9
    pred[:, :, 34:38] = 5  # a false grain
    match = grains.match_grains(pred, true)
    assert (match.n_pred, match.n_true) == (6, 5)
    assert match.matched == 1 and match.pairs[0][2] == 1.0
    assert match.merged == 1 and match.split == 1
    assert match.scores == pytest.approx(
        {"object_precision": 1 / 6, "object_recall": 1 / 5, "object_f1": 2 / 11}
    )
    # IoU exactly 0.5 is a match, one to one: the second half finds no partner
    halves = np.zeros((2, 2, 8), np.int32)
    halves[:, :, 0:4], halves[:, :, 4:8] = 1, 2
    whole = (halves > 0).astype(np.int32)
    match = grains.match_grains(halves, whole)
    assert match.matched == 1 and match.split == 1 and match.merged == 0
    assert grains.match_grains(whole, halves).merged == 1
    assert grains.object_scores(0, 0, 0)["object_f1"] == 1.0
    assert grains.object_scores(0, 3, 0)["object_precision"] == 0.0


def test_size_distribution_by_number_and_by_volume():
    diameters = np.array([1.0, 2.0, 3.0, 4.0, 10.0])
    psd = grains.size_distribution(diameters)
    assert psd["count"] == 5
    assert psd["by_number"]["d50"] == 3.0
    # volume shares: 1, 8, 27, 64, 1000 of 1100: 90 % of the volume is in the 10-grain
    assert psd["by_volume"]["d10"] == 10.0 and psd["by_volume"]["d90"] == 10.0
    errors = grains.distribution_error(diameters + 1, diameters)
    assert errors["d50_error"] == pytest.approx(1.0)
    assert errors["wasserstein"] == pytest.approx(1.0)
    assert grains.distribution_error(diameters, np.array([]))["wasserstein"] is None
    assert grains.size_distribution(np.array([]))["by_number"]["d50"] is None


def test_synthetic_grains_touch_and_the_watershed_separates_most(tmp_path):
    spec = importlib.util.spec_from_file_location("synth", ROOT / "datasets/make_synthetic.py")
    synth = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(synth)
    volume = synth.make_grain_volume((24, 64, 64), np.random.default_rng(3))
    assert np.array_equal(volume.instances > 0, volume.label > 0)
    truth = grains.drop_small(volume.instances.astype(np.int64), 20)
    components = grains.drop_small(grains.label_components(volume.label > 0, connectivity=1), 20)
    assert components.max() < truth.max() / 3  # most grains touch another
    match = grains.match_grains(grains.split_grains(volume.label > 0), truth)
    assert match.scores["object_f1"] > 0.8  # 0.90 over the demo's 3 val volumes


def test_bad_inputs_are_named(tmp_path, capsys):
    probs = np.random.default_rng(0).random((6, 8, 8)).astype(np.float32)
    with pytest.raises(grains.GrainError, match="--threshold"):
        grains.as_mask(probs, "p.npy")
    assert grains.as_mask(probs, "p.npy", 0.5).sum() == (probs > 0.5).sum()
    with pytest.raises(grains.GrainError, match="shape"):
        grains.match_grains(np.zeros((2, 2, 2), int), np.zeros((2, 2, 3), int))
    with pytest.raises(grains.GrainError, match="--min-size"):
        grains.GrainParams(min_size=0)
    with pytest.raises(grains.GrainError, match="--h"):
        grains.GrainParams(h=0)

    src = tmp_path / "pred"
    src.mkdir()
    write_volume(src / "a_probs.npy", probs, VolumeMeta(".npy"))
    code = grains.main(["--input", str(src), "--output", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and "a_probs.npy" in err and "--threshold" in err
    code = grains.main(["--input", str(tmp_path / "none"), "--output", str(tmp_path / "out")])
    assert code == 2 and "none" in capsys.readouterr().err


def test_cli_writes_tables_summary_and_picture(tmp_path, capsys):
    spacing = (0.01, 0.01, 0.01)
    truth = spheres((20, 30, 44), [(10, 15, 12), (10, 15, 27)], [6.0, 7.0])
    meta = VolumeMeta(".nii.gz", affine=np.diag([*spacing, 1.0]))
    (tmp_path / "pred").mkdir()
    (tmp_path / "images").mkdir()
    write_volume(tmp_path / "pred" / "v_mask.nii.gz", (truth > 0).astype(np.uint8), meta)
    write_volume(tmp_path / "pred" / "v_probs.nii.gz", np.zeros(truth.shape, np.float32), meta)
    write_volume(tmp_path / "images" / "v.nii.gz", (truth * 1.0).astype(np.float32), meta)
    out = tmp_path / "grains"
    args = ["--input", str(tmp_path / "pred"), "--output", str(out), "--save-instances"]
    assert grains.main([*args, "--images", str(tmp_path / "images")]) == 0
    summary = json.loads((out / "grains.json").read_text())
    assert summary["unit"] == "mm" and summary["pooled"]["count"] == 2
    rows = list(csv.DictReader((out / "v_grains.csv").open()))
    assert len(rows) == 2
    assert float(rows[0]["diameter_mm"]) == pytest.approx(0.12, rel=0.06)
    assert sorted(float(r["mean_intensity"]) for r in rows) == pytest.approx([1, 2], abs=0.1)
    assert (out / "psd.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / "v_grains.nii.gz").is_file()
    capsys.readouterr()
    assert grains.main(args) == 2  # outputs exist: refused, nothing replaced
    assert "--overwrite" in capsys.readouterr().err
    assert grains.main([*args, "--overwrite"]) == 0


def test_clean_mask_removes_specks_and_fills_cavities():
    mask = np.zeros((12, 12, 12), bool)
    mask[1:3, 1:3, 1] = True  # a 4-voxel speck
    mask[4:11, 4:11, 4:11] = True
    mask[6:9, 6:9, 6:9] = False  # an enclosed cavity of 27 voxels
    assert np.array_equal(clean_mask(mask), mask)  # off by default
    cleaned = clean_mask(mask, min_object_size=5)
    assert cleaned.sum() == mask.sum() - 4
    filled = clean_mask(mask, min_object_size=5, fill_holes=True)
    assert filled.sum() == 7**3 and filled[4:11, 4:11, 4:11].all()


def test_cli_pools_mixed_units_in_voxels_and_keeps_out_of_its_input(tmp_path, capsys):
    truth = spheres((20, 30, 44), [(10, 15, 12), (10, 15, 27)], [6.0, 7.0])
    mask = (truth > 0).astype(np.uint8)
    (tmp_path / "pred").mkdir()
    nifti = VolumeMeta(".nii.gz", affine=np.diag([0.01, 0.01, 0.01, 1.0]))
    write_volume(tmp_path / "pred" / "a_mask.nii.gz", mask, nifti)
    write_volume(tmp_path / "pred" / "b_mask.npy", mask, VolumeMeta(".npy"))
    out = tmp_path / "out"
    assert grains.main(["--input", str(tmp_path / "pred"), "--output", str(out)]) == 0
    summary = json.loads((out / "grains.json").read_text())
    assert [v["unit"] for v in summary["volumes"]] == ["mm", "voxel"]
    assert summary["unit"] == "voxel" and summary["pooled"]["count"] == 4
    assert summary["pooled"]["by_number"]["d90"] > 10  # voxels, not mm
    pred = str(tmp_path / "pred")
    assert grains.main(["--input", pred, "--output", pred]) == 2
    assert "input folder" in capsys.readouterr().err
