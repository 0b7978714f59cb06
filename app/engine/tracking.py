"""TensorBoard, ``metrics.jsonl`` and progress bars, on the primary rank only.

Other ranks get a tracker whose methods do nothing, so the loop calls it unconditionally and no
``if rank == 0`` guards a code path that could hide a collective.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from tqdm import tqdm

from app.analysis.figures import montage_figure
from app.atomic import atomic_write_bytes
from app.config import Config
from app.distributed import DistEnv
from app.engine.validation import SliceSample

log = logging.getLogger(__name__)
SCALARS = (
    "train_loss",
    "val_loss",
    "dice",
    "floor_dice",  # the classical floor (app.analysis.floor) the model's Dice should beat
    "iou",
    "dice_per_volume_mean",
    "lr",
    "samples_per_s",
    "skipped_steps",
)


def read_metrics(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class Tracker:
    def __init__(self, cfg: Config, env: DistEnv, resumed_epoch: int):
        from torch.utils.tensorboard import SummaryWriter

        self.run_dir = cfg.run_dir
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.log_every = cfg.log_every
        self.log_images = cfg.log_images
        self.classes = cfg.classes  # K >= 2: the montage colours each class
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._truncate_metrics(resumed_epoch)
        # purge_step drops events of an epoch that was interrupted before its checkpoint
        self.writer = SummaryWriter(
            self.run_dir / "tensorboard", purge_step=resumed_epoch + 1 if resumed_epoch else None
        )
        self.writer.add_text(
            "config",
            "```\n" + yaml.safe_dump(cfg.to_dict(), sort_keys=False) + "```",
            global_step=resumed_epoch,
        )
        self.hparams = {
            k: (" ".join(map(str, v)) if isinstance(v, (list, tuple)) else v)
            for k, v in cfg.to_dict().items()
        }

    def _truncate_metrics(self, resumed_epoch: int) -> None:
        """Keep the records of completed (checkpointed) epochs only, so a resumed run continues
        the file with no duplicated or missing epoch."""
        records = read_metrics(self.metrics_path)
        kept = [r for r in records if r["epoch"] <= resumed_epoch]
        if len(kept) != len(records):
            text = "".join(json.dumps(r) + "\n" for r in kept)
            atomic_write_bytes(self.metrics_path, text.encode())

    def progress(self, iterable: Iterable, epoch: int, epochs: int) -> tqdm:
        return tqdm(
            iterable, desc=f"epoch {epoch}/{epochs}", unit="step", dynamic_ncols=True, leave=False
        )

    def show_loss(self, bar: tqdm, step: int, totals) -> None:
        """Refresh the bar's loss every ``log_every`` steps: one host sync each, primary only.
        ``totals`` is the loop's (loss sum of the steps taken, steps, skipped, samples)."""
        if step % self.log_every == 0:
            loss_sum, steps, skipped, _ = totals.tolist()
            shown = {"loss": f"{loss_sum / max(steps - skipped, 1):.4f}"}
            if skipped:
                shown["skipped"] = int(skipped)
            bar.set_postfix(shown)

    def log_epoch(self, record: dict[str, Any], sample: SliceSample | None) -> None:
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())
        epoch = record["epoch"]
        per_class = [k for k in record if "/" in k]  # K >= 2: "dice/NAME", one per class
        for key in (*SCALARS, *per_class):
            if record.get(key) is not None:
                self.writer.add_scalar(key, record[key], epoch)
        if sample is not None and self.log_images:
            self.writer.add_image(
                f"val/{sample.name}",
                montage(sample, epoch, self.classes),
                epoch,
                dataformats="HWC",
            )
        self.writer.flush()
        log.info(
            "epoch %d: %s",
            epoch,
            ", ".join(
                f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                for k, v in record.items()
                if k != "epoch"
            ),
        )

    def finish(self, final: dict[str, Any]) -> None:
        metrics = {
            f"hparam/{k}": v
            for k, v in final.items()
            if k in ("dice", "iou", "val_loss") and v is not None
        }
        if metrics:
            self.writer.add_hparams(self.hparams, metrics, run_name=".")
        self.writer.close()


class NullTracker:
    """What non-primary ranks get: the same calls, no output."""

    def progress(self, iterable: Iterable, epoch: int, epochs: int) -> Iterable:
        return iterable

    def show_loss(self, bar, step: int, totals) -> None:
        pass

    def log_epoch(self, record: dict[str, Any], sample: SliceSample | None) -> None:
        pass

    def finish(self, final: dict[str, Any]) -> None:
        pass


def make_tracker(cfg: Config, env: DistEnv, resumed_epoch: int) -> Tracker | NullTracker:
    return Tracker(cfg, env, resumed_epoch) if env.is_primary else NullTracker()


def montage(sample: SliceSample, epoch: int, classes: list[str] | None = None) -> np.ndarray:
    """The sample's slices, ground truth and prediction outlined (K >= 2 ``classes``: each class
    in its colour), as one RGB (H, W, 3) image."""
    title = f"{sample.name}, epoch {epoch}, Dice {sample.dice:.3f}"
    return montage_figure(
        sample.image,
        sample.label,
        sample.prediction,
        title,
        n_slices=len(sample.z),
        z_labels=sample.z,
        classes=classes,
    )
