"""Confusion counts -> Dice and IoU, per volume and global.

Dice = 2TP / (2TP + FP + FN), IoU = TP / (TP + FP + FN), of the thresholded prediction
(sigmoid > 0.5). A volume that is empty in both prediction and label scores 1 for both: there
was nothing to find and nothing was found. The global figures sum the counts over the whole
validation set first, so large volumes weigh more; the per-volume mean weighs volumes equally.

With ``--num-classes K >= 2`` (:func:`class_counts`) a voxel's class is the argmax of its float32
softmax, and each foreground class ``1..K-1`` gets its own TP/FP/FN (class c against the rest);
the background is not scored, as its Dice is near 1 on any CT volume.
"""

from __future__ import annotations

import torch

from app.precision import ops as fp32_ops


def confusion_counts(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``[TP, FP, FN]`` as float64 (exact for any realistic voxel count)."""
    pred = fp32_ops.sigmoid(logits) > 0.5
    truth = target > 0.5
    tp = (pred & truth).sum()
    fp = (pred & ~truth).sum()
    fn = (~pred & truth).sum()
    return torch.stack([tp, fp, fn]).double()


def dice_iou(counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dice and IoU from ``[..., 3]`` counts, 1 where prediction and label are both empty."""
    tp, fp, fn = counts.unbind(-1)
    union = tp + fp + fn
    empty = union == 0
    dice = torch.where(empty, 1.0, 2 * tp / (2 * tp + fp + fn).clamp_min(1))
    iou = torch.where(empty, 1.0, tp / union.clamp_min(1))
    return dice, iou


def class_counts(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``(K-1, 3)`` ``[TP, FP, FN]`` of each foreground class ``1..K-1`` for K-channel
    ``logits`` (a voxel's class is the argmax of its float32 softmax) and a class-map ``target``
    of shape ``(B, 1, ...)``; float64, as :func:`confusion_counts`."""
    pred = fp32_ops.softmax(logits, dim=1).argmax(1)
    truth = target[:, 0].long()
    rows = []
    for c in range(1, logits.shape[1]):
        p, t = pred == c, truth == c
        rows.append(torch.stack([(p & t).sum(), (p & ~t).sum(), (~p & t).sum()]))
    return torch.stack(rows).double()
