"""Exact distributed evaluation: every validation volume counted once, on one rank.

Volumes are sharded round-robin without padding (unlike ``DistributedSampler``, which pads with
duplicates). Each rank fills its volumes' rows of a ``(volumes, 4)`` table of TP/FP/FN/loss and
one ``all_reduce(SUM)`` assembles the table on every rank: global figures come from summed
counts, never from means of means. With ``--num-classes K >= 2`` a row holds TP/FP/FN of each
foreground class ``1..K-1``, then the loss: ``(volumes, 3(K-1) + 1)``, reduced the same way.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from app.data.dataset import Volume
from app.distributed import DistEnv, reduce_tensor
from app.engine.inference import predict_logits
from app.labels import LabelScheme, scheme_of_names
from app.metrics import dice_iou
from app.precision.amp import Precision


@dataclass
class EvalResult:
    names: list[str]
    table: torch.Tensor  # (volumes, 3F + 1): TP, FP, FN of F classes, then loss; float64, CPU
    classes: list[str] = field(default_factory=list)  # K >= 2: class names, background first

    @property
    def labels(self) -> LabelScheme:
        return scheme_of_names(self.classes)

    @property
    def counts(self) -> torch.Tensor:
        """``(volumes, F, 3)`` TP/FP/FN; F = 1 (binary) or the K-1 foreground classes."""
        return self.table[:, :-1].reshape(len(self.table), -1, 3)

    @property
    def loss(self) -> float:
        return float(self.table[:, -1].mean())

    @property
    def global_dice_iou(self) -> tuple[float, float]:
        """Global Dice and IoU; for K >= 2 their mean over the foreground classes."""
        dice, iou = dice_iou(self.counts.sum(0))
        return float(dice.mean()), float(iou.mean())

    @property
    def per_volume(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Dice and IoU of each volume; for K >= 2 the mean over the foreground classes."""
        dice, iou = dice_iou(self.counts)
        return dice.mean(1), iou.mean(1)

    def summary(self) -> dict[str, float]:
        dice, iou = self.global_dice_iou
        dice_v, iou_v = self.per_volume
        figures = {
            "val_loss": self.loss,
            "dice": dice,
            "iou": iou,
            "dice_per_volume_mean": float(dice_v.mean()),
            "iou_per_volume_mean": float(iou_v.mean()),
        }
        # K >= 2: one figure per foreground class, named "dice/NAME" (a TensorBoard group)
        class_dice, class_iou = dice_iou(self.counts.sum(0))
        volume_dice, volume_iou = dice_iou(self.counts)
        for c, name in enumerate(self.classes[1:]):
            figures[f"dice/{name}"] = float(class_dice[c])
            figures[f"iou/{name}"] = float(class_iou[c])
            figures[f"dice_per_volume_mean/{name}"] = float(volume_dice[:, c].mean())
            figures[f"iou_per_volume_mean/{name}"] = float(volume_iou[:, c].mean())
        return figures

    def volume_rows(self) -> list[dict]:
        """One record per volume for ``eval.json``: Dice, IoU, loss and counts (K >= 2: the
        foreground mean, then each class's own under ``classes``)."""
        dice_v, iou_v = self.per_volume
        dice_c, iou_c = dice_iou(self.counts)
        rows = []
        for v, name in enumerate(self.names):
            row = {"name": name, "dice": float(dice_v[v]), "iou": float(iou_v[v])}
            row["loss"] = float(self.table[v, -1])
            counted = {
                class_name: {
                    "dice": float(dice_c[v, c]),
                    "iou": float(iou_c[v, c]),
                    **dict(zip(("tp", "fp", "fn"), (int(x) for x in self.counts[v, c]))),
                }
                for c, class_name in enumerate(self.labels.scored)
            }
            # binary: the mask's counts in the row itself; K >= 2: each class's under "classes"
            binary = dict(zip(("tp", "fp", "fn"), (int(x) for x in self.counts[v, 0])))
            rows.append(row | self.labels.choose(binary=binary, classes={"classes": counted}))
        return rows


@dataclass
class SliceSample:
    """A few z-slices through the foreground of one validation volume, for the montage that
    TensorBoard shows every epoch (``app.analysis.figures.montage_figure``)."""

    name: str
    z: list[int]
    image: np.ndarray  # (len(z), H, W)
    label: np.ndarray
    prediction: np.ndarray
    dice: float


