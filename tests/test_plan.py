"""The planner: its choices for hand-written fingerprints, its fingerprint of real files, and
``--plan auto`` in the trainer."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
import yaml

from app.config import Config, load_config_and_given
from app.data.volume_io import VolumeMeta, write_volume
from app.plan import (
    CPU_MAX_PATCH_VOXELS,
    REFERENCE_PATCH,
    STEP_OVERHEAD,
    DataFingerprint,
    DeviceFingerprint,
    apply_plan,
    data_fingerprint,
    depth_for,
    fit_patch,
    main,
    make_plan,
)

SLABS = DataFingerprint(  # MNI152-like: 4 thin slabs whose tissue mix differs
    train_shapes=[(19, 181, 145)] * 4,
    val_shapes=[(20, 181, 145)] * 4,
    spacing=(1.0, 1.0, 1.0),
    intensity={"p0.5": 0.0, "p50": 0.2, "p99.5": 0.9, "mean": 0.28, "std": 0.34},
    foreground_fraction=0.2,
    band_dice={"zscore": 0.815, "percentile": 0.915, "dataset": 0.965},
)
CT = DataFingerprint(  # IronGrain-like: large CT volumes, one tissue mix
    train_shapes=[(74, 320, 320)] * 20,
    val_shapes=[(74, 320, 320)] * 5,
    spacing=None,
    intensity={"p0.5": -1.2, "p50": 0.0, "p99.5": 3.0, "mean": 0.0, "std": 1.0},
    foreground_fraction=0.3,
    band_dice={"zscore": 0.90, "percentile": 0.899, "dataset": 0.905},
)
CPU = DeviceFingerprint("cpu", memory_gb=24, processes=1, step_s=0.05)
H100 = DeviceFingerprint("cuda", memory_gb=80, processes=8, step_s=0.01)


def test_cpu_plan_for_slabs():
    plan = make_plan(SLABS, CPU, budget_s=300)
    v = plan.values
    assert v["normalization"] == "dataset"  # 0.965 vs 0.815: per-volume z-scores break the band
    assert v["batch_size"] == 2 and v["norm"] == "none" and v["f_maps"] == 8
    # Adam 3e-3 with no norm layer spiked and collapsed in 900 s runs; clipped at 2, it did not
    assert v["lr"] == 3e-3 and v["grad_clip"] == 2.0
    # MultiStepLR halves the rate at each milestone (level with 0.2 on MNI152, over the floor more)
    assert v["gamma"] == 0.5 and "halves" in plan.reasons["gamma"]
    # no norm layer re-centres a ReLU's inputs: leaky ReLU keeps the units that would die
    assert v["activation"] == "leaky_relu" and "never fired" in plan.reasons["activation"]
    # 0.05 s at 16x64x64 measured, 0.1 s wanted: 2x the reference voxels, capped (more steps
    # beat larger patches on CPU), and no larger than the volumes (19 -> 24 deep at most)
    assert v["patch_size"][0] <= 24 and all(p % 8 == 0 for p in v["patch_size"])
    voxels = math.prod(v["patch_size"])
    assert 0.6 * CPU_MAX_PATCH_VOXELS <= voxels <= CPU_MAX_PATCH_VOXELS
    assert "capped" in plan.reasons["patch_size"]
    # a CPU 4x slower gets half the reference voxels, for the same 0.1 s step
    slow = make_plan(SLABS, dataclasses.replace(CPU, step_s=0.2), budget_s=300)
    slow_voxels = math.prod(slow.values["patch_size"])
    assert 0.6 * math.prod(REFERENCE_PATCH) / 2 <= slow_voxels <= math.prod(REFERENCE_PATCH) / 2
    assert "capped" not in slow.reasons["patch_size"]
    assert slow.values["samples_per_volume"] < 0.6 * v["samples_per_volume"]  # about half the steps
    # pooled while every axis keeps 4 voxels: 16 deep -> 3 levels (4 would leave 2, where
    # oneDNN's bf16 weight gradient fails on Zen 4)
    assert 2 ** (v["depth"] - 1) * 4 <= min(v["patch_size"]) < 2 ** v["depth"] * 4
    assert v["block"] == "residual"  # measured ahead of plain on these slabs
    # the epochs fill the budget, the milestones are fractions of them
    scaled = CPU.step_s * voxels / math.prod(REFERENCE_PATCH)
    assert plan.step_s == pytest.approx(scaled * STEP_OVERHEAD)
    epoch_s = v["samples_per_volume"] * 4 / 2 * plan.step_s
    assert v["epochs"] * epoch_s == pytest.approx(300, rel=0.1)
    assert v["milestones"] == [round(0.6 * v["epochs"]), round(0.85 * v["epochs"])]
    assert v["val_every"] >= 1
    assert v["tta"] is True  # best.pt scored mirrored at the end: never lower on MNI152
    # one intensity scale with uniform patches: flips at every budget, the intensities untouched
    assert v["augment"] is True and v["augment_level"] == "flips"
    assert make_plan(SLABS, CPU, budget_s=3600).values["augment_level"] == "flips"
    assert set(plan.reasons) == set(v) and all(plan.reasons.values())


def test_gpu_plan_for_ct():
    plan = make_plan(CT, H100, budget_s=3600)
    v = plan.values
    assert v["normalization"] == "zscore"  # dataset gains less than the margin
    assert v["batch_size"] == 8 and v["norm"] == "batch" and v["f_maps"] == 32
    assert v["activation"] == "relu"  # BatchNorm before it: the original recipe's ReLU
    assert "grad_clip" not in v  # measured on CPU plans only: off, the default
    assert "gamma" not in v  # likewise: the recipe's 0.2
    assert math.prod(v["patch_size"]) <= 32 * 160 * 160 and v["depth"] == 4
    assert v["block"] == "residual"
    assert v["patch_size"][0] <= 80  # never deeper than the volumes (74, rounded up to 8)
    assert v["epochs"] >= 1 and v["milestones"][-1] <= v["epochs"]
    assert v["augment"] is True and v["augment_level"] == "basic"
    # per-volume z-scores on a CPU: no augmentation in 5 minutes, the basic level in an hour
    assert make_plan(CT, CPU, budget_s=300).values["augment"] is False
    assert make_plan(CT, CPU, budget_s=3600).values["augment_level"] == "basic"


def test_patches_are_drawn_uniformly_unless_the_foreground_is_rare():
    # 20% of the voxels: uniform patches see what validation sees (MNI152: +0.003-0.004 Dice)
    common = make_plan(SLABS, CPU, budget_s=300)
    assert common.values["foreground_fraction"] == 0.0
    assert "20% of the training voxels" in common.reasons["foreground_fraction"]
    rare = make_plan(dataclasses.replace(SLABS, foreground_fraction=0.01), CPU, budget_s=300)
    assert rare.values["foreground_fraction"] == Config().foreground_fraction == 0.33
    assert "only 1.0%" in rare.reasons["foreground_fraction"]
    # the mild gamma measured better only with the patches centred on foreground
    assert common.values["augment_level"] == "flips"
    assert rare.values["augment_level"] == "gamma"
    # a given --foreground-fraction is kept
    cfg, given = load_config_and_given(["--foreground-fraction", "0.5"])
    assert apply_plan(cfg, given, common).foreground_fraction == 0.5


def test_the_plan_builds_on_the_settings_given():
    planned = make_plan(SLABS, CPU, budget_s=300).values
    # the augmentation follows a given foreground share, as it follows the plan's own
    oversampled = make_plan(SLABS, CPU, budget_s=300, given={"foreground_fraction": 0.33})
    assert oversampled.values["augment_level"] == "gamma"
    assert oversampled.reasons["foreground_fraction"].startswith("given; the plan's own: 0.0")
    rare = dataclasses.replace(SLABS, foreground_fraction=0.01)
    uniform = make_plan(rare, CPU, budget_s=300, given={"foreground_fraction": 0.0})
    assert uniform.values["augment_level"] == "flips"
    # the milestones are fractions of the given epochs, not of the plan's
    assert planned["epochs"] != 40
    assert make_plan(SLABS, CPU, 300, given={"epochs": 40}).values["milestones"] == [24, 34]
    # a batch large enough for BatchNorm's statistics gets it
    batch8 = make_plan(SLABS, CPU, 300, given={"batch_size": 8}).values
    assert batch8["norm"] == "batch" and batch8["activation"] == "relu"
    # a given norm decides the activation too, and a given activation is kept
    assert make_plan(SLABS, CPU, 300, given={"norm": "instance"}).values["activation"] == "relu"
    kept = make_plan(SLABS, CPU, 300, given={"activation": "relu"})
    assert kept.values["activation"] == "relu"
    assert kept.reasons["activation"].startswith("given; the plan's own: 'leaky_relu'")
    assert make_plan(SLABS, CPU, 300, given={"gamma": 0.2}).values["gamma"] == 0.2
    # a given patch: the pooling and the epoch's length are the ones of that patch
    small = make_plan(SLABS, CPU, 300, given={"patch_size": [16, 32, 32]})
    assert small.values["patch_size"] == [16, 32, 32] and small.values["depth"] == 3
    assert small.values["samples_per_volume"] > 2 * planned["samples_per_volume"]
    # a given value the plan would also choose keeps the plan's reason
    same = make_plan(SLABS, CPU, 300, given={"batch_size": 2})
    assert same.reasons["batch_size"] == make_plan(SLABS, CPU, 300).reasons["batch_size"]
    # only what the plan chooses is kept with it (a checkpoint holds plain data)
    assert make_plan(SLABS, CPU, 300, given={"data_root": "d", "epochs": 9}).given == {"epochs": 9}


def test_validation_cadence_follows_its_cost():
    cheap = make_plan(SLABS, CPU, budget_s=300).values["val_every"]
    many_val = DataFingerprint(**{**SLABS.__dict__, "val_shapes": [(20, 181, 145)] * 40})
    assert make_plan(many_val, CPU, budget_s=300).values["val_every"] > cheap


def test_fit_patch_keeps_the_median_shape_when_it_fits():
    assert fit_patch((20, 40, 40), 1e9) == (24, 40, 40)
    assert fit_patch((74, 320, 320), 65536)[0] >= 16
    assert math.prod(fit_patch((74, 320, 320), 65536)) <= 65536


def test_plan_yaml_is_a_config(tmp_path):
    plan = make_plan(SLABS, CPU, budget_s=300)
    path = tmp_path / "plan.yaml"
    path.write_text(plan.to_yaml("header line"))
    text = path.read_text()
    assert text.count("\n# ") >= len(plan.values)  # one reason line per choice
    assert yaml.safe_load(text) == plan.values
    cfg, given = load_config_and_given(["--config", str(path), "--f-maps", "16"])
    assert cfg.normalization == "dataset" and cfg.f_maps == 16
    assert set(plan.values) <= given


def test_apply_plan_keeps_given_settings():
    plan = make_plan(SLABS, CPU, budget_s=300)
    cfg = apply_plan(Config(batch_size=3), frozenset({"batch_size"}), plan)
    assert cfg.batch_size == 3 and cfg.norm == "none"
    assert cfg.patch_size == tuple(plan.values["patch_size"])


def write_split(root, split, volumes, rng):
    for i, (image, label) in enumerate(volumes):
        meta = VolumeMeta(".nii.gz", affine=np.diag([2.0, 0.5, 0.5, 1.0]))
        write_volume(root / split / "images" / f"v{i}.nii.gz", image, meta)
        write_volume(root / split / "labels" / f"v{i}.nii.gz", label, meta)


def test_data_fingerprint_of_files(tmp_path):
    rng = np.random.default_rng(0)
    volumes = []
    # the same three tissues in a different mix: GM of the first volume and WM of the second
    # get the same per-volume z-score, so no band separates GM there; one dataset scale does
    for columns in ((10, 3, 3), (0, 3, 13)):  # background, grey matter, white matter
        tissue = np.repeat([0.0, 0.5, 1.0], columns)
        image = np.broadcast_to(tissue, (8, 16, 16)).astype(np.float32)
        label = np.broadcast_to(tissue == 0.5, (8, 16, 16)).astype(np.uint8)
        volumes.append((image + rng.normal(0, 0.01, image.shape).astype(np.float32), label))
    write_split(tmp_path, "train_patches", volumes, rng)
    write_split(tmp_path, "val_patches", volumes[:1], rng)
    data = data_fingerprint(tmp_path)
    assert data.train_shapes == [(8, 16, 16)] * 2 and data.val_shapes == [(8, 16, 16)]
    assert data.spacing == pytest.approx((2.0, 0.5, 0.5))
    assert data.foreground_fraction == pytest.approx(6 / 32)
    assert data.band_dice["dataset"] == pytest.approx(1.0)
    assert data.band_dice["zscore"] < 0.9
    plan = make_plan(data, CPU, budget_s=60)
    assert plan.values["normalization"] == "dataset"


def test_plan_cli_writes_a_config(tmp_path, dataset, capsys):
    out = tmp_path / "plan.yaml"
    torch.manual_seed(0)
    assert main(["--data-root", str(dataset), "--budget-s", "60", "--out", str(out)]) == 0
    values = yaml.safe_load(out.read_text())
    assert {"patch_size", "batch_size", "f_maps", "epochs", "val_every"} <= set(values)
    assert "s/step at 16x64x64" in capsys.readouterr().out


def test_plan_cli_names_a_missing_root(tmp_path, capsys):
    assert main(["--data-root", str(tmp_path / "nowhere")]) == 2
    assert "nowhere" in capsys.readouterr().err


def test_plan_follows_the_step_the_trainer_measured():
    plan = make_plan(SLABS, CPU, budget_s=300)
    planned, per_volume = plan.step_s / STEP_OVERHEAD, plan.values["samples_per_volume"]
    assert plan.fit_to_step(planned * 1.1, frozenset()) is None  # close enough: unchanged
    assert plan.fit_to_step(planned * 2, frozenset({"samples_per_volume"})) is None  # given
    assert plan.fit_to_step(planned * 2, frozenset()) == pytest.approx(2.0)
    assert plan.values["samples_per_volume"] == max(1, round(per_volume / 2))
    assert "measured" in plan.reasons["samples_per_volume"]


@pytest.mark.parametrize("ext", [".nii.gz", ".tif", ".npy"])
def test_volume_header_reads_shape_without_the_voxels(tmp_path, ext):
    from app.data.volume_io import VolumeError, volume_header

    path = tmp_path / f"v{ext}"
    write_volume(path, np.zeros((6, 4, 5), np.float32), VolumeMeta(ext, affine=np.eye(4)))
    shape, spacing = volume_header(path)
    assert shape == (6, 4, 5)
    assert spacing == ((1.0, 1.0, 1.0) if ext == ".nii.gz" else None)
    bad = tmp_path / f"bad{ext}"
    bad.write_bytes(b"not a volume")
    with pytest.raises(VolumeError, match=f"bad{ext}: cannot read"):
        volume_header(bad)


def test_depth_pools_while_every_axis_keeps_4_voxels():
    assert depth_for((16, 72, 56)) == 3  # 16 -> 8 -> 4
    assert depth_for((32, 160, 160)) == 4  # the original recipe's depth
    assert depth_for((64, 256, 256)) == 4  # no deeper than MAX_DEPTH
    assert depth_for((8, 64, 64)) == 2  # at least one pooling


def test_plan_refits_the_epochs_left_to_the_budget():
    plan = make_plan(SLABS, CPU, budget_s=300)
    epochs, per_volume = plan.values["epochs"], plan.values["samples_per_volume"]
    budgeted = 300 / epochs  # what every epoch may take
    assert plan.fit_to_epoch(budgeted * 1.03, 2, 300, frozenset()) is None  # close enough
    for given in ({"samples_per_volume"}, {"epochs"}):  # the user's schedule, not the budget's
        assert plan.fit_to_epoch(budgeted * 0.5, 2, 300, frozenset(given)) is None
    # epochs of 0.8 of their share: the 2 done took 1.6 shares, the rest take (epochs - 1.6)
    ratio = plan.fit_to_epoch(budgeted * 0.8, 2, 300, frozenset())
    assert ratio == pytest.approx(0.8 * (epochs - 2) / (epochs - 1.6))
    assert plan.values["samples_per_volume"] == round(per_volume / ratio) > per_volume
    assert "refitted after epoch 2" in plan.reasons["samples_per_volume"]
    # a budget already spent leaves the fewest patches the schedule can take
    assert plan.fit_to_epoch(300.0, 2, 300, frozenset()) == math.inf
    assert plan.values["samples_per_volume"] == 1
