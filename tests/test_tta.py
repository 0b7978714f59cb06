"""``--tta``: best.pt scored with the 8 mirrorings at the end of training, into eval.json; the same
figures from ``--eval-only``; ``app.analysis.predict`` mirrors by default for such a checkpoint."""

import json

import torch
from helpers import TINY, records, train_tiny

from app.analysis import predict as predict_cli
from app.analysis.predict import load_predictor
from app.data.dataset import load_split
from app.metrics import confusion_counts, dice_iou
from app.train import main


def mirrored_dice(checkpoint, data_root, tta: bool) -> float:
    """Global val Dice of ``checkpoint``, computed apart from the trainer."""
    predictor = load_predictor(checkpoint, tta=tta)
    counts = torch.zeros(3, dtype=torch.float64)
    for vol in load_split(data_root, "val", predictor.normalization):
        logits = predictor.logits(vol.image)
        counts += confusion_counts(logits, torch.as_tensor(vol.label)[None, None])
    return float(dice_iou(counts[None])[0][0])


def test_the_end_of_training_scores_best_pt_mirrored(dataset, tmp_path):
    run_dir = train_tiny(dataset, tmp_path / "run", "--tta", epochs=3)
    rows = records(run_dir)
    best_epoch = max(rows, key=lambda r: r["dice"])["epoch"]  # the first of equal bests
    report = json.loads((run_dir / "eval.json").read_text())
    best = run_dir / "checkpoints/best.pt"
    assert report["tta"] is True and report["checkpoint"] == str(best)
    assert report["epoch"] == best_epoch
    assert report["dice"] == mirrored_dice(best, dataset, tta=True)
    # validation during training stays unmirrored: best.pt's own figure is the best of them
    assert max(r["dice"] for r in rows) == mirrored_dice(best, dataset, tta=False)

    # --eval-only of best.pt gives the same figures, and --no-tta the unmirrored ones
    again = tmp_path / "again"
    argv = [*TINY, "--data-root", str(dataset), "--output-dir", str(again), "--resume", str(best)]
    assert main([*argv, "--eval-only", "--tta"]) == 0
    evaluated = json.loads((again / "eval.json").read_text())
    assert evaluated["tta"] is True and evaluated["dice"] == report["dice"]
    assert [v["tp"] for v in evaluated["volumes"]] == [v["tp"] for v in report["volumes"]]
    assert main([*argv, "--eval-only", "--no-tta"]) == 0
    plain = json.loads((again / "eval.json").read_text())
    assert plain["tta"] is False and plain["dice"] == max(r["dice"] for r in rows)


def test_predict_mirrors_by_default_for_a_checkpoint_trained_with_tta(
    dataset, tmp_path, monkeypatch
):
    chosen = []
    build = predict_cli.build_predictor
    monkeypatch.setattr(
        predict_cli, "build_predictor", lambda *a: chosen.append(a[-1]) or build(*a)
    )
    mirrored = train_tiny(dataset, tmp_path / "tta", "--tta", epochs=1) / "checkpoints/last.pt"
    plain = train_tiny(dataset, tmp_path / "plain", epochs=1) / "checkpoints/last.pt"
    images = dataset / "val_patches/images"
    for checkpoint, flags in [
        (mirrored, []),
        (mirrored, ["--no-tta"]),
        (plain, []),
        (plain, ["--tta"]),
    ]:
        out = tmp_path / f"out{len(chosen)}"
        argv = ["--checkpoint", checkpoint, "--input", images, "--output", out, *flags]
        assert predict_cli.main([str(a) for a in argv]) == 0
    assert chosen == [True, False, False, True]