MONTAGE_SLICES = 4  # z-slices per validation sample: a cheap montage every epoch


def pick_slices(label: np.ndarray, prediction: np.ndarray, n: int) -> list[int]:
    """Up to ``n`` evenly spaced z indices inside the z-range where label or prediction has
    foreground (the whole depth when both are empty), endpoints excluded; all when ``n >= D``."""
    depth = label.shape[0]
    if n >= depth:
        return list(range(depth))
    occupied = np.flatnonzero(
        (np.asarray(label) > 0).any((1, 2)) | (np.asarray(prediction) > 0).any((1, 2))
    )
    low, high = (int(occupied[0]), int(occupied[-1])) if occupied.size else (0, depth - 1)
    return sorted(set(np.linspace(low, high, n + 2)[1:-1].round().astype(int).tolist()))


def shard(items: list, env: DistEnv) -> list[int]:
    """Indices of ``items`` this rank owns: round-robin, no padding, each index exactly once."""
    return list(range(env.rank, len(items), env.world_size))


def evaluate(
    model: nn.Module,
    volumes: list[Volume],
    loss_fn: nn.Module,
    precision: Precision,
    env: DistEnv,
    window: tuple[int, int, int],
    mode: str,
    overlap: float,
    sw_batch_size: int,
    classes: Sequence[str] = (),
    tta: bool = False,
) -> tuple[EvalResult, SliceSample | None]:
    """Evaluate the unwrapped ``model`` (a DDP wrapper would broadcast buffers on every forward,
    a collective that ranks with different shard sizes would not all reach). ``classes``: the
    K >= 2 class names, background first (none: the binary task); ``tta``: the logits averaged
    over the 8 mirrorings."""
    classes = list(classes)
    labels = scheme_of_names(classes)
    blend, overlap = ("gaussian", overlap) if mode == "whole" else ("constant", 0.0)
    scored = len(labels.scored)  # rows of counts: the binary mask, or the K-1 classes
    table = torch.zeros(len(volumes), 3 * scored + 1, dtype=torch.float64, device=env.device)
    sample = None
    was_training = model.training
    model.eval()
    for index in shard(volumes, env):
        vol = volumes[index]
        logits = predict_logits(
            model, vol.image, window, precision, overlap, sw_batch_size, blend, tta
        )
        label = torch.as_tensor(vol.label, device=env.device)[None, None]
        table[index, :-1] = labels.counts(logits, label).flatten()
        table[index, -1] = loss_fn(logits, label).double()
        if sample is None:
            # binary: sigmoid > 0.5 <=> logit > 0; K >= 2: the argmax class (the montage colours
            # each class)
            pred = labels.mask_of_logits(logits[0]).cpu().numpy()
            z = pick_slices(vol.label, pred, MONTAGE_SLICES)
            dice = float(dice_iou(table[index, :-1].reshape(-1, 3))[0].mean())
            sample = SliceSample(vol.name, z, vol.image[z], vol.label[z], pred[z], dice)
    model.train(was_training)
    reduce_tensor(table)
    return EvalResult([v.name for v in volumes], table.cpu(), classes), sample


class ValidationCadence:
    """Which epochs validate: every ``every`` epochs, or with ``every=0`` as often as keeps
    validation within ``share`` of the training time, from the times measured at the last
    validation (the first epoch validates, to measure). The last epoch always validates, and
    every validation is of whole volumes, so the final and the best checkpoints are scored
    whole. Call :meth:`measured` on every rank with the same figures (rank 0's, broadcast).
    """

    def __init__(self, every: int, epochs: int, start_epoch: int = 0, share: float = 0.1):
        self.every, self.epochs, self.share = every, epochs, share
        self.next = start_epoch + 1  # auto: measure at once, also after a resume

    @property
    def auto(self) -> bool:
        return self.every == 0

    def due(self, epoch: int) -> bool:
        if epoch == self.epochs:
            return True
        return epoch % self.every == 0 if self.every else epoch >= self.next

    def measured(self, epoch: int, val_s: float, train_s: float) -> int:
        """Record one validation's cost; returns the epochs until the next one."""
        gap = self.every or max(1, math.ceil(val_s / (self.share * max(train_s, 1e-9))))
        self.next = epoch + gap
        return gap
