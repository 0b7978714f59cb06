"""The weight average (``--ema-decay``): its arithmetic, and that validation, best.pt, resume,
``--eval-only`` and ``app.analysis.predict`` all use it."""

import json

import pytest
import torch
from helpers import TINY, records, train_tiny
from torch import nn

from app.analysis.predict import load_predictor
from app.engine.ema import WeightAverage, inference_weights
from app.train import main


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(3, 2)
        self.norm = nn.BatchNorm1d(2)


def test_the_average_follows_the_warmed_up_decay_of_every_tensor():
    torch.manual_seed(0)
    model = Tiny()
    average = WeightAverage(model, decay=0.9)
    expected = {k: v.clone().double() for k, v in model.state_dict().items()}
    for n in range(30):
        with torch.no_grad():
            for tensor in model.state_dict().values():
                if tensor.is_floating_point():
                    tensor.add_(torch.randn_like(tensor))
            model.norm.num_batches_tracked += 1
        average.update(model)
        decay = min(0.9, (1 + n) / (10 + n))
        for key, value in model.state_dict().items():
            if value.is_floating_point():
                expected[key] = decay * expected[key] + (1 - decay) * value.double()
            else:
                expected[key] = value.clone()
    assert average.updates == 30
    for key, value in average.model.state_dict().items():
        assert torch.allclose(value.double(), expected[key].double(), atol=1e-6), key
    assert average.model.norm.num_batches_tracked.item() == 30  # copied, not averaged
    assert not any(p.requires_grad for p in average.model.parameters())


def test_the_average_reads_a_reassigned_data_tensor_and_a_new_model():
    # update() keeps its lists of tensors between steps; they must still see the weights when a
    # .data is reassigned (as module.to() may do) and when it is handed another model
    model = Tiny()
    average = WeightAverage(model, decay=0.5)  # warmup: the first update takes 0.9 of the model
    with torch.no_grad():
        model.linear.weight.data = torch.full_like(model.linear.weight, 10.0)
    average.update(model)
    start = average.model.linear.weight.clone()
    assert torch.all(average.model.linear.weight > 8.0)
    other = Tiny()
    with torch.no_grad():
        other.linear.weight.fill_(-10.0)
    average.update(other)  # second update: decay 2/11
    assert torch.allclose(average.model.linear.weight, start * 2 / 11 - 10.0 * 9 / 11)


def test_the_average_refuses_half_weights_and_bad_decays():
    with pytest.raises(ValueError, match=r"float16.*O2/O3"):
        WeightAverage(Tiny().half(), 0.99)
    for decay in (0.0, 1.0):
        with pytest.raises(ValueError, match="within"):
            WeightAverage(Tiny(), decay)


def test_its_state_round_trips():
    model = Tiny()
    average = WeightAverage(model, 0.99)
    with torch.no_grad():
        model.linear.weight.add_(1.0)
    average.update(model)
    copy = WeightAverage(Tiny(), 0.99)
    copy.load_state_dict(average.state_dict())
    assert copy.updates == 1 and copy.current_decay() == average.current_decay()
    assert torch.equal(copy.model.linear.weight, average.model.linear.weight)


def test_training_validates_saves_and_predicts_with_the_average(dataset, tmp_path):
    run_dir = train_tiny(dataset, tmp_path / "run", "--ema-decay", "0.9")
    state = torch.load(run_dir / "checkpoints/last.pt", weights_only=True)
    average = state["ema"]
    assert average["decay"] == 0.9 and average["updates"] > 0
    differs = [k for k, v in state["model"].items() if not torch.equal(v, average["weights"][k])]
    assert differs  # a real average, not a copy of the last step
    assert inference_weights(state) is average["weights"]
    predictor = load_predictor(run_dir / "checkpoints/last.pt")
    for key, value in predictor.model.state_dict().items():
        assert torch.equal(value, average["weights"][key]), key

    # --eval-only scores the average, as validation did when it chose best.pt
    argv = [*TINY, "--output-dir", str(run_dir), "--data-root", str(dataset), "--eval-only"]
    assert main(argv) == 0
    report = json.loads((run_dir / "eval.json").read_text())
    assert report["dice"] == pytest.approx(records(run_dir)[-1]["dice"], abs=1e-9)


def test_without_the_flag_checkpoints_predict_with_their_own_weights(dataset, tmp_path):
    run_dir = train_tiny(dataset, tmp_path / "run")
    state = torch.load(run_dir / "checkpoints/last.pt", weights_only=True)
    assert state["ema"] is None and inference_weights(state) is state["model"]
    assert not (run_dir / "eval.json").exists()  # written at the end with --tta only


def test_resume_with_the_average_matches_an_uninterrupted_run(dataset, tmp_path):
    straight = train_tiny(dataset, tmp_path / "straight", "--ema-decay", "0.8", epochs=3)
    resumed = train_tiny(dataset, tmp_path / "resumed", "--ema-decay", "0.8", epochs=2)
    train_tiny(dataset, resumed, "--ema-decay", "0.8", "--resume", "auto", epochs=3)
    a, b = records(straight)[-1], records(resumed)[-1]
    for key in ("train_loss", "val_loss", "dice", "iou"):
        assert b[key] == pytest.approx(a[key], abs=1e-6), key
    ema_a = torch.load(straight / "checkpoints/last.pt", weights_only=True)["ema"]
    ema_b = torch.load(resumed / "checkpoints/last.pt", weights_only=True)["ema"]
    assert ema_a["updates"] == ema_b["updates"]
    for key, value in ema_a["weights"].items():
        assert torch.allclose(value, ema_b["weights"][key], atol=1e-6), key
