"""The quality features of the trainer: dataset normalisation carried by the checkpoint, the norm
layers, the classical floor beside the model's Dice, the validation cadence and --plan auto."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import yaml
from helpers import records

from app.analysis.floor import floors_from_volumes
from app.analysis.predict import load_predictor
from app.data.dataset import Normalization, load_train_val
from app.engine.checkpoint import CheckpointError
from app.engine.validation import ValidationCadence
from app.model import DoubleConv, ResidualBlock, UNet3d
from app.plan import Plan
from app.train import main


def run(args):
    return main([str(a) for a in args])


def test_dataset_normalisation_is_fitted_on_train_and_kept_in_the_checkpoint(dataset, tmp_path):
    train, _, fitted = load_train_val(dataset, "dataset")
    assert fitted.mode == "dataset" and fitted.std > 0
    # one scale for all: the z-scored training voxels pooled have mean ~0, std ~1
    pooled = np.concatenate([v.image.ravel() for v in train])
    assert abs(pooled.mean()) < 0.05 and pooled.std() == pytest.approx(1.0, abs=0.05)
    with pytest.raises(ValueError, match="fitted on the training set"):
        Normalization("dataset")
    with pytest.raises(ValueError, match="unknown normalisation"):
        Normalization("minmax")

    from helpers import train_tiny

    run_dir = train_tiny(dataset, tmp_path / "run", "--normalization", "dataset", epochs=1)
    state = torch.load(run_dir / "checkpoints/last.pt", weights_only=True)
    assert Normalization.saved_in(state) == fitted
    predictor = load_predictor(run_dir / "checkpoints/last.pt", torch.device("cpu"))
    assert predictor.normalization == fitted
    raw = np.full((4, 4, 4), fitted.mean * 0 + 1.0, np.float32)
    np.testing.assert_allclose(predictor.preprocess(raw, "x.npy"), fitted(raw))


@pytest.mark.parametrize("norm", ["batch", "instance", "group", "none"])
def test_norm_layers(norm):
    model = UNet3d(1, 1, f_maps=8, depth=3, norm=norm)
    kinds = {type(m).__name__ for m in model.modules()}
    norms = {"BatchNorm3d", "InstanceNorm3d", "GroupNorm"}
    expected = {"batch": "BatchNorm3d", "instance": "InstanceNorm3d", "group": "GroupNorm"}
    if norm == "none":
        assert not kinds & norms
        assert all(m.bias is not None for m in model.modules() if isinstance(m, torch.nn.Conv3d))
    else:
        assert kinds & norms == {expected[norm]}
    # per-sample norms leave the stem's first convolution un-normalised; BatchNorm keeps it
    first = model.encoders[0]
    assert isinstance(first[1], torch.nn.Identity) == (norm != "batch")
    out = model(torch.randn(2, 1, 8, 16, 16))
    assert out.shape == (2, 1, 8, 16, 16)
    with pytest.raises(ValueError, match="unknown norm"):
        UNet3d(1, 1, 8, 3, norm="layer")


def test_he_init_keeps_the_signal_of_a_net_with_no_norm():
    """--init he: every convolution Kaiming normal (fan in, leaky ReLU 0.01) with zero biases,
    and the plan's no-norm U-Net's logits keep the input's scale; the default leaves PyTorch's
    layers as they are (the same weights as before the option)."""
    torch.manual_seed(0)
    default = UNet3d(1, 1, 4, 3, "none", "residual")
    torch.manual_seed(0)
    assert all(
        torch.equal(a, b)
        for a, b in zip(
            default.state_dict().values(),
            UNet3d(1, 1, 4, 3, "none", "residual", init="pytorch").state_dict().values(),
        )
    )
    torch.manual_seed(0)
    he = UNet3d(1, 1, 4, 3, "none", "residual", init="he")
    convs = [m for m in he.modules() if isinstance(m, torch.nn.Conv3d | torch.nn.ConvTranspose3d)]
    assert len(convs) > 10 and all(not m.bias.abs().sum() for m in convs if m.bias is not None)
    gain = (2 / (1 + 0.01**2)) ** 0.5
    for conv in convs:
        if conv.weight.numel() >= 1000:  # enough weights for their std to be near the init's
            fan_in = torch.nn.init._calculate_fan_in_and_fan_out(conv.weight)[0]
            assert conv.weight.std().item() * fan_in**0.5 == pytest.approx(gain, rel=0.15)
    x = torch.randn(2, 1, 16, 32, 32)
    with torch.no_grad():
        assert default(x).std() < 0.1 and 0.3 < he(x).std() < 10
    with pytest.raises(ValueError, match="unknown init 'xavier'"):
        UNet3d(1, 1, 4, 3, "none", "residual", init="xavier")


@pytest.mark.parametrize("block", ["plain", "residual"])
def test_leaky_relu_keeps_a_gradient_where_relu_has_none(block):
    relu = UNet3d(1, 1, f_maps=4, depth=3, norm="none", block=block)
    leaky = UNet3d(1, 1, f_maps=4, depth=3, norm="none", block=block, activation="leaky_relu")
    leaky.load_state_dict(relu.state_dict())  # no parameters of its own: checkpoints fit both
    acts = [type(m) for m in leaky.modules() if isinstance(m, (torch.nn.ReLU, torch.nn.LeakyReLU))]
    assert acts and set(acts) == {torch.nn.LeakyReLU}
    assert all(m.negative_slope == 0.01 for m in leaky.modules() if type(m) in acts)
    # every unit of the stem dead: all its inputs negative
    for model in (relu, leaky):
        first = model.encoders[0][0] if block == "plain" else model.encoders[0].branch[0]
        with torch.no_grad():
            first.weight.zero_()
            first.bias.fill_(-1.0)
    x = torch.randn(1, 1, 8, 8, 8)
    grads = []
    for model in (relu, leaky):
        model(x).sum().backward()
        first = model.encoders[0][0] if block == "plain" else model.encoders[0].branch[0]
        grads.append(first.weight.grad.abs().sum().item())
    assert grads[0] == 0 and grads[1] > 0  # a dead ReLU learns nothing; a leaky one recovers
    with pytest.raises(ValueError, match="unknown activation"):
        UNet3d(1, 1, 4, 3, activation="gelu")


@pytest.mark.parametrize("norm", ["batch", "none"])
def test_residual_encoder_adds_its_shortcut(norm):
    model = UNet3d(1, 1, f_maps=4, depth=3, norm=norm, block="residual").eval()
    assert all(isinstance(e, ResidualBlock) for e in model.encoders)
    assert all(isinstance(d.conv, DoubleConv) for d in model.decoders)  # decoder stays plain
    block = model.encoders[1]
    x = torch.randn(2, 4, 8, 8, 8)
    with torch.no_grad():
        # independently: ReLU(conv-norm-ReLU-conv-norm (x) + norm(conv1x1(x)))
        branch = x
        for layer in block.branch:
            branch = layer(branch)
        projected = block.shortcut[1](
            torch.nn.functional.conv3d(x, block.shortcut[0].weight, block.shortcut[0].bias)
        )
        torch.testing.assert_close(block(x), torch.relu(branch + projected))
        # with the branch's last convolution silenced, only the shortcut is left
        block.branch[3].weight.zero_()
        if block.branch[3].bias is not None:
            block.branch[3].bias.zero_()
        last_norm = block.branch[4]
        silenced = last_norm(torch.zeros_like(projected))
        torch.testing.assert_close(block(x), torch.relu(silenced + projected))
        assert model(torch.randn(1, 1, 8, 12, 12)).shape == (1, 1, 8, 12, 12)
    with pytest.raises(ValueError, match="unknown block"):
        UNet3d(1, 1, 4, 3, block="dense")


def test_residual_encoder_trains_predicts_and_old_checkpoints_stay_plain(dataset, tmp_path):
    from helpers import train_tiny

    run_dir = train_tiny(dataset, tmp_path / "res", "--block", "residual", epochs=1)
    predictor = load_predictor(run_dir / "checkpoints/last.pt", torch.device("cpu"))
    assert isinstance(predictor.model.encoders[0], ResidualBlock)
    # a checkpoint written before --block existed has no such key: it is a plain U-Net
    plain = train_tiny(dataset, tmp_path / "plain", epochs=1) / "checkpoints/last.pt"
    state = torch.load(plain, weights_only=True)
    del state["config"]["block"]
    torch.save(state, tmp_path / "old.pt")
    old = load_predictor(tmp_path / "old.pt", torch.device("cpu"))
    assert isinstance(old.model.encoders[0], DoubleConv)
    # and weights of the other block do not load silently
    state["config"]["block"] = "residual"
    torch.save(state, tmp_path / "mismatch.pt")
    with pytest.raises(CheckpointError, match="block=residual"):
        load_predictor(tmp_path / "mismatch.pt", torch.device("cpu"))


def test_instance_norm_trains_and_resumes(dataset, tmp_path, tiny_args):
    run_dir = tmp_path / "run"
    argv = [*tiny_args, "--data-root", dataset, "--output-dir", run_dir, "--norm", "instance"]
    assert run([*argv, "--epochs", 1]) == 0
    assert run([*argv, "--epochs", 2, "--resume", "auto"]) == 0
    assert [r["epoch"] for r in records(run_dir)] == [1, 2]


def test_floor_is_logged_beside_the_dice(dataset, tmp_path, tiny_args):
    run_dir = tmp_path / "run"
    assert run([*tiny_args, "--data-root", dataset, "--output-dir", run_dir, "--epochs", 2]) == 0
    train, val, _ = load_train_val(dataset, "zscore")
    expected = floors_from_volumes(train, val).band.val_dice
    rows = records(run_dir)
    assert all(r["floor_dice"] == pytest.approx(expected) for r in rows)


def test_cadence_fixed_and_auto():
    fixed = ValidationCadence(every=3, epochs=10)
    assert [e for e in range(1, 11) if fixed.due(e)] == [3, 6, 9, 10]
    auto = ValidationCadence(every=0, epochs=20, share=0.1)
    assert auto.due(1)
    assert auto.measured(1, val_s=2.0, train_s=5.0) == 4  # 2 s is 10% of 4 epochs of 5 s
    assert [e for e in range(2, 21) if auto.due(e)][:1] == [5]
    assert auto.measured(5, val_s=0.1, train_s=5.0) == 1  # cheap: every epoch
    assert auto.due(6) and auto.due(20)
    resumed = ValidationCadence(every=0, epochs=20, start_epoch=7)
    assert resumed.due(8) and not resumed.due(7)


def test_auto_cadence_validates_first_last_and_within_its_share(dataset, tmp_path, tiny_args):
    run_dir = tmp_path / "run"
    argv = [*tiny_args, "--data-root", dataset, "--output-dir", run_dir, "--epochs", 6]
    assert run([*argv, "--val-every", 0, "--val-share", 0.01]) == 0  # 1%: validation is dearer
    rows = records(run_dir)
    validated = [r["epoch"] for r in rows if "dice" in r]
    assert validated[0] == 1 and validated[-1] == 6 and len(validated) < 6
    assert all(r["val_time_s"] == 0.0 for r in rows if "dice" not in r)
    best = torch.load(run_dir / "checkpoints/best.pt", weights_only=True)
    assert best["best_dice"] == max(r["dice"] for r in rows if "dice" in r)


def test_plan_auto_in_the_trainer_keeps_given_settings(dataset, tmp_path, monkeypatch):
    # epoch 2 timed at half what the budget leaves it: the epochs left get twice the patches
    fit_to_epoch = Plan.fit_to_epoch

    def half_the_budgeted_time(plan, epoch_s, done, budget_s, given):
        left = plan.values["epochs"] - done
        return fit_to_epoch(plan, 0.5 * budget_s / (left + 0.5 * done), done, budget_s, given)

    monkeypatch.setattr(Plan, "fit_to_epoch", half_the_budgeted_time)
    run_dir = tmp_path / "run"
    argv = ["--data-root", dataset, "--output-dir", run_dir, "--device", "cpu"]
    argv += ["--plan", "auto", "--plan-budget-s", "3", "--f-maps", "4", "--num-workers", "0"]
    argv += ["--opt-level", "O0", "--memory-format", "contiguous"]
    assert run([*argv, "--resume", "none"]) == 0
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["f_maps"] == 4  # given: kept
    assert saved["resolved"]["plan"]["f_maps"].startswith("given; the plan's own: 8")
    assert saved["norm"] == "none" and saved["batch_size"] == 2  # planned for a CPU
    assert saved["grad_clip"] == 2.0 and saved["gamma"] == 0.5
    assert set(saved["resolved"]["plan"]) >= {"patch_size", "epochs", "val_every"}
    rows = records(run_dir)
    assert rows[-1]["epoch"] == saved["epochs"] >= 3
    state = torch.load(run_dir / "checkpoints/last.pt", weights_only=True)
    assert state["plan"]["values"]["patch_size"] == saved["patch_size"]
    # refitted after epoch 2, in config.yaml, the checkpoint's plan and the patches drawn
    assert "refitted after epoch 2" in saved["resolved"]["plan"]["samples_per_volume"]
    assert state["plan"]["values"]["samples_per_volume"] == saved["samples_per_volume"]
    drawn = [round(r["samples_per_s"] * r["train_time_s"]) for r in rows]
    volumes = drawn[-1] // saved["samples_per_volume"]
    assert drawn[:2] == [volumes * saved["samples_per_volume"] // 2] * 2
    assert set(drawn[2:]) == {volumes * saved["samples_per_volume"]}
    # the scheduler ran on the plan's factor: the rate halved at each milestone passed
    passed = sum(m < rows[-1]["epoch"] for m in saved["milestones"])
    assert passed and rows[-1]["lr"] == saved["lr"] * saved["gamma"] ** passed
    # resumed for one more epoch: the run's own plan (a new measurement might differ)
    more = saved["epochs"] + 1
    assert run([*argv, "--epochs", more, "--resume", "auto"]) == 0
    assert records(run_dir)[-1]["epoch"] == more
    resumed = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert resumed["patch_size"] == saved["patch_size"]
