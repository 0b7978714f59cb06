"""An exponential moving average of the weights (``--ema-decay``), which validation, ``best.pt``
and ``app.analysis.predict`` use in place of the last step's weights.

Why: late in training the validation Dice of the raw weights still swings by up to 0.01 from
one validation to the next (MNI152, bench/real_data.py): every step moves many voxels near the
0.5 boundary. The average sits at the centre of that walk, so its Dice is steadier and the
best checkpoint is less a matter of luck.

Not ``torch.optim.swa_utils.AveragedModel``: its update reads its step counter from the device
twice per step (``bool(n_averaged == 0)``, ``n_averaged > 0``), a host sync on CUDA that the
training step otherwise avoids; here the counter is a Python int and the update one
``_foreach_lerp_`` (the kernel AveragedModel's EMA uses too).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn


class WeightAverage:
    """EMA of ``model``'s floating-point parameters and buffers, in a frozen copy of ``model``.

    The decay warms up as ``min(decay, (1 + n) / (10 + n))`` after ``n`` updates (as in
    TensorFlow's ExponentialMovingAverage), so that a short run is not dominated by its random
    initial weights. Integer buffers (BatchNorm's batch counter) are copied.
    """

    def __init__(self, model: nn.Module, decay: float):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"EMA decay must be within (0, 1), got {decay}")
        half = sorted({str(p.dtype) for p in model.parameters() if p.dtype != torch.float32})
        if half:
            raise ValueError(
                f"the EMA averages float32 weights, and this model's are {', '.join(half)} "
                "(--opt-level O2/O3); use O1 autocast or --ema-decay 0"
            )
        self.decay = decay
        self.updates = 0
        self.model = copy.deepcopy(model).eval().requires_grad_(False)
        self._targets = _split(self.model)
        self._source: tuple[nn.Module, list[torch.Tensor], list[torch.Tensor]] | None = None

    def current_decay(self) -> float:
        return min(self.decay, (1 + self.updates) / (10 + self.updates))

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """Fold ``model``'s weights in (after an optimizer step; a skipped step folds in the
        unchanged weights, which only makes the average a little older)."""
        if self._source is None or self._source[0] is not model:  # lists built once per model
            self._source = (model, *_split(model))
        _, floating, integral = self._source
        torch._foreach_lerp_(self._targets[0], floating, 1.0 - self.current_decay())
        for mine, source in zip(self._targets[1], integral):
            mine.copy_(source)
        self.updates += 1

    def state_dict(self) -> dict[str, Any]:
        return {"decay": self.decay, "updates": self.updates, "weights": self.model.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["weights"])
        self.updates = int(state["updates"])


def _split(model: nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``model``'s floating-point and integer parameters and buffers, as the tensor objects
    themselves (not ``.detach()`` aliases, which would keep the old storage if a ``.data`` were
    reassigned); ``update`` runs under ``no_grad``, so in-place writes to them are allowed."""
    tensors = [*model.parameters(), *model.buffers()]
    return (
        [t for t in tensors if t.is_floating_point()],
        [t for t in tensors if not t.is_floating_point()],
    )


def inference_weights(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The weights a checkpoint predicts with: its EMA when it was trained with one (those are
    the weights its validation Dice, and so the choice of ``best.pt``, measured)."""
    average = state.get("ema")
    return average["weights"] if average else state["model"]
