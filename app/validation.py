"""Exact distributed evaluation: every validation volume counted once, on one rank.

Volumes are sharded round-robin without padding (unlike ``DistributedSampler``, which pads with
duplicates). Each rank fills its volumes' rows of a ``(volumes, 4)`` table of TP/FP/FN/loss and
one ``all_reduce(SUM)`` assembles the table on every rank: global figures come from summed
counts, never from means of means.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from app.data import Volume
from app.distributed import DistEnv, reduce_tensor
from app.inference import predict_logits
from app.losses import BCEDiceLoss
from app.metrics import confusion_counts, dice_iou
from app.precision import Precision


@dataclass
class EvalResult:
    names: list[str]
    table: torch.Tensor  # (volumes, 4): TP, FP, FN, loss; float64 on CPU

    @property
    def loss(self) -> float:
        return float(self.table[:, 3].mean())

    @property
    def global_dice_iou(self) -> tuple[float, float]:
        dice, iou = dice_iou(self.table[:, :3].sum(0))
        return float(dice), float(iou)

    @property
    def per_volume(self) -> tuple[torch.Tensor, torch.Tensor]:
        return dice_iou(self.table[:, :3])

    def summary(self) -> dict[str, float]:
        dice, iou = self.global_dice_iou
        dice_v, iou_v = self.per_volume
        return {
            "val_loss": self.loss,
            "dice": dice,
            "iou": iou,
            "dice_per_volume_mean": float(dice_v.mean()),
            "iou_per_volume_mean": float(iou_v.mean()),
        }


@dataclass
class SliceSample:
    """A few z-slices through the foreground of one validation volume, for the montage that
    TensorBoard shows every epoch (``app.report.montage_figure``)."""

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
    loss_fn: BCEDiceLoss,
    precision: Precision,
    env: DistEnv,
    window: tuple[int, int, int],
    mode: str,
    overlap: float,
    sw_batch_size: int,
) -> tuple[EvalResult, SliceSample | None]:
    """Evaluate the unwrapped ``model`` (a DDP wrapper would broadcast buffers on every forward,
    a collective that ranks with different shard sizes would not all reach)."""
    blend, overlap = ("gaussian", overlap) if mode == "whole" else ("constant", 0.0)
    table = torch.zeros(len(volumes), 4, dtype=torch.float64, device=env.device)
    sample = None
    was_training = model.training
    model.eval()
    for index in shard(volumes, env):
        vol = volumes[index]
        logits = predict_logits(model, vol.image, window, precision, overlap, sw_batch_size, blend)
        label = torch.as_tensor(vol.label, device=env.device)[None, None]
        table[index, :3] = confusion_counts(logits, label)
        table[index, 3] = loss_fn(logits, label).double()
        if sample is None:
            pred = (logits[0, 0] > 0).cpu().numpy()  # sigmoid > 0.5 <=> logit > 0
            z = pick_slices(vol.label, pred, MONTAGE_SLICES)
            dice = float(dice_iou(table[index, :3])[0])
            sample = SliceSample(vol.name, z, vol.image[z], vol.label[z], pred[z], dice)
    model.train(was_training)
    reduce_tensor(table)
    return EvalResult([v.name for v in volumes], table.cpu()), sample


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
