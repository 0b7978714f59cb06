"""End-to-end training on CPU in one process: outputs, resume equality, errors, formats."""

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from helpers import BF16, ROOT, TIMING, records, write_dataset

from app.engine.checkpoint import load_checkpoint, remove_stale_temporaries, save_checkpoint
from app.train import main


def run(args):
    return main([str(a) for a in args])


def test_training_writes_the_run_dir(dataset, tmp_path, tiny_args):
    run_dir = tmp_path / "run"
    assert run([*tiny_args, "--data-root", dataset, "--output-dir", run_dir, "--epochs", 2]) == 0
    assert (run_dir / "config.yaml").is_file()
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    rows = records(run_dir)
    assert [r["epoch"] for r in rows] == [1, 2]
    expected = {
        "epoch",
        "train_loss",
        "val_loss",
        "dice",
        "iou",
        "dice_per_volume_mean",
        "lr",
        "epoch_time_s",
        "samples_per_s",
        "world_size",
        "gflop_per_s",
        "peak_gflop_per_s",
        "utilisation",
    }
    assert expected <= set(rows[0]) and rows[0]["world_size"] == 1
    assert 0 < rows[1]["gflop_per_s"] < rows[1]["peak_gflop_per_s"]
    state = torch.load(run_dir / "checkpoints/last.pt", weights_only=True)
    assert state["epoch"] == 2 and state["precision"]["backend"] == "native"
    assert {"model", "optimizer", "scheduler", "rng", "config", "best_dice"} <= set(state)
    assert not any(k.startswith("module.") for k in state["model"])
    best = torch.load(run_dir / "checkpoints/best.pt", weights_only=True)
    assert best["best_dice"] == max(r["dice"] for r in rows)


def test_resume_matches_an_uninterrupted_run(dataset, tmp_path, tiny_args):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    common = [*tiny_args, "--data-root", dataset, "--milestones", 2, "--gamma", 0.5]
    assert run([*common, "--output-dir", straight, "--epochs", 3]) == 0
    assert run([*common, "--output-dir", resumed, "--epochs", 2]) == 0
    assert run([*common, "--output-dir", resumed, "--epochs", 3, "--resume", "auto"]) == 0
    a, b = records(straight), records(resumed)
    assert [r["epoch"] for r in b] == [1, 2, 3]
    for key, value in a[2].items():
        if key not in TIMING:
            assert b[2][key] == pytest.approx(value, abs=1e-6), key
    assert a[2]["lr"] == pytest.approx(a[0]["lr"] * 0.5)  # the milestone is an epoch


def test_resume_drops_records_of_an_epoch_that_was_not_checkpointed(dataset, tmp_path, tiny_args):
    run_dir = tmp_path / "run"
    args = [*tiny_args, "--data-root", dataset, "--output-dir", run_dir]
    assert run([*args, "--epochs", 1]) == 0
    with open(run_dir / "metrics.jsonl", "a") as f:  # killed after logging epoch 2, before saving
        f.write(json.dumps({"epoch": 2, "train_loss": 9.9}) + "\n")
    assert run([*args, "--epochs", 2]) == 0
    rows = records(run_dir)
    assert [r["epoch"] for r in rows] == [1, 2] and rows[1]["train_loss"] != 9.9


def test_eval_only_reports_the_checkpoint_metrics(dataset, tmp_path, tiny_args):
    run_dir = tmp_path / "run"
    args = [*tiny_args, "--data-root", dataset, "--output-dir", run_dir]
    assert run([*args, "--epochs", 2]) == 0
    assert run([*args, "--eval-only"]) == 0
    report = json.loads((run_dir / "eval.json").read_text())
    last = records(run_dir)[-1]
    assert report["epoch"] == 2 and len(report["volumes"]) == 3
    for key in ("dice", "iou", "val_loss"):
        assert report[key] == pytest.approx(last[key], abs=1e-9)


def test_tif_volumes_train_like_nifti(tmp_path, tiny_args):
    data = write_dataset(tmp_path / "tif", ext=".tif")
    run_dir = tmp_path / "run"
    assert run([*tiny_args, "--data-root", data, "--output-dir", run_dir, "--epochs", 1]) == 0
    assert records(run_dir)[0]["dice"] >= 0


def test_scheduler_steps_once_per_epoch_with_warmup(dataset, tmp_path, tiny_args):
    run_dir = tmp_path / "run"
    assert (
        run(
            [
                *tiny_args,
                "--data-root",
                dataset,
                "--output-dir",
                run_dir,
                "--epochs",
                4,
                "--warmup-epochs",
                2,
                "--milestones",
                3,
                "--gamma",
                0.1,
                "--lr",
                0.3,
                "--val-every",
                4,
            ]
        )
        == 0
    )
    lrs = [r["lr"] for r in records(run_dir)]
    assert lrs == pytest.approx([0.1, 0.2, 0.3, 0.03])


def test_resume_none_refuses_to_overwrite_a_run(dataset, tmp_path, tiny_args, capsys):
    run_dir = tmp_path / "run"
    args = [*tiny_args, "--data-root", dataset, "--output-dir", run_dir]
    assert run([*args, "--epochs", 1]) == 0
    before = (run_dir / "checkpoints/last.pt").read_bytes()
    assert run([*args, "--epochs", 2, "--resume", "none"]) == 2
    assert "--resume none" in capsys.readouterr().err
    assert (run_dir / "checkpoints/last.pt").read_bytes() == before


