"""--num-classes K >= 2: the CE + Dice loss, per-class counts, fp32 softmax, label checks,
per-class foreground sampling, and training end to end (1 vs 2 processes, exact resume)."""

import json
import logging

import apex_recording_standin
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import TIMING, TINY, records, write_phases

from app.config import Config, ConfigError, load_config
from app.data.dataset import DataError, PatchDataset, load_split
from app.data.volume_io import VolumeMeta, write_volume
from app.distributed import DistEnv, prepare
from app.engine.validation import EvalResult
from app.labels import build_loss
from app.losses import BCEDiceLoss, CEDiceLoss
from app.metrics import class_counts, dice_iou
from app.model import build_model
from app.precision import amp as amp_ops
from app.precision.amp import ApexPrecision
from app.train import main


# ----------------------------------------------------------------------------- data
@pytest.fixture(scope="module")
def phases(tmp_path_factory):
    # an odd number of validation volumes: 2 ranks get 2 and 1, with nothing padded
    return write_phases(tmp_path_factory.mktemp("phases"))


# ----------------------------------------------------------------------------- loss and metrics
def independent_ce_dice(logits, target, ce_weight, dice_weight, batch_dice=False):
    """The documented formula, written out with numpy in float64."""
    z = logits.double().numpy()
    g = target[:, 0].long().numpy()
    k = z.shape[1]
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    onehot = np.stack([g == c for c in range(k)], 1).astype(float)
    ce = -(np.log((p * onehot).sum(1))).mean()
    dices = []
    samples = [slice(None)] if batch_dice else range(z.shape[0])
    for b in samples:
        for c in range(1, k):
            pc, yc = p[b, c].ravel(), onehot[b, c].ravel()
            dices.append((2 * (pc * yc).sum() + 1) / (pc.sum() + yc.sum() + 1))
    return ce_weight * ce + dice_weight * (1 - np.mean(dices))


def test_ce_dice_loss_matches_an_independent_computation():
    torch.manual_seed(0)
    logits = torch.randn(2, 4, 3, 5, 6) * 3
    target = torch.randint(0, 4, (2, 1, 3, 5, 6)).float()
    got = CEDiceLoss(4, 0.3, 0.7)(logits, target)
    assert got.item() == pytest.approx(independent_ce_dice(logits, target, 0.3, 0.7), abs=1e-6)
    batch = CEDiceLoss(4, 0.3, 0.7, batch_dice=True)(logits, target)
    expected = independent_ce_dice(logits, target, 0.3, 0.7, batch_dice=True)
    assert batch.item() == pytest.approx(expected, abs=1e-6)
    assert batch.item() != pytest.approx(got.item(), abs=1e-4)


def test_build_loss_picks_by_num_classes():
    assert isinstance(build_loss(Config()), BCEDiceLoss)
    assert build_loss(Config(batch_dice=True)).batch_dice
    loss = build_loss(Config(num_classes=3, bce_weight=0.5, dice_weight=2.0))
    assert isinstance(loss, CEDiceLoss) and (loss.ce_weight, loss.dice_weight) == (0.5, 2.0)
    assert not loss.batch_dice
    assert build_loss(Config(num_classes=3, batch_dice=True)).batch_dice


def test_softmax_loss_and_counts_stay_float32_under_autocast():
    torch.manual_seed(0)
    logits = torch.randn(1, 3, 4, 8, 8)
    target = torch.randint(0, 3, (1, 1, 4, 8, 8)).float()
    reference = CEDiceLoss(3)(logits, target)
    for dtype in (torch.bfloat16, torch.float16):
        half = logits.to(dtype)
        with torch.autocast("cpu", dtype=dtype):
            assert amp_ops.softmax(half, dim=1).dtype == torch.float32
            assert torch.softmax(half, dim=1).dtype == dtype  # what the registry prevents
            mixed = CEDiceLoss(3)(logits, target)
            counts = class_counts(logits, target)
        assert mixed.dtype == torch.float32 and torch.allclose(mixed, reference, atol=1e-6)
        assert counts.dtype == torch.float64
        assert torch.equal(counts, class_counts(logits, target))


