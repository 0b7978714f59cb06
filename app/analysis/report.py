"""Pictures of a training run: ``python -m app.report RUN_DIR`` writes ``RUN_DIR/report/``.

- ``curves.png``: train and validation loss, validation Dice and IoU (global, from summed counts;
  the per-volume mean dashed), the learning rate and the throughput, per epoch, from
  ``metrics.jsonl``; the best epoch (highest Dice) is marked, and the floors the Dice should
  beat are drawn as horizontal lines: the classical floor the trainer logged (``floor_dice``)
  and, when ``RUN_DIR/learned_floor.json`` exists (``python -m app.learned_floor --run
  RUN_DIR``), the learned floor.
- ``montage_NAME.png`` for the first ``--volumes`` validation volumes (by name): evenly spaced
  axial (z) slices through the foreground, the image in grey, the ground-truth outline and the
  prediction outline in two colours, the volume's Dice in the title. The prediction is the one
  ``app.analysis.predict`` makes (same checkpoint, preprocessing, windows and threshold), so the
  Dice is the one the trainer reports for that volume.
- ``grains_NAME.png`` for the same volumes (unless ``--no-grains``): the predicted mask split into
  grains (:mod:`app.analysis.grains`), each grain in its own colour, with the ground-truth outline;
  the title gives the object F1 against the true grains (the split's ``instances/`` maps when there
  are, else the label's watershed), merges and splits.
- ``psd.png``: the size distributions of the predicted and the true grains of those volumes
  (histogram by number, cumulative by volume). ``psd.png`` and the grain montages also go to the
  run's TensorBoard, under ``report/``.

For a ``--num-classes K >= 2`` run the montages colour each foreground class (its prediction
filled, its ground truth outlined, in the same colour), the Dice is the mean over the foreground
classes, and the grain pictures are left out (they are of binary masks).

The figures are drawn by ``app.analysis.figures`` (which also draws the montage TensorBoard shows at
each validation) and written atomically.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from app.analysis import grains
from app.analysis.cli import LEARNED_FLOOR_JSON, HelpFormatter, RunDirError, run_config
from app.analysis.figures import curves_figure, figure_png, montage_figure, png_bytes, psd_figure
from app.analysis.predict import load_predictor
from app.atomic import atomic_write_bytes
from app.config import ConfigError
from app.data.dataset import SPLITS, DataError, load_volume_pair, pair_files
from app.data.volume_io import VolumeError, read_volume, voxel_spacing
from app.engine.checkpoint import CheckpointError
from app.engine.tracking import read_metrics
from app.metrics import dice_iou


class ReportError(RunDirError):
    """The run directory is unusable; the message names the file."""


# ----------------------------------------------------------------------------- the run
def checkpoint_path(run_dir: Path, choice: str) -> Path:
    if choice in ("best", "last"):
        return run_dir / "checkpoints" / f"{choice}.pt"
    return Path(choice)


def learned_floor_dice(run_dir: Path) -> float | None:
    """The val Dice of ``RUN_DIR/learned_floor.json`` (``python -m app.learned_floor --run``),
    or None when the run has none."""
    path = run_dir / LEARNED_FLOOR_JSON
    if not path.is_file():
        return None
    try:
        dice = float(json.loads(path.read_text())["val_dice"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ReportError(
            f"{path}: unreadable ({exc!r}); fit it again with python -m app.learned_floor "
            f"--run {run_dir}, or remove it"
        ) from exc
    if not 0.0 <= dice <= 1.0:
        raise ReportError(f"{path}: val_dice {dice} is not a Dice in [0, 1]")
    return dice


def curves_of_run(run_dir: Path):
    """The curves figure of a run: its ``metrics.jsonl``, with the classical floor it logged
    and the learned floor when ``learned_floor.json`` is there."""
    metrics = run_dir / "metrics.jsonl"
    try:
        records = read_metrics(metrics)
    except (OSError, ValueError) as exc:
        raise ReportError(f"{metrics}: unreadable ({exc})") from exc
    if not records:
        raise ReportError(
            f"{metrics}: no epochs recorded; is {run_dir} a run directory of app.train?"
        )
    title = f"{run_dir.name}: training curves"
    return curves_figure(records, title, learned_floor=learned_floor_dice(run_dir))


def write_curves(run_dir: Path, out_dir: Path) -> Path:
    path = out_dir / "curves.png"
    atomic_write_bytes(path, figure_png(curves_of_run(run_dir)))
    return path


def write_montages(
    run_dir: Path,
    out_dir: Path,
    checkpoint: Path,
    data_root: str | None,
    volumes: int,
    n_slices: int,
    device: str,
    grain_params: grains.GrainParams | None,
) -> list[tuple[Path, str]]:
    """Montages (and grain montages and ``psd.png`` unless ``grain_params`` is None) of the
    first ``volumes`` val volumes; returns each file written with a caption."""
    import torch

    predictor = load_predictor(checkpoint, _device(device))
    labels = predictor.cfg.labels
    classes = labels.names  # K >= 2: class colours, and no grain figures
    grain_params = labels.choose(binary=grain_params, classes=None)
    root = Path(data_root or run_config(run_dir).get("data_root") or predictor.cfg.data_root)
    if not root.is_dir():
        raise ReportError(f"{root}: data root of the run is missing; pass --data-root")
    val = root / SPLITS["val"]
    maps = grains.instance_maps(val / "instances")
    written, diameters, units = [], {"predicted": [], "true": []}, set()
    rng = np.random.default_rng(0)
    for name, image_path, label_path in pair_files(val)[:volumes]:
        vol = load_volume_pair(
            name, image_path, label_path, predictor.normalization, rng, labels.num_classes
        )
        logits = predictor.logits(vol.image)
        target = torch.as_tensor(vol.label, device=logits.device)[None, None]
        counts = labels.counts(logits, target)
        dice = float(dice_iou(counts.cpu())[0].mean())  # K >= 2: mean over foreground classes
        # as the metrics count: sigmoid > 0.5, or the class of highest probability
        prediction = labels.mask_of_probabilities(labels.probabilities(logits)).cpu().numpy()
        title = f"{name}: Dice {dice:.3f} ({checkpoint.name}, {run_dir.name})"
        rgb = montage_figure(vol.image, vol.label, prediction, title, n_slices, classes=classes)
        path = out_dir / f"montage_{name}.png"
        atomic_write_bytes(path, png_bytes(rgb))
        written.append((path, f"Dice {dice:.4f}"))
        if grain_params is None:
            continue
        spacing, unit = voxel_spacing(read_volume(label_path)[1])
        predicted = grains.split_grains(prediction, grain_params, spacing)
        truth = grains.true_instances(
            vol.label > 0, label_path, maps.get(name), grain_params, spacing
        )
        match = grains.match_grains(predicted, truth)
        caption = (
            f"object F1 {match.scores['object_f1']:.3f}, {match.n_pred} grains predicted, "
            f"{match.n_true} true, {match.merged} merged, {match.split} split"
        )
        rgb = montage_figure(
            vol.image, vol.label, prediction, f"{name}: {caption}", n_slices, instances=predicted
        )
        path = out_dir / f"grains_{name}.png"
        atomic_write_bytes(path, png_bytes(rgb))
        written.append((path, caption))
        diameters["predicted"].append(grains.equivalent_diameters(predicted, spacing))
        diameters["true"].append(grains.equivalent_diameters(truth, spacing))
        units.add(unit)
    if grain_params is not None and written:
        pooled = {k: np.concatenate(v) for k, v in diameters.items()}
        truth_source = "instance maps" if maps else "watershed of the labels"
        unit = units.pop() if len(units) == 1 else "mixed units"
        fig = psd_figure(
            pooled,
            unit,
            f"{run_dir.name}: grain sizes, {len(diameters['true'])} val volume(s), "
            f"true grains from the {truth_source}",
        )
        path = out_dir / "psd.png"
        atomic_write_bytes(path, figure_png(fig))
        errors = grains.distribution_error(pooled["predicted"], pooled["true"])
        d50 = errors["d50_error"]
        written.append((path, "d50 error " + ("n/a" if d50 is None else f"{d50:+.3g} {unit}")))
    return written


def log_to_tensorboard(run_dir: Path, pictures: list[Path], step: int) -> None:
    """The grain pictures into the run's TensorBoard, under ``report/``."""
    from matplotlib.image import imread
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(str(run_dir / "tensorboard")) as writer:
        for path in pictures:
            rgb = (imread(path)[..., :3] * 255).astype(np.uint8)
            writer.add_image(f"report/{path.stem}", rgb, step, dataformats="HWC")


