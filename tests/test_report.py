"""Report pictures: the montage function, the TensorBoard montage, and the report of a run."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from helpers import blob_volume, train_tiny, write_dataset

from app.analysis import figures, report
from app.engine.tracking import montage
from app.engine.validation import SliceSample, pick_slices


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("report")
    return train_tiny(write_dataset(root / "data", n_train=3, n_val=3), root / "run")


def colour_present(rgb: np.ndarray, hex_colour: str, tolerance: int = 40) -> bool:
    target = np.array([int(hex_colour[i : i + 2], 16) for i in (1, 3, 5)])
    return bool((np.abs(rgb.astype(int) - target).sum(-1) < tolerance).any())


def test_montage_figure_is_an_rgb_array_with_both_outlines():
    image, label = blob_volume((16, 32, 32), np.random.default_rng(0))
    prediction = np.roll(label, 3, axis=2)
    rgb = figures.montage_figure(image, label, prediction, "vol: Dice 0.5", n_slices=4)
    # 4 panels of 2.4 in in one row, 0.08 in gaps; 0.45 in title, 0.25 in captions, 0.35 legend
    assert rgb.dtype == np.uint8 and rgb.shape == (345, 1000, 3)
    assert colour_present(rgb, figures.GROUND_TRUTH_COLOUR)
    assert colour_present(rgb, figures.PREDICTION_COLOUR)

    rgb = figures.montage_figure(image, label, prediction, "eight", n_slices=8)
    assert rgb.shape == (610, 1000, 3)  # two rows of four


def test_montage_of_empty_masks_and_of_odd_shapes():
    image = np.random.default_rng(0).normal(size=(3, 20, 50)).astype(np.float32)
    empty = np.zeros(image.shape, np.uint8)
    rgb = figures.montage_figure(image, empty, empty, "nothing", n_slices=8)
    assert rgb.ndim == 3 and rgb.shape[2] == 3  # 3 slices: one row of three
    assert not colour_present(rgb[:-35], figures.PREDICTION_COLOUR)  # only in the legend
    with pytest.raises(ValueError, match="one shape"):
        figures.montage_figure(image, empty[:2], empty, "bad", 4)


def test_pick_slices_follow_the_foreground():
    label = np.zeros((40, 4, 4), np.uint8)
    label[10:21] = 1
    assert pick_slices(label, label, 3) == [12, 15, 18]  # interior points of [10, 20]
    assert pick_slices(np.zeros((40, 4, 4)), np.zeros((40, 4, 4)), 3) == [10, 20, 29]
    assert pick_slices(label[:3], label[:3], 4) == [0, 1, 2]


def test_tensorboard_montage_from_a_slice_sample():
    image, label = blob_volume((16, 32, 32), np.random.default_rng(1))
    z = pick_slices(label, label, 4)
    sample = SliceSample("vol_00", z, image[z], label[z], label[z], 0.75)
    rgb = montage(sample, epoch=3)
    assert rgb.dtype == np.uint8 and rgb.shape == (345, 1000, 3)


def test_report_of_a_trained_run(trained_run, capsys):
    from matplotlib.image import imread

    assert report.main([str(trained_run), "--volumes", "2", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    folder = trained_run / "report"
    names = sorted(p.name for p in folder.iterdir())
    assert names == [
        "curves.png",
        "grains_vol_00.png",
        "grains_vol_01.png",
        "montage_vol_00.png",
        "montage_vol_01.png",
        "psd.png",
    ]
    for name in names:
        picture = imread(folder / name)
        assert picture.ndim == 3 and picture.shape[0] > 200 and picture.shape[1] > 500
    assert "Dice" in out and "object F1" in out and "d50 error" in out

    dice = [
        float(line.split("Dice ")[1].rstrip(")")) for line in out.splitlines() if "montage_" in line
    ]
    assert len(dice) == 2 and all(0.0 <= d <= 1.0 for d in dice)

    # curves only, from the last checkpoint
    assert report.main([str(trained_run), "--volumes", "0", "--checkpoint", "last"]) == 0


def test_tensorboard_gets_one_montage_per_validation(trained_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(trained_run / "tensorboard"), size_guidance={"images": 0})
    events.Reload()
    tags = events.Tags()["images"]
    assert [t for t in tags if t.startswith("val/")] == ["val/vol_00"]
    assert [e.step for e in events.Images("val/vol_00")] == [1, 2]
    assert events.Images("val/vol_00")[0].width == 1000


def test_report_logs_its_grain_pictures_to_tensorboard(trained_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert report.main([str(trained_run), "--volumes", "1", "--device", "cpu"]) == 0
    events = EventAccumulator(str(trained_run / "tensorboard"), size_guidance={"images": 0})
    events.Reload()
    tags = events.Tags()["images"]
    assert {"report/psd", "report/grains_vol_00"} <= set(tags)
    assert events.Images("report/psd")[-1].step == 2  # the run's last epoch


def test_grain_montage_fills_each_grain_with_its_colour():
    image, label = blob_volume((8, 32, 32), np.random.default_rng(2))
    instances = np.zeros(label.shape, np.int32)
    instances[:, 4:12, 4:12], instances[:, 16:28, 16:28] = 1, 2
    rgb = figures.montage_figure(image, label, label, "grains", 4, instances=instances)
    colours = figures.grain_colours(np.array([1, 2]))
    assert not np.allclose(colours[0], colours[1]) and figures.grain_colours(np.array(0))[3] == 0
    assert not colour_present(rgb[:-35], figures.PREDICTION_COLOUR)  # filled, not outlined


def test_report_errors(tmp_path, capsys):
    assert report.main([str(tmp_path / "nowhere")]) == 2
    assert "nowhere" in capsys.readouterr().err
    (tmp_path / "run").mkdir()
    assert report.main([str(tmp_path / "run")]) == 2
    assert "metrics.jsonl" in capsys.readouterr().err
