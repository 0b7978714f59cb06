"""The parts of a trainer that own state, each with ``state_dict``/``load_state_dict``: what the
checkpoint manager (``app.engine.checkpointer``) saves and restores, part by part.

The scheduler and the precision (``app.precision.amp``: GradScaler or apex ``amp``) already are such
parts; here are the others: the model's weights (saved unwrapped), the optimizer (whose kernel
choice is this run's, not saved state), the weight average, the random generators (every rank's
in a mid-epoch checkpoint), the sampler's position inside an epoch, and the progress (epoch, best
Dice, the last record, the configuration they were reached with).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from app.config import Config, ConfigError
from app.distributed import unwrap
from app.engine.checkpoint import CheckpointError, rng_state, set_rng_state
from app.engine.ema import WeightAverage
from app.engine.epoch_position import EpochPosition

log = logging.getLogger("app.train")


class ModelWeights:
    """The model's weights, saved unwrapped (no ``module.`` prefix) whatever wraps it."""

    def __init__(self, model: nn.Module):
        self.model = model

    def state_dict(self) -> dict[str, torch.Tensor]:
        return unwrap(self.model).state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor], saved: dict, path) -> None:
        """``saved``: the checkpoint's config, named in the error when the weights do not fit."""
        try:
            unwrap(self.model).load_state_dict(state)
        except RuntimeError as exc:
            raise CheckpointError(
                f"{path}: its weights do not fit this model: it was trained with --f-maps "
                f"{saved.get('f_maps')} --depth {saved.get('depth')} --num-classes "
                f"{saved.get('num_classes', 1)}; resume with those, or use a "
                f"new --output-dir ({str(exc).splitlines()[0]})"
            ) from exc


class OptimizerState:
    """Adam's moments and steps; which Adam kernel runs (``fused``) stays this run's choice."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        kernels = [group.get("fused") for group in self.optimizer.param_groups]
        self.optimizer.load_state_dict(state)
        for group, fused in zip(self.optimizer.param_groups, kernels):
            group["fused"] = fused


class AverageState:
    """The weight average of ``--ema-decay`` (``None`` when off). A checkpoint without one
    starts it from its weights."""

    def __init__(self, average: WeightAverage | None):
        self.average = average

    def state_dict(self) -> dict[str, Any] | None:
        return self.average.state_dict() if self.average else None

    def load_state_dict(self, state: dict[str, Any] | None, weights: dict, path) -> None:
        if self.average is None:
            return
        if state:
            self.average.load_state_dict(state)
        else:
            log.info("%s has no weight average: --ema-decay starts one from its weights", path)
            self.average.model.load_state_dict(weights)


def weight_average(module: nn.Module, cfg: Config) -> WeightAverage | None:
    if not cfg.ema_decay:
        return None
    try:
        return WeightAverage(module, cfg.ema_decay)
    except ValueError as exc:
        raise ConfigError(f"--ema-decay {cfg.ema_decay:g}: {exc}") from exc


class RandomState:
    """The torch, CUDA, numpy and Python generators of this process."""

    def __init__(self, rank: int = 0, world_size: int = 1):
        self.rank, self.world_size = rank, world_size

    def state_dict(self) -> dict[str, Any]:
        return rng_state()

    def load_state_dict(self, state: dict[str, Any], per_rank: list | None = None) -> None:
        """This rank's generators as a mid-epoch checkpoint saved them (``per_rank``: every
        rank's), else ``state`` (rank 0's: an end-of-epoch checkpoint, or another world size)."""
        per_rank = per_rank or []
        set_rng_state(per_rank[self.rank] if len(per_rank) == self.world_size else state)


class SamplerPosition:
    """Where the sampler stands inside an epoch (``app.engine.epoch_position``): set by the
    mid-epoch recovery write, and what the first epoch of a resumed run continues from."""

    def __init__(self) -> None:
        self.position: EpochPosition | None = None

    def state_dict(self) -> dict[str, Any] | None:
        return self.position.to_dict() if self.position else None

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        self.position = EpochPosition(**state) if state else None


@dataclass
class Progress:
    """How far training got: the epochs completed, the best validation Dice, that epoch's record,
    and the configuration they were reached with (what a mid-epoch checkpoint also carries)."""

    cfg: Config
    epoch: int = 0
    best_dice: float = -1.0
    record: dict[str, Any] = field(default_factory=dict)

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "best_dice": self.best_dice,
            "metrics": self.record,
            "config": self.cfg.to_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.best_dice = state["epoch"], state["best_dice"]
        self.record = state.get("metrics") or {}

    def finished(self, record: dict[str, Any], cfg: Config) -> bool:
        """Record an epoch's figures; returns whether its Dice is the best so far."""
        improved = record.get("dice", -1.0) > self.best_dice
        self.best_dice = max(self.best_dice, record.get("dice", -1.0))
        self.epoch, self.record, self.cfg = record["epoch"], record, cfg
        return improved