def test_class_counts_per_foreground_class():
    # voxels: truth 0 1 1 2 2 0, prediction (argmax) 0 1 2 2 0 1
    target = torch.tensor([0, 1, 1, 2, 2, 0]).float().view(1, 1, 6)
    pred = torch.tensor([0, 1, 2, 2, 0, 1])
    logits = F.one_hot(pred, 3).T[None].float() * 5
    counts = class_counts(logits, target)
    assert counts.tolist() == [[1, 1, 1], [1, 1, 1]]  # TP FP FN of class 1, then class 2
    result = EvalResult(
        ["a"], torch.cat([counts.flatten(), torch.tensor([0.5])])[None], list("bxy")
    )
    summary = result.summary()
    assert summary["dice/x"] == pytest.approx(0.5) and summary["dice"] == pytest.approx(0.5)
    assert summary["iou/y"] == pytest.approx(1 / 3) and summary["val_loss"] == 0.5
    row = result.volume_rows()[0]
    assert row["classes"]["y"] == {
        "dice": 0.5,
        "iou": pytest.approx(1 / 3),
        "tp": 1,
        "fp": 1,
        "fn": 1,
    }


def test_binary_eval_result_is_unchanged():
    table = torch.tensor([[3.0, 1.0, 2.0, 0.25], [0.0, 0.0, 0.0, 0.75]], dtype=torch.float64)
    result = EvalResult(["a", "b"], table)
    dice, iou = dice_iou(table[:, :3].sum(0))
    assert result.summary()["dice"] == float(dice) and result.summary()["iou"] == float(iou)
    assert "dice/" not in "".join(result.summary())
    assert result.volume_rows()[0] == {
        "name": "a",
        "dice": 0.6666666666666666,
        "iou": 0.5,
        "loss": 0.25,
        "tp": 3,
        "fp": 1,
        "fn": 2,
    }


