"""app.analysis.evaluate against an independent computation: coordinate sets and brute-force
HD95."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest
from scipy.spatial.distance import cdist

from app.analysis import evaluate
from app.data.volume_io import VolumeMeta, write_volume

SPACING = (0.5, 0.8, 1.25)


def random_mask(shape, rng, fill=0.35) -> np.ndarray:
    """Random blobs: a thresholded smoothed noise field, so surfaces are irregular."""
    from scipy import ndimage

    field = ndimage.gaussian_filter(rng.normal(size=shape), 1.0)
    return field > np.quantile(field, 1 - fill)


def brute_surface(mask: np.ndarray) -> np.ndarray:
    """Coordinates of foreground voxels with a background (or outside) face neighbour."""
    padded = np.pad(mask, 1)
    points = []
    for z, y, x in zip(*np.nonzero(mask)):
        z1, y1, x1 = z + 1, y + 1, x + 1
        neighbours = [
            padded[z1 - 1, y1, x1],
            padded[z1 + 1, y1, x1],
            padded[z1, y1 - 1, x1],
            padded[z1, y1 + 1, x1],
            padded[z1, y1, x1 - 1],
            padded[z1, y1, x1 + 1],
        ]
        if not all(neighbours):
            points.append((z, y, x))
    return np.array(points, dtype=float).reshape(-1, 3)


def brute_hd95(pred: np.ndarray, label: np.ndarray, spacing=(1.0, 1.0, 1.0)) -> float:
    a, b = brute_surface(pred) * spacing, brute_surface(label) * spacing
    if len(a) == 0 and len(b) == 0:
        return 0.0
    if len(a) == 0 or len(b) == 0:
        return math.inf
    d = cdist(a, b)
    return max(np.percentile(d.min(1), 95), np.percentile(d.min(0), 95))


def brute_scores(pred: np.ndarray, label: np.ndarray) -> dict[str, float]:
    p = {tuple(c) for c in np.argwhere(pred)}
    t = {tuple(c) for c in np.argwhere(label)}
    tp, fp, fn = len(p & t), len(p - t), len(t - p)
    if not p and not t:
        return {"tp": 0, "fp": 0, "fn": 0, "dice": 1.0, "iou": 1.0, "precision": 1.0, "recall": 1.0}
    return {
        "tp": tp,
        "fp": fp,
        "fn": fn,
        "dice": 2 * tp / (len(p) + len(t)),
        "iou": tp / len(p | t),
        "precision": tp / len(p) if p else 0.0,
        "recall": tp / len(t) if t else 0.0,
    }


def write_pair(
    root: Path, name: str, pred, label, ext=".nii.gz", pred_name=None, spacing=SPACING
) -> None:
    affine = np.diag([*spacing, 1.0])
    for folder in ("pred", "labels"):
        (root / folder).mkdir(parents=True, exist_ok=True)
    write_volume(
        root / "pred" / f"{pred_name or name + '_mask'}{ext}", pred, VolumeMeta(ext, affine=affine)
    )
    write_volume(root / "labels" / f"{name}{ext}", label, VolumeMeta(ext, affine=affine))


def run(root: Path, capsys, *extra) -> tuple[int, dict | None, str]:
    out = root / "eval.json"
    code = evaluate.main(
        [
            "--pred",
            str(root / "pred"),
            "--labels",
            str(root / "labels"),
            "--out",
            str(out),
            *map(str, extra),
        ]
    )
    captured = capsys.readouterr()
    summary = json.loads(out.read_text()) if code == 0 else None
    return code, summary, captured.err if code else captured.out


def test_figures_match_an_independent_computation(tmp_path, capsys):
    rng = np.random.default_rng(0)
    shapes = [(7, 9, 11), (8, 8, 8), (6, 10, 9)]
    masks = {}
    for i, shape in enumerate(shapes):
        label = random_mask(shape, rng)
        pred = label.copy()
        pred[rng.random(shape) < 0.15] ^= True  # flip some voxels: FP, FN and odd surfaces
        masks[f"v{i}"] = (pred, label)
        # float probabilities for one volume: thresholded at 0.5
        value = (pred * 0.9 + 0.05).astype(np.float32) if i == 1 else pred.astype(np.uint8)
        write_pair(
            tmp_path,
            f"v{i}",
            value,
            label.astype(np.uint8) * 255 if i == 2 else label.astype(np.uint8),
        )
    code, summary, _ = run(tmp_path, capsys)
    assert code == 0
    assert summary["hd95_unit"] == "mm" and summary["hd95_excluded"] == 0
    rows = {r["name"]: r for r in summary["volumes"]}
    for name, (pred, label) in masks.items():
        expected = brute_scores(pred, label)
        for key, value in expected.items():
            assert rows[name][key] == pytest.approx(value, abs=1e-12), (name, key)
        assert rows[name]["hd95"] == pytest.approx(brute_hd95(pred, label, SPACING), rel=1e-6)
    for key in ("dice", "iou", "precision", "recall", "hd95"):
        values = [rows[n][key] for n in masks]
        assert summary["mean"][key] == pytest.approx(np.mean(values))
        assert summary["median"][key] == pytest.approx(np.median(values))
    totals = {k: sum(rows[n][k] for n in masks) for k in ("tp", "fp", "fn")}
    assert summary["global"]["dice"] == pytest.approx(
        2 * totals["tp"] / (2 * totals["tp"] + totals["fp"] + totals["fn"])
    )
    assert summary["global"]["iou"] == pytest.approx(
        totals["tp"] / (totals["tp"] + totals["fp"] + totals["fn"])
    )

    with open(tmp_path / "eval.csv", newline="") as f:
        table = list(csv.DictReader(f))
    assert [r["name"] for r in table] == ["v0", "v1", "v2"]
    for r in table:
        assert float(r["dice"]) == pytest.approx(rows[r["name"]]["dice"], rel=1e-5)
        assert float(r["hd95"]) == pytest.approx(rows[r["name"]]["hd95"], rel=1e-5)


def test_voxel_units_for_tiff_and_on_request(tmp_path, capsys):
    rng = np.random.default_rng(1)
    label = random_mask((6, 12, 12), rng)
    pred = np.roll(label, 2, axis=2)
    write_pair(tmp_path / "tif", "a", pred.astype(np.uint8), label.astype(np.uint8), ext=".tif")
    code, summary, _ = run(tmp_path / "tif", capsys)
    assert code == 0 and summary["hd95_unit"] == "voxel"
    assert summary["volumes"][0]["hd95"] == pytest.approx(brute_hd95(pred, label))

    write_pair(tmp_path / "nii", "a", pred.astype(np.uint8), label.astype(np.uint8))
    code, summary, _ = run(tmp_path / "nii", capsys, "--spacing", "voxel")
    assert code == 0 and summary["hd95_unit"] == "voxel"
    assert summary["volumes"][0]["hd95"] == pytest.approx(brute_hd95(pred, label))


def test_empty_masks(tmp_path, capsys):
    shape = (5, 6, 7)
    empty = np.zeros(shape, np.uint8)
    blob = np.zeros(shape, np.uint8)
    blob[1:4, 2:5, 2:6] = 1
    write_pair(tmp_path, "both_empty", empty, empty)
    write_pair(tmp_path, "missed", empty, blob)  # prediction empty
    write_pair(tmp_path, "hallucinated", blob, empty)  # label empty
    write_pair(tmp_path, "perfect", blob, blob)
    code, summary, stdout = run(tmp_path, capsys)
    assert code == 0 and "2 volume(s) with HD95 = inf left out" in stdout
    rows = {r["name"]: r for r in summary["volumes"]}
    assert {k: rows["both_empty"][k] for k in evaluate.METRICS} == {
        "dice": 1.0,
        "iou": 1.0,
        "precision": 1.0,
        "recall": 1.0,
        "hd95": 0.0,
    }
    for name in ("missed", "hallucinated"):
        assert rows[name]["dice"] == rows[name]["iou"] == 0.0
        assert rows[name]["precision"] == rows[name]["recall"] == 0.0
        assert rows[name]["hd95"] is None  # inf, written as null
    assert rows["perfect"]["hd95"] == 0.0 and rows["perfect"]["dice"] == 1.0
    assert summary["hd95_excluded"] == 2
    assert summary["mean"]["hd95"] == 0.0 and summary["median"]["hd95"] == 0.0
    assert summary["mean"]["dice"] == pytest.approx(0.5)
    # global: summed counts, tp 36 (perfect), fp 36 (hallucinated), fn 36 (missed)
    assert summary["global"]["dice"] == pytest.approx(2 * 36 / (2 * 36 + 36 + 36))
    table = (tmp_path / "eval.csv").read_text()
    assert ",inf," in table


def test_naming_variants(tmp_path, capsys):
    mask = np.zeros((4, 5, 6), np.uint8)
    mask[1:3, 1:4, 2:5] = 1
    write_pair(tmp_path, "plain", mask, mask, pred_name="plain")  # NAME.ext
    write_pair(tmp_path, "both", mask, mask)  # NAME_mask.ext, next to NAME_probs.ext
    write_volume(
        tmp_path / "pred" / "both_probs.nii.gz",
        np.zeros((4, 5, 6), np.float32),
        VolumeMeta(".nii.gz", affine=np.eye(4)),
    )
    write_pair(
        tmp_path, "probs_only", mask.astype(np.float32) * 0.8, mask, pred_name="probs_only_probs"
    )
    code, summary, _ = run(tmp_path, capsys)
    assert code == 0
    rows = {r["name"]: r for r in summary["volumes"]}
    assert rows["both"]["prediction"].endswith("both_mask.nii.gz")
    assert rows["probs_only"]["prediction"].endswith("probs_only_probs.nii.gz")
    assert all(r["dice"] == 1.0 for r in rows.values())


def test_missing_extra_and_mismatched_files(tmp_path, capsys):
    mask = np.ones((4, 5, 6), np.uint8)
    write_pair(tmp_path, "good", mask, mask)
    write_pair(tmp_path, "gone", mask, mask)
    (tmp_path / "pred" / "gone_mask.nii.gz").unlink()
    write_volume(tmp_path / "pred" / "stray_mask.nii.gz", mask, VolumeMeta(".nii.gz"))
    code, _, err = run(tmp_path, capsys)
    assert code == 2
    assert str(tmp_path / "labels" / "gone.nii.gz") in err and "no prediction" in err
    assert str(tmp_path / "pred" / "stray_mask.nii.gz") in err and "without a label" in err

    (tmp_path / "pred" / "stray_mask.nii.gz").unlink()
    write_volume(
        tmp_path / "pred" / "gone_mask.nii.gz", np.ones((4, 5, 7), np.uint8), VolumeMeta(".nii.gz")
    )
    code, _, err = run(tmp_path, capsys)
    assert code == 2 and "gone_mask.nii.gz" in err and "(4, 5, 7)" in err and "(4, 5, 6)" in err

    write_volume(tmp_path / "pred" / "gone.nii.gz", mask, VolumeMeta(".nii.gz"))
    code, _, err = run(tmp_path, capsys)
    assert code == 2 and "two predictions" in err


def test_bad_values_and_flags(tmp_path, capsys):
    mask = np.ones((4, 5, 6), np.uint8)
    write_pair(tmp_path, "a", mask * 7, mask)
    code, _, err = run(tmp_path, capsys)
    assert code == 2 and "a_mask.nii.gz" in err and "binary" in err

    code = evaluate.main(
        [
            "--pred",
            str(tmp_path / "pred"),
            "--labels",
            str(tmp_path / "labels"),
            "--out",
            str(tmp_path / "eval.txt"),
        ]
    )
    assert code == 2 and ".json" in capsys.readouterr().err
    code = evaluate.main(
        [
            "--pred",
            str(tmp_path / "nowhere"),
            "--labels",
            str(tmp_path / "labels"),
            "--out",
            str(tmp_path / "e.json"),
        ]
    )
    assert code == 2 and "nowhere" in capsys.readouterr().err


def test_help_documents_the_empty_policy():
    text = " ".join(evaluate.build_parser().format_help().split())
    assert "HD95 = inf" in text and "null" in text and "Empty in both" in text
    assert "HD95 = inf" in evaluate.__doc__ or "HD95 = inf" in " ".join(evaluate.__doc__.split())


def test_grain_figures_against_instance_maps(tmp_path, capsys):
    from test_grains import spheres

    # three touching balls; the prediction merges the last two: a cylinder as thick as they are
    # fills their neck, so the distance map has no valley there
    truth = spheres((20, 24, 60), [(10, 12, 10), (10, 12, 26), (10, 12, 41)], [7.0, 7.5, 7.0])
    z, y, x = np.indices(truth.shape)
    pred = (truth > 0) | (((z - 10) ** 2 + (y - 12) ** 2 <= 7.5**2) & (x >= 26) & (x <= 41))
    write_pair(tmp_path, "v", pred.astype(np.uint8), (truth > 0).astype(np.uint8))
    (tmp_path / "instances").mkdir()
    write_volume(
        tmp_path / "instances" / "v.nii.gz",
        truth.astype(np.uint16),
        VolumeMeta(".nii.gz", affine=np.diag([*SPACING, 1.0])),
    )
    code, summary, out = run(tmp_path, capsys)  # instances/ beside labels/ is found
    assert code == 0
    row, figures = summary["volumes"][0], summary["grains"]
    assert figures["truth"].startswith("instance maps in") and "instances" in figures["truth"]
    assert (row["true_grains"], row["pred_grains"], row["matched_grains"]) == (3, 2, 1)
    assert row["merged_grains"] == 1 and row["split_grains"] == 0
    assert row["grain_count_error"] == -1 and row["grain_unit"] == "mm"
    assert row["object_f1"] == pytest.approx(2 * 1 / 5)
    assert figures["object_f1"] == pytest.approx(0.4) and figures["d50_error"] > 0
    assert "object F1 0.4000" in out and "1 merged" in out
    table = list(csv.DictReader((tmp_path / "eval.csv").open()))
    assert table[0]["merged_grains"] == "1" and float(table[0]["object_f1"]) == pytest.approx(0.4)

    # without instance maps the label's own watershed is the truth: it finds the 3 balls
    code, summary, _ = run(tmp_path, capsys, "--instances", tmp_path / "labels_ws")
    assert code == 2 and summary is None  # no such folder
    (tmp_path / "instances" / "v.nii.gz").rename(tmp_path / "v_instances.nii.gz")
    code, summary, _ = run(tmp_path, capsys)
    assert code == 2 and "no volumes" in capsys.readouterr().err + _
    (tmp_path / "instances").rmdir()
    code, summary, _ = run(tmp_path, capsys)
    assert summary["grains"]["truth"] == "watershed of the labels"
    assert summary["grains"]["true_grains"] == 3
    code, summary, _ = run(tmp_path, capsys, "--no-grains")
    assert code == 0 and "grains" not in summary and "object_f1" not in summary["volumes"][0]
    assert "object_f1" not in (tmp_path / "eval.csv").read_text()


def test_bad_instance_maps_are_named(tmp_path, capsys):
    mask = np.zeros((6, 8, 8), np.uint8)
    mask[1:5, 2:6, 2:6] = 1
    write_pair(tmp_path, "a", mask, mask)
    write_pair(tmp_path, "b", mask, mask)
    folder = tmp_path / "inst"
    folder.mkdir()
    write_volume(folder / "a.nii.gz", mask.astype(np.float32), VolumeMeta(".nii.gz"))
    code, _, err = run(tmp_path, capsys, "--instances", folder)
    assert code == 2 and "b.nii.gz: no instance map b.*" in err
    write_volume(folder / "b.nii.gz", np.ones((6, 8, 9), np.uint8), VolumeMeta(".nii.gz"))
    code, _, err = run(tmp_path, capsys, "--instances", folder)
    assert code == 2
    assert str(folder / "a.nii.gz") in err and "integer ids" in err
    assert str(folder / "b.nii.gz") in err and "(6, 8, 9)" in err
    code, _, err = run(tmp_path, capsys, "--grain-h", "0")
    assert code == 2 and "--grain-h" in err
    code, _, err = run(tmp_path, capsys, "--grain-min-size", "0")
    assert code == 2 and "--grain-min-size must be at least 1" in err
