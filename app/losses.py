"""BCE + soft Dice, computed in float32 even when the forward pass runs under autocast."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from app import precision


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
    Both terms are computed from float32 logits through the fp32 sigmoid of ``app.precision``.
    """

    def __init__(self, bce_weight: float = 1.0, dice_weight: float = 1.0, smooth: float = 1.0):
        super().__init__()
        self.bce_weight, self.dice_weight, self.smooth = bce_weight, dice_weight, smooth

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        with torch.autocast(logits.device.type, enabled=False):
            logits, target = logits.float(), target.float()
            bce = F.binary_cross_entropy_with_logits(logits, target)
            probs = precision.sigmoid(logits).flatten(1)
            target = target.flatten(1)
            intersection = (probs * target).sum(1)
            dice = (2 * intersection + self.smooth) / (probs.sum(1) + target.sum(1) + self.smooth)
            return self.bce_weight * bce + self.dice_weight * (1 - dice.mean())
