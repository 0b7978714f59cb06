"""BCE + soft Dice, computed in float32 even when the forward pass runs under autocast."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from app.precision import ops as fp32_ops


class BCEDiceLoss(nn.Module):
    r"""``bce_weight * BCE + dice_weight * (1 - Dice_soft)``, averaged over the batch.

    With logits :math:`z`, probabilities :math:`p = \sigma(z)` and targets :math:`g \in \{0,1\}`
    over the :math:`N` voxels of one sample:

    .. math::

        \mathrm{BCE} = -\frac{1}{N}\sum_i \big[g_i \log p_i + (1-g_i)\log(1-p_i)\big]

        \mathrm{Dice_{soft}} = \frac{2\sum_i p_i g_i + s}{\sum_i p_i + \sum_i g_i + s},
        \qquad s = \text{smooth} = 1

    BCE is taken from the logits (``binary_cross_entropy_with_logits``, numerically stable) and
    averaged over every voxel of the batch; the Dice term is computed per sample and averaged
    over the batch, so a sample without foreground still pushes its probabilities to 0. The
    smoothing term keeps the Dice defined (and equal to 1) when prediction and target are empty.
    Both terms are computed from float32 logits through the fp32 sigmoid of ``app.precision.ops``.

    ``batch_dice=True`` sums the Dice's three terms over the whole batch instead (nnU-Net's
    batch Dice): one Dice, as the validation scores a volume, in which a patch holding a few
    foreground voxels weighs by its voxels rather than as much as a patch full of them.
    """

    def __init__(
        self,
        bce_weight: float = 1.0,
        dice_weight: float = 1.0,
        smooth: float = 1.0,
        batch_dice: bool = False,
    ):
        super().__init__()
        self.bce_weight, self.dice_weight, self.smooth = bce_weight, dice_weight, smooth
        self.batch_dice = batch_dice

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        with torch.autocast(logits.device.type, enabled=False):
            logits, target = logits.float(), target.float()
            bce = F.binary_cross_entropy_with_logits(logits, target)
            # one row per sample, or one row for the whole batch (batch Dice)
            rows = 1 if self.batch_dice else logits.shape[0]
            probs = fp32_ops.sigmoid(logits).reshape(rows, -1)
            target = target.reshape(rows, -1)
            intersection = (probs * target).sum(1)
            dice = (2 * intersection + self.smooth) / (probs.sum(1) + target.sum(1) + self.smooth)
            return self.bce_weight * bce + self.dice_weight * (1 - dice.mean())


class CEDiceLoss(nn.Module):
    r"""The multi-class counterpart of :class:`BCEDiceLoss`:
    ``ce_weight * CE + dice_weight * (1 - mean_c Dice_soft_c)`` over :math:`K \ge 2` classes.

    With logits :math:`z`, softmax probabilities :math:`p_{i,c}` and a class map
    :math:`g_i \in \{0, \dots, K-1\}` (one-hot :math:`y_{i,c}`) over the :math:`N` voxels of one
    sample:

    .. math::

        \mathrm{CE} = -\frac{1}{N}\sum_i \log p_{i,g_i}

        \mathrm{Dice_{soft,c}} = \frac{2\sum_i p_{i,c}\, y_{i,c} + s}
        {\sum_i p_{i,c} + \sum_i y_{i,c} + s}, \qquad s = \text{smooth} = 1

    CE is averaged over every voxel of the batch (``cross_entropy`` of the logits, numerically
    stable); the Dice is computed per sample and per foreground class :math:`c = 1 \dots K-1`
    and averaged over both, as nnU-Net leaves the background out of its Dice: background is most
    of a CT volume and its near-perfect Dice would dilute the classes that matter.
    ``batch_dice=True`` computes each class's Dice over the whole batch, as the binary loss does.
    The softmax is the fp32 one of ``app.precision.ops``; both terms are computed in float32.
    ``target`` is ``(B, 1, D, H, W)`` holding class indices (any dtype), as the patches carry it.
    """

    def __init__(
        self,
        num_classes: int,
        ce_weight: float = 1.0,
        dice_weight: float = 1.0,
        smooth: float = 1.0,
        batch_dice: bool = False,
    ):
        super().__init__()
        if num_classes < 2:
            raise ValueError(f"CEDiceLoss needs 2 or more classes, got {num_classes}")
        self.num_classes = num_classes
        self.ce_weight, self.dice_weight, self.smooth = ce_weight, dice_weight, smooth
        self.batch_dice = batch_dice

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        with torch.autocast(logits.device.type, enabled=False):
            logits = logits.float()
            classes = target[:, 0].long()
            ce = F.cross_entropy(logits, classes)
            probs = fp32_ops.softmax(logits, dim=1)[:, 1:].flatten(2)  # (B, K-1, N)
            onehot = F.one_hot(classes.flatten(1), self.num_classes)[..., 1:]
            onehot = onehot.transpose(1, 2).float()
            if self.batch_dice:  # the batch as one sample: (1, K-1, B*N)
                probs, onehot = (t.transpose(0, 1).flatten(1)[None] for t in (probs, onehot))
            intersection = (probs * onehot).sum(2)
            denominator = probs.sum(2) + onehot.sum(2) + self.smooth
            dice = (2 * intersection + self.smooth) / denominator
            return self.ce_weight * ce + self.dice_weight * (1 - dice.mean())
