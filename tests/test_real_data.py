"""bench/real_data.py: the MNI152 task's layout on a downsampled template, and the pieces of the
``train`` mode that read metrics.jsonl (the training run itself is a benchmark, not tested)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from app.analysis.floor import Floor, Floors
from app.data.dataset import load_split
from app.data.volume_io import VolumeMeta, read_volume, write_volume

ROOT = Path(__file__).resolve().parents[1]


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_real_data", ROOT / "bench/real_data.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_real_data"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


real_data = load_bench()


def test_write_gives_the_trainer_layout(tmp_path, capsys):
    pytest.importorskip("nilearn")
    out = tmp_path / "mni"
    assert real_data.main(["write", "--out", str(out), "--slabs", "2", "--stride", "6"]) == 0
    printed = capsys.readouterr().out
    train = load_split(out, "train", "zscore")
    val = load_split(out, "val", "zscore")
    assert [v.name for v in train] == ["mni152_z000_006", "mni152_z006_013"]  # inferior
    assert len(val) == 2 and all(v.name.startswith("mni152_z") for v in val)
    # z (superior) is the depth axis; the halves tile it without overlap
    depths = [v.image.shape[0] for v in train + val]
    assert sum(depths) == 26  # 155 cropped slices, every 6th
    assert all(v.image.shape[1:] == train[0].image.shape[1:] for v in val)
    assert all(set(np.unique(v.label)) <= {0, 1} and v.label.any() for v in train + val)
    # the affine keeps each slab's place: world z (superior) grows from train to val
    world_z = [read_volume(v.image_path)[1].affine[2, 3] for v in train + val]
    assert world_z == sorted(world_z) and len(set(world_z)) == 4
    for mode in ("zscore", "percentile", "dataset", "raw"):
        assert f"images {mode}" in printed
    assert printed.count("band ") == 4 and "val Dice 0." in printed
    # a second write refuses to mix, --overwrite replaces
    with pytest.raises(SystemExit, match="--overwrite"):
        real_data.main(["write", "--out", str(out), "--stride", "6"])
    assert real_data.main(["write", "--out", str(out), "--stride", "6", "--overwrite"]) == 0
    assert len(load_split(out, "train", "zscore")) == 4


def test_write_the_white_matter_task(tmp_path, capsys):
    pytest.importorskip("nilearn")
    gm, wm = tmp_path / "gm", tmp_path / "wm"
    assert real_data.main(["write", "--out", str(gm), "--slabs", "1", "--stride", "6"]) == 0
    capsys.readouterr()
    argv = ["write", "--out", str(wm), "--slabs", "1", "--stride", "6", "--tissue", "wm"]
    assert real_data.main(argv) == 0
    assert ", WM " in capsys.readouterr().out
    for split in ("train", "val"):
        (grey,), (white,) = load_split(gm, split, "raw"), load_split(wm, split, "raw")
        np.testing.assert_array_equal(grey.image, white.image)  # the same T1 slabs
        assert white.label.any() and not (grey.label & white.label).any()  # tissues apart
    # white matter is the bright tissue of a T1: brighter on average than grey matter
    assert white.image[white.label > 0].mean() > grey.image[grey.label > 0].mean()


def test_write_the_closed_tissue_mask_task(tmp_path, capsys):
    pytest.importorskip("nilearn")
    gm, mask = tmp_path / "gm", tmp_path / "gm-mask"
    assert real_data.main(["write", "--out", str(gm), "--slabs", "1", "--stride", "6"]) == 0
    argv = ["write", "--out", str(mask), "--slabs", "1", "--stride", "6", "--tissue", "gm-mask"]
    assert real_data.main(argv) == 0
    assert ", GM-MASK " in capsys.readouterr().out
    for split in ("train", "val"):
        (grey,), (closed,) = load_split(gm, split, "raw"), load_split(mask, split, "raw")
        np.testing.assert_array_equal(grey.image, closed.image)
        # probability > 0.2, then closed: everything above 0.5 and more
        assert (closed.label >= grey.label).all() and closed.label.sum() > grey.label.sum()


def test_read_records_skips_a_line_being_written(tmp_path):
    path = tmp_path / "metrics.jsonl"
    assert real_data.read_records(path) == []
    path.write_text(json.dumps({"epoch": 1}) + "\n" + '{"epoch": 2, "di')
    assert real_data.read_records(path) == [{"epoch": 1}]


def test_progress_counts_training_time_and_first_beat():
    progress = real_data.Progress(floor=0.9)
    progress.add({"epoch": 1, "train_time_s": 2.0, "val_time_s": 50.0, "dice": 0.5})
    progress.add({"epoch": 2, "train_time_s": 2.5})  # not validated this epoch
    row = progress.add({"epoch": 3, "train_time_s": 1.5, "dice": 0.95})
    assert progress.train_s == pytest.approx(6.0) and not progress.counts_validation
    assert progress.first_beat == (pytest.approx(6.0), 3, 0.95)
    assert "+0.0500" in row
    progress.add({"epoch": 4, "epoch_time_s": 3.0, "dice": 0.97})  # an older trainer's record
    assert progress.train_s == pytest.approx(9.0) and progress.counts_validation
    assert progress.first_beat[1] == 3


def test_the_plot_shows_the_run_whole_and_around_the_floor(tmp_path):
    floors = Floors(
        Floor("threshold", 0.5, None, 0.84, 0.69),
        Floor("band", 0.47, 0.76, 0.96, 0.9535),
        Floor("otsu", 0.34, None, 0.81, 0.67),
    )
    rows = [(10.0, 1, 0.67), (20.0, 2, None), (30.0, 3, 0.958)]  # epoch 2 was not validated
    path = tmp_path / "plots" / "curve.png"
    real_data.plot_curve(path, rows, floors, "raw", 300.0, "a title", 0.962, (30.0, 0.963))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert Image.open(path).size[0] > 1.5 * Image.open(path).size[1]  # two panels side by side


def tiny_task_and_run(tmp_path, seed=0):
    """A 2+2-volume data root at tmp_path/data and a 4-epoch run dir at tmp_path/run."""
    rng = np.random.default_rng(seed)
    for split in ("train_patches", "val_patches"):
        for name in ("a", "b"):
            image = rng.random((4, 8, 8)).astype(np.float32)
            for kind, array in (("images", image), ("labels", (image > 0.6).astype(np.uint8))):
                path = tmp_path / "data" / split / kind / f"{name}.npy"
                path.parent.mkdir(parents=True, exist_ok=True)
                write_volume(path, array, VolumeMeta(".npy"))
    run = tmp_path / "run"
    run.mkdir()
    records = [{"epoch": e, "train_time_s": 10.0, "dice": 0.5 + e / 10} for e in range(1, 5)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run


def test_plot_draws_a_run_again_up_to_its_budget(tmp_path, capsys):
    run = tiny_task_and_run(tmp_path)
    png = tmp_path / "curve.png"
    argv = ["plot", "--run", str(run), "--data", str(tmp_path / "data"), "--plot", str(png)]
    assert real_data.main([*argv, "--budget-s", "25"]) == 0
    assert "3 epochs, 30.0 s of training" in capsys.readouterr().out  # stops once 25 s is spent
    assert png.read_bytes()[:4] == b"\x89PNG"
    # the learned floor too: fitted on the data's train split, drawn beside the band
    png.unlink()
    assert real_data.main([*argv, "--feature-floor"]) == 0
    out = capsys.readouterr().out
    assert "feature floor (app.learned_floor, " in out and "val Dice 0." in out
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert real_data.main([*argv[:2], str(tmp_path / "none"), *argv[3:]]) == 2
    assert "metrics.jsonl does not exist" in capsys.readouterr().err


def test_the_fitted_feature_floor_is_kept_in_the_run_and_drawn_from_there(
    tmp_path, capsys, monkeypatch
):
    run = tiny_task_and_run(tmp_path, seed=1)
    fitted = real_data.feature_floor_dice(tmp_path / "data", "raw", run)
    assert "feature floor (app.learned_floor, raw images" in capsys.readouterr().out
    kept = json.loads((run / "learned_floor.json").read_text())
    assert kept["val_dice"] == fitted and kept["settings"]["normalization"] == "raw"
    drawn = {}
    monkeypatch.setattr(
        real_data, "plot_curve", lambda *a: drawn.update(learned=a[6]), raising=True
    )
    argv = ["plot", "--run", str(run), "--data", str(tmp_path / "data"), "--plot", "x.png"]
    assert real_data.main(argv) == 0
    assert drawn["learned"] == fitted  # read from the run, not fitted again
    assert "feature floor (app.learned_floor" not in capsys.readouterr().out
    assert real_data.main(["summary", str(run)]) == 0
    assert f"{fitted:.4f}" in capsys.readouterr().out
    (run / "learned_floor.json").write_text("{not json")
    assert real_data.main(argv) == 2
    assert "learned_floor.json: unreadable" in capsys.readouterr().err


def test_the_mirrored_score_of_best_pt_comes_from_eval_json_or_an_eval_only(tmp_path, monkeypatch):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text("tta: false\n")
    assert real_data.mirrored_score(run, 2, ["--plan", "auto"]) is None  # not asked for
    (run / "eval.json").write_text(json.dumps({"epoch": 2, "tta": False, "dice": 0.9}))
    assert real_data.mirrored_score(run, 2, []) is None  # an unmirrored --eval-only's report
    (run / "eval.json").unlink()
    (run / "config.yaml").write_text("tta: true\n")
    assert real_data.mirrored_score(run, 2, ["--plan", "auto"]) is None  # no best.pt yet
    best = run / "checkpoints" / "best.pt"
    best.write_bytes(b"")
    launched = []

    def eval_only(command, **kwargs):  # the budget stopped the trainer before its own scoring
        launched.append(command)
        (run / "eval.json").write_text(json.dumps({"epoch": 7, "tta": True, "dice": 0.97}))

    monkeypatch.setattr(real_data.subprocess, "run", eval_only)
    scored = real_data.mirrored_score(run, 2, ["--plan", "auto", "--resume", "none"])
    assert scored == {"epoch": 7, "tta": True, "dice": 0.97}
    assert launched[0][0] == "bash" and launched[0][-3:] == ["--eval-only", "--resume", str(best)]
    # a trainer that ended by itself wrote eval.json: read, nothing launched
    assert real_data.mirrored_score(run, 2, []) == scored and len(launched) == 1


def write_run(run: Path, dices: list[float | None], mirrored: float | None = None) -> Path:
    """A run dir as the trainer leaves it: one record per epoch of 10 s and 50 patches."""
    run.mkdir(parents=True)
    records = [
        {"epoch": epoch, "train_time_s": 10.0, "samples_per_s": 5.0}
        | ({} if dice is None else {"dice": dice})
        for epoch, dice in enumerate(dices, start=1)
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if mirrored is not None:
        (run / "eval.json").write_text(json.dumps({"tta": True, "dice": mirrored}))
    return run


def test_summary_sets_runs_side_by_side_against_the_floor(tmp_path, capsys):
    a = write_run(tmp_path / "a", [0.90, None, 0.96, 0.95, 0.94, 0.93], mirrored=0.9625)
    b = write_run(tmp_path / "b", [0.91, 0.97, 0.96, 0.94])
    (b / "learned_floor.json").write_text(json.dumps({"val_dice": 0.969}))
    assert real_data.main(["summary", str(a), str(b), "--floor", "0.965"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines()}
    # a: 6 epochs, 60 s, 300 patches, best 0.96 at 30 s; settled = mean of epochs 4-6
    assert rows["a"][1:8] == ["6", "60", "0.3k", "0.9600", "30", "0.9400", "0.9360"]
    assert rows["a"][8:] == ["0.9625", "0.9650", "-0.0025"]  # scored mirrored
    assert rows["b"][4:] == ["0.9700", "20", "0.9500", "0.9450", "-", "0.9650", "+0.0050"]
    assert rows["mean"][1:] == ["0.9650", "0.9450", "0.9405", "-"]  # b has no eval.json
    assert "within 0.003 of the learned floor: 2 of 2 runs; above it: 1" in out
    # without --floor, each run's learned_floor.json; a run without one is not judged
    assert real_data.main(["summary", str(a), str(b), "--budget-s", "15"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines()}
    assert rows["b"][1:3] == ["2", "20"] and rows["b"][-2:] == ["0.9690", "+0.0010"]
    assert rows["a"][-2:] == ["-", "-"] and "floor: 1 of 1 runs" in out


def test_summary_names_a_run_dir_it_cannot_read(tmp_path, capsys):
    assert real_data.main(["summary", str(tmp_path / "nowhere")]) == 2
    assert f"no metrics.jsonl in {tmp_path / 'nowhere'}" in capsys.readouterr().err
    write_run(tmp_path / "early", [None, None])
    assert real_data.main(["summary", str(tmp_path / "early")]) == 2
    assert "early/metrics.jsonl: no validation recorded" in capsys.readouterr().err
    run = write_run(tmp_path / "floorless", [0.9])
    (run / "learned_floor.json").write_text("{")
    assert real_data.main(["summary", str(run)]) == 2
    assert "floorless/learned_floor.json: unreadable" in capsys.readouterr().err
