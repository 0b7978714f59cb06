"""The learned floor (``app.analysis.learned_floor``): the filters, the floor against the band it
must beat, the held-in (leave-one-out) scoring, the command and its JSON, its errors, the
report's line, and the bench wrapper."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
from helpers import phase_volume, write_dataset
from scipy import ndimage

from app.analysis import filter_features, report
from app.analysis import learned_floor as ff
from app.analysis.floor import classical_floors
from app.data.dataset import load_split
from app.data.volume_io import VolumeMeta, write_volume

ROOT = Path(__file__).resolve().parents[1]
FEW = ["--samples-per-volume", "2000"]  # a small sample: tiny volumes, seconds per fit


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
    feats = filter_features.filter_features(image)
    names = filter_features.filter_names()
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
    found = ff.learned_floor(*zip(*train), *zip(*val), samples_per_volume=4000)
    assert found.val_dice > band + 0.15, (found.val_dice, band)
    assert found.val_dice > 0.8
    assert found.leave_one_out is None


def test_leave_one_out_scores_each_val_volume_with_its_neighbours_in_training():
    """Val volumes on another intensity offset than train: the plain floor fails on them; the
    held-in one, fitted with the other val volume, does not."""
    rng = np.random.default_rng(2)
    train = [noisy_spheres(rng, noise=0.3) for _ in range(2)]
    val = [noisy_spheres(rng, noise=0.3, shift=3.0) for _ in range(2)]
    found = ff.learned_floor(*zip(*train), *zip(*val), leave_one_out=True, samples_per_volume=4000)
    assert [s.name for s in found.leave_one_out] == ["val 0", "val 1"]
    held_in = ff.global_dice(found.leave_one_out)
    assert found.val_dice < 0.6 and held_in > 0.9, (found.val_dice, held_in)


def test_bad_inputs_name_what_is_wrong():
    image = np.zeros((4, 4, 4), np.float32)
    with pytest.raises(ValueError, match=r"training volume 0: image .* label .* differ"):
        ff.learned_floor([image], [np.zeros((4, 4, 5), bool)], [image], [image > 0])
    with pytest.raises(ValueError, match="one class only"):
        ff.learned_floor([image], [image > 0], [image], [image > 0])
    with pytest.raises(ValueError, match="no validation volumes"):
        ff.learned_floor([image], [image > 0], [], [])


@pytest.fixture(scope="module")
def data_root(tmp_path_factory) -> Path:
    return write_dataset(tmp_path_factory.mktemp("floor") / "data", 2, 1, shape=(8, 24, 24))


def a_run(tmp_path: Path, data: Path, **config) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    config = {"data_root": str(data), "normalization": "zscore", "seed": 0, **config}
    (run / "config.yaml").write_text("".join(f"{k}: {v}\n" for k, v in config.items()))
    records = [{"epoch": e, "dice": 0.5 + e / 10, "floor_dice": 0.61} for e in (1, 2, 3)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run


def test_the_command_writes_the_floor_of_a_run_where_the_report_draws_it(
    tmp_path, data_root, capsys
):
    run = a_run(tmp_path, data_root)
    assert ff.main(["--run", str(run), *FEW]) == 0  # the data root and settings: the run's
    out = capsys.readouterr().out
    assert "<- the learned floor" in out and "peak memory" in out and "wrote " in out
    saved = json.loads((run / "learned_floor.json").read_text())
    assert 0.0 <= saved["val_dice"] <= 1.0 and 0.0 <= saved["train_dice"] <= 1.0
    assert saved["leave_one_out_dice"] is None
    assert saved["settings"] == {
        "data_root": str(data_root),
        "normalization": "zscore",
        "seed": 0,
        "samples_per_volume": 2000,
        "leave_one_out": False,
    }
    assert saved["data"] == {
        "train_volumes": 2,
        "val_volumes": 1,
        "train_voxels": 2 * 8 * 24 * 24,
        "val_voxels": 8 * 24 * 24,
        "largest_volume": [8, 24, 24],
    }
    assert saved["voxels_sampled"] == 2 * 2000 and 1 <= saved["trees"] <= ff.TREES
    assert saved["fit_s"] > 0 and saved["seconds"]["total"] >= saved["fit_s"]
    assert saved["peak_memory_mib"] > 10 and "ru_maxrss" in saved["peak_memory_source"]
    assert saved["features"] == filter_features.filter_names() and len(saved["features"]) == 22
    assert [v["name"] for v in saved["volumes"]["val"]] == ["vol_00"]
    # the report's curves: the model's val Dice with the classical and the learned floor
    lines = {
        line.get_label(): line.get_ydata() for line in report.curves_of_run(run).axes[1].get_lines()
    }
    learned = [k for k in lines if k.startswith("learned floor")]
    assert len(learned) == 1 and list(lines[learned[0]]) == [saved["val_dice"]] * 2
    assert list(lines["classical floor 0.610"]) == [0.61, 0.61]
    assert report.main([str(run), "--volumes", "0"]) == 0
    assert (run / "report" / "curves.png").is_file()


def test_without_its_json_the_report_draws_no_learned_floor(tmp_path, data_root):
    run = a_run(tmp_path, data_root)
    labels = [line.get_label() for line in report.curves_of_run(run).axes[1].get_lines()]
    assert "Dice" in labels and not any(k.startswith("learned floor") for k in labels)
    (run / "learned_floor.json").write_text("{not json")
    with pytest.raises(report.ReportError, match=r"learned_floor\.json: unreadable"):
        report.curves_of_run(run)


def test_the_floor_beats_chance_on_an_easy_data_root(tmp_path, capsys):
    """Blobs a little brighter than a noisy background: the trees find them; predicting every
    voxel foreground (chance for Dice) scores about 2 p / (1 + p), p the foreground share."""
    root = write_dataset(tmp_path / "data", 2, 1, shape=(8, 24, 24), seed=3)
    assert ff.main(["--data-root", str(root), "--normalization", "raw", *FEW]) == 0
    out = capsys.readouterr().out
    dice = float(out.split("val   global Dice ")[1].split()[0])
    share = load_split(root, "val", "raw")[0].label.mean()
    assert dice > 0.85 and dice > 2 * share / (1 + share) + 0.2, (dice, share)


def test_bad_inputs_are_errors_naming_the_flag_or_file(tmp_path, data_root, capsys):
    def error(argv) -> str:
        assert ff.main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and "Traceback" not in err
        return err

    assert "missing" in error(["--data-root", str(tmp_path / "missing")])
    (tmp_path / "empty").mkdir()
    assert "train_patches" in error(["--data-root", str(tmp_path / "empty")])
    assert "--data-root" in error([])
    assert "--run" in error(["--data-root", str(data_root), "--run", str(tmp_path / "nowhere")])
    assert not (tmp_path / "nowhere").exists()
    run = a_run(tmp_path, data_root, num_classes=3)
    assert "config.yaml: num_classes 3" in error(["--run", str(run)])
    assert "--samples-per-volume" in error(
        ["--data-root", str(data_root), "--samples-per-volume", "0"]
    )
    # a multi-class data root: its labels are not binary
    phases = tmp_path / "phases"
    rng = np.random.default_rng(0)
    for split in ("train_patches", "val_patches"):
        image, label = phase_volume((6, 12, 12), rng, 3)
        for kind, array in (("images", image), ("labels", label)):
            (phases / split / kind).mkdir(parents=True)
            write_volume(phases / split / kind / "a.npy", array, VolumeMeta(".npy"))
    assert "multi-class" in error(["--data-root", str(phases)])
    # a failed fit leaves the run's earlier result as it was
    run = tmp_path / "run"
    (run / "learned_floor.json").write_text('{"val_dice": 0.5}')
    (run / "config.yaml").write_text(f"data_root: {phases}\n")
    assert "multi-class" in error(["--run", str(run)])
    assert (run / "learned_floor.json").read_text() == '{"val_dice": 0.5}'


def test_the_bench_wrapper_keeps_its_flags(tmp_path, data_root, capsys):
    spec = importlib.util.spec_from_file_location("bench_ff", ROOT / "bench/feature_floor.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--data", str(data_root), *FEW]) == 0
    assert "raw images" in capsys.readouterr().out
    assert bench.main(["--data=" + str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "missing" in err
