"""A NaN or Inf loss or gradient never reaches the weights, the optimizer state, the BatchNorm
statistics or a checkpoint: such steps are skipped on the device, counted per epoch, and an
epoch that skips most of its steps stops the run with a message."""

from __future__ import annotations

import json
import math

import pytest
import torch
from helpers import BF16, TINY

from app.config import Config
from app.engine import steps
from app.engine.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from app.losses import BCEDiceLoss
from app.model import UNet3d
from app.precision.amp import build_precision

CPU = torch.device("cpu")


def snapshot(model, optimizer):
    params = [p.detach().clone() for p in model.parameters()]
    buffers = [b.detach().clone() for b in model.buffers()]
    state = {k: v.detach().clone() for s in optimizer.state.values() for k, v in s.items()}
    return params, buffers, state


def same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize(
    ("opt_level", "amp_dtype", "fused"),
    [
        ("O0", "auto", True),
        ("O1", "bfloat16", True),
        ("O0", "auto", False),
        ("O1", "float16", True),
    ],
)
def test_a_non_finite_step_changes_nothing(opt_level, amp_dtype, fused):
    torch.manual_seed(0)
    model = UNet3d(f_maps=2, depth=2)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, fused=fused)
    precision = build_precision(Config(opt_level=opt_level, amp_dtype=amp_dtype), CPU)
    model, optimizer = precision.initialize(model, optimizer)
    x, y = torch.randn(2, 1, 8, 16, 16), (torch.rand(2, 1, 8, 16, 16) > 0.5).float()

    def step(poison: float):
        with precision.autocast():
            loss = BCEDiceLoss()(model(x), y) * poison
        optimizer.zero_grad(set_to_none=True)
        precision.backward(loss, optimizer)
        return precision.step(optimizer)

    assert float(step(1.0)) == 0.0  # a good step first: the Adam state exists
    before = snapshot(model, optimizer)
    for poison in (math.nan, math.inf):
        flag = step(poison)
        assert flag.dim() == 0 and float(flag) == 1.0
        after = snapshot(model, optimizer)
        assert same(before[0], after[0]), "weights changed"
        assert same(before[1], after[1]), "BatchNorm statistics changed"
        assert same(list(before[2].values()), list(after[2].values())), "Adam state changed"
    assert float(step(1.0)) == 0.0
    assert not same(before[0], snapshot(model, optimizer)[0])  # and training goes on


def poisoned_loss(monkeypatch, every: int):
    """Make every ``every``-th training loss NaN (validation, under no_grad, stays clean)."""
    calls = {"n": 0}
    original = BCEDiceLoss.forward

    def forward(self, logits, target):
        loss = original(self, logits, target)
        if torch.is_grad_enabled():
            calls["n"] += 1
            if calls["n"] % every == 0:
                return loss * math.nan
        return loss

    monkeypatch.setattr(BCEDiceLoss, "forward", forward)
    return calls


def run_args(dataset, run_dir, epochs):
    return [*TINY, "--data-root", str(dataset), "--output-dir", str(run_dir), "--epochs", epochs]


def test_an_injected_nan_loss_is_skipped_and_counted(dataset, tmp_path, monkeypatch):
    from app.train import main as train_main

    poisoned_loss(monkeypatch, every=3)  # TINY: 3 steps per epoch, the third one NaN
    run_dir = tmp_path / "run"
    assert train_main(run_args(dataset, run_dir, "2")) == 0
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped_steps"] for r in rows] == [1, 1]
    assert all(math.isfinite(r["train_loss"]) and math.isfinite(r["dice"]) for r in rows)
    state = load_checkpoint(run_dir / "checkpoints" / "last.pt")
    assert all(torch.isfinite(t).all() for t in state["model"].values() if t.is_floating_point())
    assert all(
        torch.isfinite(t).all()
        for s in state["optimizer"]["state"].values()
        for t in s.values()
        if torch.is_tensor(t)
    )


def test_an_epoch_of_mostly_skipped_steps_stops_and_keeps_the_last_checkpoint(
    dataset, tmp_path, monkeypatch, capsys
):
    from app.train import main as train_main

    run_dir = tmp_path / "run"
    # under mixed precision, so that the advice names --opt-level O0
    assert train_main([*run_args(dataset, run_dir, "1"), *BF16]) == 0
    before = (run_dir / "checkpoints" / "last.pt").read_bytes()
    poisoned_loss(monkeypatch, every=1)
    assert train_main([*run_args(dataset, run_dir, "2"), *BF16]) == 2
    err = capsys.readouterr().err
    assert "epoch 2: 3 of 3 training steps had NaN or Inf gradients" in err
    assert "--opt-level O0" in err and "--lr" in err
    assert (run_dir / "checkpoints" / "last.pt").read_bytes() == before
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["epoch"] for x in lines] == [1]


def test_check_steps_taken_allows_a_few_skips():
    totals = steps.EpochTotals(loss=0.5, steps=10, skipped=5, samples=20)
    steps.check_steps_taken(totals, 3, Config(opt_level="O1"))  # half is not most
    with pytest.raises(steps.NonFiniteError, match="epoch 3: 6 of 10"):
        steps.check_steps_taken(
            steps.EpochTotals(0.5, 10, 6, 20), 3, Config(opt_level="O0", lr=0.1)
        )


def test_a_checkpoint_never_holds_a_non_finite_weight(tmp_path):
    path = tmp_path / "last.pt"
    good = {"model": {"w": torch.ones(2), "n": torch.tensor(3)}}
    save_checkpoint(path, good)
    before = path.read_bytes()
    bad = {"model": {"w": torch.tensor([1.0, math.inf]), "n": torch.tensor(3)}}
    with pytest.raises(CheckpointError, match=r"last\.pt: not written, the model's w hold NaN"):
        save_checkpoint(path, bad)
    assert path.read_bytes() == before