def _device(name: str):
    from app.distributed import resolve_device

    return resolve_device(name, 0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m app.report",
        description="""\
Pictures of a training run, in RUN_DIR/report/:
  curves.png          loss, Dice, IoU, learning rate and throughput per epoch; the
                      classical floor and, when RUN_DIR/learned_floor.json is there
                      (python -m app.learned_floor --run RUN_DIR), the learned floor
  montage_NAME.png    for the first --volumes validation volumes: z-slices with the
                      ground-truth and predicted outlines and the volume's Dice
                      (predicted as app.analysis.predict does, with the run's checkpoint)
  grains_NAME.png     the same slices with the predicted grains, one colour each,
                      and the object F1, merges and splits (see app.analysis.grains)
  psd.png             predicted and true grain size distributions of those volumes
The grain pictures also go to the run's TensorBoard, under report/.""",
        formatter_class=HelpFormatter,
    )
    parser.add_argument(
        "run_dir", metavar="RUN_DIR", type=Path, help="run directory of app.train (--output-dir)"
    )
    parser.add_argument(
        "--data-root", metavar="DIR", help="data root (default: data_root of RUN_DIR/config.yaml)"
    )
    parser.add_argument(
        "--checkpoint",
        metavar="best|last|PATH",
        default="best",
        help="best, last, or a checkpoint path, for the montages",
    )
    parser.add_argument(
        "--volumes",
        metavar="N",
        type=int,
        default=2,
        help="validation volumes to draw (0: curves only)",
    )
    parser.add_argument("--slices", metavar="N", type=int, default=8, help="z-slices per montage")
    parser.add_argument(
        "--no-grains", action="store_true", help="no grain montages, size distribution or logging"
    )
    parser.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="where to predict the montage volumes",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if not args.run_dir.is_dir():
            raise ReportError(f"{args.run_dir}: no such run directory")
        if args.volumes < 0 or args.slices < 1:
            raise ReportError("--volumes must be 0 or more and --slices at least 1")
        out_dir = args.run_dir / "report"
        out_dir.mkdir(exist_ok=True)
        print(f"wrote {write_curves(args.run_dir, out_dir)}")
        if args.volumes:
            written = write_montages(
                args.run_dir,
                out_dir,
                checkpoint_path(args.run_dir, args.checkpoint),
                args.data_root,
                args.volumes,
                args.slices,
                args.device,
                None if args.no_grains else grains.GrainParams(),
            )
            for path, caption in written:
                print(f"wrote {path} ({caption})")
            pictures = [p for p, _ in written if not p.name.startswith("montage_")]
            if pictures:
                last_epoch = read_metrics(args.run_dir / "metrics.jsonl")[-1]["epoch"]
                log_to_tensorboard(args.run_dir, pictures, last_epoch)
    except (
        RunDirError,
        CheckpointError,
        ConfigError,
        DataError,
        VolumeError,
        grains.GrainError,
        OSError,
    ) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
