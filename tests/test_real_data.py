"""bench/real_data.py: the MNI152 task's layout on a downsampled template, and the pieces of the
``train`` mode that read metrics.jsonl (the training run itself is a benchmark, not tested)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from app.data import load_split
from app.volume_io import read_volume

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