def test_resume_with_other_precision_is_refused(dataset, tmp_path, tiny_args, capsys):
    run_dir = tmp_path / "run"
    args = [*tiny_args, "--data-root", dataset, "--output-dir", run_dir]
    assert run([*args, "--epochs", 1, *BF16]) == 0
    assert run([*args, "--epochs", 2, "--opt-level", "O0"]) == 2
    err = capsys.readouterr().err
    assert "native O1 bfloat16" in err and "--opt-level O1" in err


def test_resume_with_another_model_size_is_refused(dataset, tmp_path, tiny_args, capsys):
    run_dir = tmp_path / "run"
    args = [*tiny_args, "--data-root", dataset, "--output-dir", run_dir]
    assert run([*args, "--epochs", 1]) == 0
    assert run([*args, "--epochs", 2, "--f-maps", 8]) == 2
    err = capsys.readouterr().err
    assert "last.pt: its weights do not fit" in err and "--f-maps 4 --depth 3" in err


@pytest.mark.parametrize(
    ("damage", "fragment"),
    [
        (lambda root: (root / "val_patches/labels/vol_01.nii.gz").unlink(), "vol_01.nii.gz"),
        (
            lambda root: (root / "train_patches/images/vol_00.nii.gz").write_bytes(b"\x1f\x8b00"),
            "vol_00.nii.gz",
        ),
    ],
)
def test_bad_data_exits_non_zero_naming_the_file(tmp_path, tiny_args, capsys, damage, fragment):
    root = write_dataset(tmp_path / "d")
    damage(root)
    assert run([*tiny_args, "--data-root", root, "--output-dir", tmp_path / "run"]) == 2
    err = capsys.readouterr().err
    assert "error: " in err and fragment in err
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_corrupt_checkpoint_is_named(dataset, tmp_path, tiny_args, capsys):
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"garbage")
    args = [*tiny_args, "--data-root", dataset, "--output-dir", tmp_path / "run"]
    assert run([*args, "--resume", bad]) == 2
    assert "bad.pt: not a readable checkpoint" in capsys.readouterr().err


def test_a_checkpoint_killed_while_writing_leaves_the_previous_one(tmp_path):
    path = tmp_path / "last.pt"
    good = {"weights": torch.arange(10.0)}
    save_checkpoint(path, good)
    script = textwrap.dedent(f"""
        import os, signal, torch
        from app.atomic import atomic_write
        def write(f):
            f.write(b"partial checkpoint bytes" * 1000)
            f.flush()
            os.kill(os.getpid(), signal.SIGKILL)  # dies halfway through the write
        atomic_write({str(path)!r}, write)
    """)
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT)
    assert result.returncode == -signal.SIGKILL
    assert torch.equal(torch.load(path, weights_only=True)["weights"], good["weights"])
    leftovers = remove_stale_temporaries(tmp_path)  # what the trainer does at start
    assert len(leftovers) == 1 and sorted(p.name for p in tmp_path.iterdir()) == ["last.pt"]


def test_load_checkpoint_checks_the_contents(tmp_path):
    path = tmp_path / "other.pt"
    torch.save({"state_dict": {}}, path)
    with pytest.raises(RuntimeError, match="not a checkpoint of this trainer"):
        load_checkpoint(path)


def test_help_runs_without_torch_initialising_anything():
    out = subprocess.run(
        [sys.executable, "-m", "app.train", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ},
        check=True,
    ).stdout
    assert "--data-root" in out and "--resume" in out and "--eval-only" in out


@pytest.mark.parametrize(("mode", "factor"), [("none", 1.0), ("linear", 8.0), ("sqrt", 8**0.5)])
def test_lr_scaling_by_world_size(mode, factor):
    from app.config import Config
    from app.engine.steps import scaled_lr

    assert scaled_lr(Config(lr=1e-3, lr_scaling=mode), world_size=8) == pytest.approx(1e-3 * factor)


def test_tensorboard_gets_scalars_montages_and_hparams(dataset, tmp_path, tiny_args):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = tmp_path / "run"
    assert run([*tiny_args, "--data-root", dataset, "--output-dir", run_dir, "--epochs", 2]) == 0
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"images": 0})
    events.Reload()
    tags = events.Tags()
    assert {"train_loss", "val_loss", "dice", "iou", "lr"} <= set(tags["scalars"])
    assert [e.step for e in events.Scalars("dice")] == [1, 2]
    assert tags["images"] == ["val/vol_00"] and len(events.Images("val/vol_00")) == 2
    assert "config/text_summary" in tags["tensors"]
    assert {"hparam/dice", "hparam/iou"} <= set(tags["scalars"])
    assert "_hparams_/session_start_info" in events.PluginTagToContent("hparams")


@pytest.mark.parametrize(
    "options",
    [
        ["--val-mode", "patches"],
        ["--normalization", "percentile"],
        ["--opt-level", "O0"],
        ["--no-augment", "--foreground-fraction", "1.0"],
    ],
)
def test_training_options_run_end_to_end(dataset, tmp_path, tiny_args, options):
    run_dir = tmp_path / "run"
    argv = [*tiny_args, "--data-root", dataset, "--output-dir", run_dir, "--epochs", 1, *options]
    assert run(argv) == 0
    record = records(run_dir)[0]
    assert 0.0 <= record["dice"] <= 1.0 and record["train_loss"] > 0