def test_model_head_has_k_channels_and_apex_registers_softmax_first(monkeypatch):
    cfg = Config(num_classes=3, f_maps=2, depth=2, memory_format="contiguous")
    model = build_model(cfg, torch.device("cpu"))
    assert model(torch.randn(1, 1, 4, 8, 8)).shape == (1, 3, 4, 8, 8)
    calls = apex_recording_standin.install(monkeypatch)
    env = DistEnv(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    prepare(model, torch.optim.Adam(model.parameters()), ApexPrecision("O1", cfg.fp32_ops), env)
    names = [c[0] if c[0] != "amp.register_float_function" else c[2] for c in calls]
    assert names.index("softmax") < names.index("amp.initialize")


# ----------------------------------------------------------------------------- config and data
def test_class_names_must_match_num_classes():
    assert load_config(["--num-classes", "3"]).classes == ["class0", "class1", "class2"]
    named = load_config(["--num-classes", "2", "--class-names", "pore", "ore"])
    assert named.classes == ["pore", "ore"]
    with pytest.raises(ConfigError, match="--class-names"):
        load_config(["--num-classes", "3", "--class-names", "a", "b"])
    with pytest.raises(ConfigError, match="--class-names"):
        load_config(["--class-names", "a"])  # binary: no names
    with pytest.raises(ConfigError, match="--num-classes"):
        load_config(["--num-classes", "0"])


@pytest.mark.parametrize(
    "label, fragment",
    [
        (np.full((8, 8, 8), 3, np.uint8), "values outside 0..2 (--num-classes 3): 3"),
        (
            np.full((8, 8, 8), 0.5, np.float32),
            "must be an integer class map 0..2, got dtype float32",
        ),
        (np.full((8, 8, 8), 3.0, np.float32), "values outside 0..2 (--num-classes 3): 3"),
        (np.full((8, 8, 8), -1, np.int16), "values outside 0..2 (--num-classes 3): -1"),
    ],
)
def test_bad_class_labels_are_refused_by_name(tmp_path, label, fragment):
    root = write_phases(tmp_path / "data", n_train=1, n_val=1, shape=(8, 8, 8))
    bad = root / "train_patches/labels/vol_00.nii.gz"
    write_volume(bad, label, VolumeMeta(".nii.gz", affine=np.eye(4)))
    with pytest.raises(DataError) as error:
        load_split(root, "train", "zscore", num_classes=3)
    assert str(bad) in str(error.value) and fragment in str(error.value)


def test_a_whole_numbered_float_label_is_read_with_a_warning(tmp_path, caplog):
    root = write_phases(tmp_path / "data", n_train=1, n_val=1, shape=(8, 8, 8))
    path = root / "train_patches/labels/vol_00.nii.gz"
    label = np.zeros((8, 8, 8), np.float32)
    label[:4], label[4:] = 1.0, 2.0
    write_volume(path, label, VolumeMeta(".nii.gz", affine=np.eye(4)))
    with caplog.at_level(logging.WARNING, logger="app.data.dataset"):
        (vol,) = load_split(root, "train", "zscore", num_classes=3)
    assert vol.label.dtype == np.uint8 and set(np.unique(vol.label)) == {1, 2}
    assert f"{path}: a float32 label map; its values 1, 2 are whole numbers" in caplog.text


def test_a_missing_class_is_warned_about_by_folder(tmp_path, caplog):
    root = write_phases(tmp_path / "data", n_train=1, n_val=1, shape=(8, 8, 8))
    with caplog.at_level(logging.WARNING, logger="app.data.dataset"):
        load_split(root, "train", "zscore", num_classes=4)
    assert "train_patches/labels: no label holds class(es) [3] of --num-classes 4" in caplog.text


def test_foreground_oversampling_centres_each_class():
    label = np.zeros((16, 32, 32), np.uint8)
    label[2:14, 2:30, 2:30] = 1  # a common class
    label[8, 16, 16] = 2  # and one rare voxel
    from app.data.dataset import Volume
    from app.labels import class_voxels

    voxels = class_voxels(label, 3, np.random.default_rng(0))
    vol = Volume("v", label.astype(np.float32), label, None, np.concatenate(voxels), voxels)
    dataset = PatchDataset([vol], (4, 4, 4), 200, 1.0, False, 0)
    rare = sum(bool((dataset[i][1] == 2).any()) for i in range(len(dataset)))
    assert 70 <= rare <= 130  # about half the patches: one class of two picked uniformly


# ----------------------------------------------------------------------------- training
def train_args(data, run_dir, epochs, *extra):
    return [
        *TINY,
        "--data-root",
        str(data),
        "--output-dir",
        str(run_dir),
        "--epochs",
        str(epochs),
        "--lr",
        "0.01",
        "--num-classes",
        "3",
        "--class-names",
        "pore",
        "hematite",
        "magnetite",
        "--milestones",
        "2",
        "--gamma",
        "0.5",
        *map(str, extra),
    ]


def test_k3_trains_reports_per_class_and_resumes_exactly(phases, tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert main(train_args(phases, straight, 3, "--resume", "none")) == 0
    assert main(train_args(phases, resumed, 2, "--resume", "none")) == 0
    assert main(train_args(phases, resumed, 3, "--resume", "auto")) == 0
    a, b = records(straight), records(resumed)
    for name in ("hematite", "magnetite"):
        for key in ("dice", "iou", "floor_dice", "dice_per_volume_mean"):
            assert f"{key}/{name}" in a[-1]
    assert "dice/pore" not in a[-1]  # the background is not a scored class
    assert a[-1]["dice"] == pytest.approx((a[-1]["dice/hematite"] + a[-1]["dice/magnetite"]) / 2)
    assert [r["epoch"] for r in b] == [1, 2, 3]
    for key, value in a[2].items():
        if key not in TIMING:
            assert b[2][key] == pytest.approx(value, abs=1e-6), key
    best = torch.load(straight / "checkpoints/best.pt", weights_only=True)
    assert best["best_dice"] == max(r["dice"] for r in a)  # the mean foreground Dice

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(straight / "tensorboard"), size_guidance={"images": 0})
    events.Reload()
    scalars = set(events.Tags()["scalars"])
    assert {"dice/hematite", "dice/magnetite", "iou/hematite", "floor_dice/magnetite"} <= scalars
    assert [e.step for e in events.Scalars("dice/magnetite")] == [1, 2, 3]
    assert events.Tags()["images"] == ["val/vol_00"]  # the montage, coloured by class


@pytest.fixture(scope="module")
def k3_run(phases, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("k3") / "run"
    assert main(train_args(phases, run_dir, 1, "--resume", "none")) == 0
    return run_dir


@pytest.mark.slow
def test_k3_one_and_two_gloo_processes_count_alike(phases, k3_run, tmp_path):
    from test_distributed import launch

    run_dir = k3_run
    reports = {}
    for nproc in (1, 2):
        out = tmp_path / f"eval{nproc}"
        args = train_args(
            phases, out, 1, "--eval-only", "--resume", run_dir / "checkpoints/last.pt"
        )
        launch(args, NPROC_PER_NODE=nproc)
        reports[nproc] = json.loads((out / "eval.json").read_text())
    one, two = reports[1], reports[2]
    assert [v["name"] for v in two["volumes"]] == ["vol_00", "vol_01", "vol_02"]
    for a, b in zip(one["volumes"], two["volumes"]):
        assert a["classes"] == b["classes"]  # per-class TP/FP/FN of each volume, counted once
    for key in ("dice", "iou", "dice/hematite", "iou/magnetite", "dice_per_volume_mean"):
        assert one[key] == two[key]
    assert set(one["volumes"][0]["classes"]) == {"hematite", "magnetite"}


# ----------------------------------------------------------------------------- predict, evaluate
def test_predict_writes_a_label_map_that_evaluate_scores_as_the_trainer(phases, k3_run, tmp_path):
    from app.analysis.evaluate import main as evaluate_main
    from app.analysis.predict import main as predict_main
    from app.data.volume_io import read_volume

    out = tmp_path / "pred"
    checkpoint = k3_run / "checkpoints/last.pt"
    images, labels = phases / "val_patches/images", phases / "val_patches/labels"
    assert (
        predict_main(
            ["--checkpoint", str(checkpoint), "--input", str(images), "--output", str(out)]
        )
        == 0
    )
    mask, _ = read_volume(out / "vol_00_mask.nii.gz")
    probs = np.stack(
        [
            read_volume(out / f"vol_00_probs_{n}.nii.gz")[0]
            for n in ("pore", "hematite", "magnetite")
        ]
    )
    assert mask.dtype == np.uint8 and probs.dtype == np.float32
    assert np.allclose(probs.sum(0), 1.0, atol=1e-5) and np.array_equal(mask, probs.argmax(0))

    names = ["--num-classes", "3", "--class-names", "pore", "hematite", "magnetite"]
    summary_path = tmp_path / "eval.json"
    args = ["--pred", str(out), "--labels", str(labels), "--out", str(summary_path), *names]
    assert evaluate_main(args) == 0
    summary = json.loads(summary_path.read_text())
    trainer = records(k3_run)[-1]
    for name in ("hematite", "magnetite"):
        assert summary["global"][name]["dice"] == pytest.approx(trainer[f"dice/{name}"], abs=1e-9)
    assert summary["mean_foreground"]["global"]["dice"] == pytest.approx(trainer["dice"], abs=1e-9)
    assert (tmp_path / "eval.csv").read_text().count("\n") == 1 + 3 * 2  # volume x class rows
    # unnamed classes: the label maps are scored the same, the named probabilities are no extra
    unnamed = ["--pred", str(out), "--labels", str(labels), "--out", str(tmp_path / "u.json")]
    assert evaluate_main([*unnamed, "--num-classes", "3"]) == 0
    plain = json.loads((tmp_path / "u.json").read_text())
    assert plain["global"]["class2"]["dice"] == summary["global"]["magnetite"]["dice"]


def test_predict_and_evaluate_refuse_what_does_not_fit_label_maps(k3_run, phases, tmp_path, capsys):
    from app.analysis.evaluate import main as evaluate_main
    from app.analysis.predict import main as predict_main

    images = phases / "val_patches/images"
    checkpoint = k3_run / "checkpoints/last.pt"
    args = [
        "--checkpoint",
        checkpoint,
        "--input",
        images,
        "--output",
        tmp_path / "p",
        "--fill-holes",
    ]
    assert predict_main([str(a) for a in args]) == 2
    assert "--fill-holes clean binary masks" in capsys.readouterr().err

    preds = tmp_path / "floats"
    preds.mkdir()
    bad = preds / "vol_00.nii.gz"
    probabilities = np.full((16, 32, 32), 0.3, np.float32)  # not a label map
    write_volume(bad, probabilities, VolumeMeta(".nii.gz", affine=np.eye(4)))
    labels = tmp_path / "labels"
    labels.mkdir()
    write_volume(
        labels / "vol_00.nii.gz",
        np.zeros((16, 32, 32), np.uint8),
        VolumeMeta(".nii.gz", affine=np.eye(4)),
    )
    out = str(tmp_path / "e.json")
    assert (
        evaluate_main(
            ["--pred", str(preds), "--labels", str(labels), "--out", out, "--num-classes", "3"]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert str(bad) in err and "integer class map" in err
    assert (
        evaluate_main(
            [
                "--pred",
                str(preds),
                "--labels",
                str(labels),
                "--out",
                out,
                "--num-classes",
                "3",
                "--class-names",
                "a",
                "b",
            ]
        )
        == 2
    )
    assert "--class-names" in capsys.readouterr().err


def test_montage_colours_each_class_and_report_leaves_grains_out(k3_run, phases):
    from matplotlib.colors import to_rgb

    from app.analysis.figures import CLASS_COLOURS, montage_figure
    from app.analysis.report import main as report_main

    label = np.zeros((4, 24, 24), np.uint8)
    label[:, 2:10, 2:10], label[:, 12:22, 12:22] = 1, 2
    rgb = montage_figure(
        np.random.default_rng(0).normal(size=label.shape),
        label,
        label,
        "t",
        2,
        classes=["bg", "a", "b"],
    )
    assert rgb.ndim == 3 and rgb.shape[2] == 3
    pixels = rgb.reshape(-1, 3).astype(int)
    for colour in CLASS_COLOURS[:2]:  # each class's outline colour is drawn
        target = np.array(to_rgb(colour)) * 255
        assert (np.abs(pixels - target).max(1) < 8).any(), colour

    assert report_main([str(k3_run), "--volumes", "1", "--data-root", str(phases)]) == 0
    written = {p.name for p in (k3_run / "report").iterdir()}
    assert "montage_vol_00.png" in written and not any(n.startswith("grains_") for n in written)


def test_plan_reads_class_maps(phases, tmp_path, capsys):
    from app.plan import main as plan_main

    out = tmp_path / "plan.yaml"
    assert plan_main(["--data-root", str(phases), "--num-classes", "3", "--out", str(out)]) == 0
    assert "--num-classes 3" in capsys.readouterr().out and out.is_file()
    assert plan_main(["--data-root", str(phases)]) == 2  # class maps are not binary labels
    assert "labels must be binary" in capsys.readouterr().err


def test_resume_with_another_num_classes_is_refused(phases, k3_run, tmp_path, capsys):
    checkpoint = k3_run / "checkpoints/last.pt"
    args = train_args(phases, tmp_path / "run", 2, "--resume", checkpoint)
    args[args.index("--num-classes") + 1 : args.index("--milestones")] = ["4"]
    assert main([str(a) for a in args]) == 2
    assert "trained with --f-maps 4 --depth 3 --num-classes 3" in capsys.readouterr().err


def test_padding_keeps_each_class_at_its_padded_place():
    from app.data.dataset import Volume
    from app.labels import class_voxels

    label = np.zeros((4, 6, 6), np.uint8)
    label[1, 1, 1], label[2, 4, 4] = 1, 2
    voxels = class_voxels(label, 3, np.random.default_rng(0))
    vol = Volume("v", label.astype(np.float32), label, None, np.concatenate(voxels), voxels)
    (padded,) = PatchDataset([vol], (8, 8, 8), 1, 1.0, False, 0).volumes
    assert padded.label.shape == (8, 8, 8)
    for c, flat in enumerate(padded.class_voxels, start=1):
        assert flat.size == 1 and padded.label.ravel()[flat[0]] == c
