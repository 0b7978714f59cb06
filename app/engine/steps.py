"""The training step, shared by the loop (``app.engine``), the auto probe (``app.precision.auto``)
and the benchmarks (``bench/``): the optimizer and its schedule, one epoch of steps, and a stepper
on synthetic data that runs exactly that step so that what is timed is what trains.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn
from torch.optim.lr_scheduler import ChainedScheduler, LinearLR, LRScheduler, MultiStepLR

from app.config import Config
from app.distributed import DistEnv, prepare, reduce_tensor, unwrap
from app.engine.compiled_model import compile_model
from app.engine.ema import WeightAverage
from app.engine.epoch_position import EpochPosition
from app.engine.preemption import NO_CONTROL, EpochControl, NullControl
from app.engine.tracking import NullTracker, Tracker
from app.labels import build_loss
from app.model import build_model
from app.precision.amp import Precision, build_precision


def scaled_lr(cfg: Config, world_size: int) -> float:
    factor = {"none": 1.0, "linear": world_size, "sqrt": math.sqrt(world_size)}[cfg.lr_scaling]
    return cfg.lr * factor


def build_optimizer(
    model: nn.Module, cfg: Config, env: DistEnv, backend: str
) -> torch.optim.Optimizer:
    """Adam over ``model``'s parameters. Fused (one kernel per step on CPU and CUDA) unless apex
    owns the step: the fused kernel also takes the non-finite flag on the device, so a skipped
    step costs no host sync (``app.precision.amp.NonFiniteGuard``)."""
    return torch.optim.Adam(
        model.parameters(),
        lr=scaled_lr(cfg, env.world_size),
        weight_decay=cfg.weight_decay,
        decoupled_weight_decay=cfg.decoupled_weight_decay,
        fused=backend == "native" and env.device.type in ("cpu", "cuda"),
    )


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: Config) -> LRScheduler:
    """MultiStepLR over epochs, after an optional linear warmup; stepped once per epoch."""
    multistep = MultiStepLR(optimizer, milestones=list(cfg.milestones), gamma=cfg.gamma)
    if not cfg.warmup_epochs:
        return multistep
    warmup = LinearLR(
        optimizer, start_factor=1.0 / (cfg.warmup_epochs + 1), total_iters=cfg.warmup_epochs
    )
    return ChainedScheduler([warmup, multistep], optimizer=optimizer)


@dataclass(frozen=True)
class EpochTotals:
    """One epoch's training figures, summed over every rank."""

    loss: float  # mean loss of the steps taken (NaN when every step was skipped)
    steps: int  # steps, all ranks together
    skipped: int  # steps whose gradients held NaN/Inf, skipped by every rank
    samples: int

    @property
    def skipped_fraction(self) -> float:
        return self.skipped / self.steps if self.steps else 0.0


class NonFiniteError(RuntimeError):
    """Most steps of an epoch had NaN/Inf gradients: training cannot go on as configured."""


def check_steps_taken(totals: EpochTotals, epoch: int, cfg: Config) -> None:
    """A few skipped steps are routine (an fp16 loss scale finding its level); most of an epoch
    skipped means the weights stopped learning, so stop and say what to change."""
    if 2 * totals.skipped <= totals.steps:
        return
    change = (
        f"train in fp32 with --opt-level O0 (this run: {cfg.opt_level} {cfg.amp_dtype})"
        if cfg.opt_level != "O0"
        else "check the data for NaN/Inf"
    )
    raise NonFiniteError(
        f"epoch {epoch}: {totals.skipped} of {totals.steps} training steps had NaN or Inf "
        f"gradients and were skipped; nothing of this epoch was saved. Lower --lr (now "
        f"{cfg.lr:g}), or {change}"
    )


def train_one_epoch(
    model: nn.Module,
    loader: Iterable,
    optimizer: torch.optim.Optimizer,
    precision: Precision,
    loss_fn: nn.Module,
    tracker: Tracker | NullTracker,
    env: DistEnv,
    epoch: int,
    epochs: int,
    average: WeightAverage | None = None,
    control: EpochControl | NullControl = NO_CONTROL,
    position: EpochPosition | None = None,
) -> EpochTotals:
    """Every step of one epoch, each folded into ``average`` when there is one; the totals are
    reduced across ranks once, after the loop. A resumed epoch starts after ``position.step``
    with its partial sums; ``control`` may write a mid-epoch checkpoint or stop the run.

    The loss sum and the skipped-step count stay on the device: no per-step host sync or
    collective (the progress bar reads them every ``--log-every`` steps, primary rank only;
    ``control`` agrees with the other ranks every ``--stop-check-every`` steps).
    """
    model.train()
    module = unwrap(model)
    position = position or EpochPosition(epoch)
    totals = position.rank_totals(env.rank, env.device)  # loss, steps, skipped, samples
    bar = tracker.progress(loader, epoch, epochs)
    for step, (images, labels) in enumerate(bar, start=position.step + 1):
        images = images.to(env.device, non_blocking=True)
        labels = labels.to(env.device, non_blocking=True)
        with precision.autocast():
            loss = loss_fn(model(images), labels)
        optimizer.zero_grad(set_to_none=True)
        precision.backward(loss, optimizer)
        skipped = precision.step(optimizer)  # 1 when a gradient held NaN/Inf: nothing changed
        if average is not None:
            average.update(module)
        totals[0] += torch.where(skipped.bool(), 0.0, loss.detach().double())
        totals[1] += 1
        totals[2] += skipped
        totals[3] += images.shape[0]
        tracker.show_loss(bar, step, totals)
        control.after_step(step, totals)
    if env.distributed:  # a world-size-1 env (the probes) runs alone, with no collective
        reduce_tensor(totals)
    loss_sum, steps, skipped, samples = totals.tolist()
    taken = steps - skipped
    mean_loss = loss_sum / taken if taken else math.nan
    return EpochTotals(mean_loss, int(steps), int(skipped), int(samples))


def synthetic_batch(
    cfg: Config, device: torch.device, offset: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random images (plus ``offset``) and a ~30% foreground mask of ``batch x 1 x patch``; with
    ``--num-classes K >= 2`` that foreground spread over the classes ``1..K-1``."""
    generator = torch.Generator().manual_seed(cfg.seed)
    shape = (cfg.batch_size, 1, *cfg.patch_size)
    images = torch.randn(shape, generator=generator) + offset
    labels = (torch.rand(shape, generator=generator) < 0.3).float()
    labels = cfg.labels.synthetic_labels(labels, generator)
    return images.to(device), labels.to(device)


class SyntheticStepper:
    """The trainer's model, optimizer and precision for a concrete ``cfg`` (no ``auto`` left),
    through ``prepare()`` for ``env``, stepping on one fixed random batch already on the device.

    ``run(n)`` is ``n`` steps of :func:`train_one_epoch`, which ends with a host sync, so the
    wall time around it is the time of the steps.
    """

    def __init__(self, cfg: Config, env: DistEnv, compile: bool = False):
        self.env = env
        self.precision = build_precision(cfg, env.device)
        model = build_model(cfg, env.device)
        optimizer = build_optimizer(model, cfg, env, self.precision.backend)
        self.model, self.optimizer = prepare(model, optimizer, self.precision, env)
        if compile:
            self.model = compile_model(self.model, cfg)
        self.loss_fn = build_loss(cfg)
        self.batch = synthetic_batch(cfg, env.device)

    def run(self, steps: int) -> EpochTotals:
        return train_one_epoch(
            self.model,
            [self.batch] * steps,
            self.optimizer,
            self.precision,
            self.loss_fn,
            NullTracker(),
            self.env,
            1,
            1,
        )
