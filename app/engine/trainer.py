"""The trainer, built from parts that own their state, and its fit loop.

:func:`build` makes the parts in a fixed order (the order fixes what the seeded generators give
each of them): precision, data, model, optimizer and schedule, ``prepare()`` (SyncBN -> AMP ->
DDP), loss, weight average; then the checkpoint manager restores a resumed run into them.
:meth:`Trainer.fit` is the loop: train an epoch, step the schedule, validate when due, record,
checkpoint; the plan refit and preemption are hooks (``app.engine.hooks``) called at named points.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from app.atomic import atomic_write_bytes
from app.config import save_config
from app.distributed import (
    DistEnv,
    broadcast_buffers,
    broadcast_object,
    prepare,
    run_on_primary,
    unwrap,
)
from app.engine import compiling
from app.engine.checkpoint import (
    CheckpointError,
    checkpoint_dir,
    load_checkpoint,
    remove_stale_temporaries,
)
from app.engine.checkpointer import WRITE_ERRORS, Checkpointer, build_checkpointer
from app.engine.compiled_model import compile_model
from app.engine.compiling import CompileDecision
from app.engine.data import TrainData
from app.engine.ema import WeightAverage, inference_weights
from app.engine.hooks import Hook, PlanRefit, Preemption
from app.engine.parts import weight_average
from app.engine.preemption import CheckpointClock, EpochControl, StopSignals, checkpoint_every_s
from app.engine.resolve import ResolvedRun
from app.engine.steps import build_optimizer, build_scheduler, check_steps_taken, train_one_epoch
from app.engine.tracking import NullTracker, Tracker, make_tracker
from app.engine.utilisation import Utilisation
from app.engine.validation import EvalResult, ValidationCadence, evaluate
from app.labels import build_loss
from app.model import build_model
from app.precision.amp import Precision, build_precision

log = logging.getLogger("app.train")


@dataclass
class Trainer:
    run: ResolvedRun
    env: DistEnv
    data: TrainData
    model: nn.Module  # as prepared (DDP-wrapped when distributed)
    optimizer: torch.optim.Optimizer
    scheduler: Any
    precision: Precision
    loss_fn: nn.Module
    average: WeightAverage | None
    checkpointer: Checkpointer
    signals: StopSignals
    utilisation: Utilisation | None = None
    hooks: list[Hook] = field(default_factory=list)
    tracker: Tracker | NullTracker = field(default_factory=NullTracker)

    @property
    def progress(self):
        return self.checkpointer.progress

    @property
    def evaluated(self) -> nn.Module:
        """What validation scores and ``best.pt`` is chosen by: the weight average, if any."""
        return self.average.model if self.average else unwrap(self.model)

    def fit(self) -> dict[str, Any]:
        """Train the epochs left; returns the last epoch's record."""
        cfg, env, data = self.run.cfg, self.env, self.data
        control, cadence, floor = self.begin_fit()
        first = data.first_position(self.checkpointer.position.position, self.progress.epoch)
        record: dict[str, Any] = {}
        for epoch in range(self.progress.epoch + 1, cfg.epochs + 1):
            # the first epoch may continue a mid-epoch checkpoint; the others start at step 0
            position = first if epoch == first.epoch else data.start_of(epoch)
            data.start(position)
            self.call("epoch_started", position, data.sampler.epoch_order())
            started = time.perf_counter() - position.elapsed_s  # a resumed epoch's earlier part
            lr = self.optimizer.param_groups[0]["lr"]
            totals = train_one_epoch(
                self.model,
                data.loader,
                self.optimizer,
                self.precision,
                self.loss_fn,
                self.tracker,
                env,
                epoch,
                cfg.epochs,
                self.average,
                control,
                position,
            )
            train_time = time.perf_counter() - started
            check_steps_taken(totals, epoch, cfg)  # before anything of this epoch is saved
            self.scheduler.step()  # milestones are epochs
            record = {"epoch": epoch, "train_loss": totals.loss, "skipped_steps": totals.skipped}
            record["lr"] = lr
            sample, val_time = None, 0.0
            if cadence.due(epoch):
                val_started = time.perf_counter()
                result, sample = self.validate(self.evaluated)
                val_time = time.perf_counter() - val_started
                record.update(result.summary(), **(floor or {}))
                if cadence.auto:  # rank 0's times, so that every rank picks the same next epoch
                    cadence.measured(epoch, *broadcast_object((val_time, train_time)))
            record.update(
                train_time_s=train_time,
                val_time_s=val_time,
                epoch_time_s=time.perf_counter() - started,
                samples_per_s=totals.samples / train_time,
                voxels_per_s=totals.samples * math.prod(cfg.patch_size) / train_time,
                world_size=env.world_size,
            )
            if self.utilisation:
                record.update(self.utilisation.figures(totals.steps / env.world_size, train_time))
            self.call("trained", epoch, train_time)
            improved = self.progress.finished(record, self.run.cfg)
            # a full disk stops every rank, not only the one writing
            run_on_primary(WRITE_ERRORS, self.end_epoch, record, sample, improved)
            self.call("epoch_ended", epoch)
        return self.end_fit(record)

    def call(self, point: str, *args) -> None:
        for hook in self.hooks:
            getattr(hook, point)(*args)

    def begin_fit(self) -> tuple[EpochControl, ValidationCadence, dict | None]:
        """The tracker, the run dir, preemption, and the validation cadence; returns (the
        per-step control, the cadence, the classical floor on rank 0)."""
        cfg, env, start = self.run.cfg, self.env, self.progress.epoch
        floor = self.data.classical_floor(cfg.labels) if env.is_primary else None
        self.tracker = make_tracker(cfg, env, start)
        run_on_primary((OSError,), start_run_dir, self.run)
        if start >= cfg.epochs:
            log.info(
                "nothing to train: %s is at epoch %d and --epochs is %d; its metrics: %s",
                self.run.resume_from,
                start,
                cfg.epochs,
                (self.run.resumed or {}).get("metrics"),
            )
        if self.utilisation and env.is_primary:
            log.info("utilisation: %s", self.utilisation.describe(self.run.decision.step_s))
        every_s = checkpoint_every_s(cfg.checkpoint_every_min, env.device)
        if every_s and env.is_primary:
            log.info("mid-epoch checkpoints every %g min (--checkpoint-every-min)", every_s / 60)
        clock = CheckpointClock(every_s)
        write = self.checkpointer.save_recovery
        control = EpochControl(self.signals, clock, cfg.stop_check_every, env, write)
        refit = PlanRefit(self.run, self.data, env)
        self.hooks = [Preemption(control, cfg.epochs), refit, *self.hooks]
        cadence = ValidationCadence(cfg.val_every, cfg.epochs, start, cfg.val_share)
        return control, cadence, floor

    def validate(self, model: nn.Module, tta: bool = False) -> tuple[EvalResult, Any]:
        """Exact sharded evaluation of ``model`` (a module, or the weight average's copy);
        ``tta``: the logits averaged over the 8 mirrorings."""
        cfg = self.run.cfg
        broadcast_buffers(model)  # every rank evaluates the model that rank 0 saves
        window = tuple(cfg.patch_size)
        return evaluate(
            model,
            self.data.val_volumes,
            self.loss_fn,
            self.precision,
            self.env,
            window,
            cfg.val_mode,
            cfg.sw_overlap,
            cfg.sw_batch_size,
            cfg.classes,
            tta,
        )

    def end_epoch(self, record: dict, sample, improved: bool) -> None:
        """Rank 0: the epoch's metrics, then ``last.pt`` (and ``best.pt`` when it improved)."""
        self.tracker.log_epoch(record, sample)
        self.checkpointer.save_last(improved)

    def end_fit(self, record: dict[str, Any]) -> dict[str, Any]:
        self.tracker.finish(record)
        if self.env.is_primary and record:
            log.info(
                "finished epoch %d: val dice %.4f (best %.4f), iou %.4f",
                record["epoch"],
                record.get("dice", float("nan")),
                self.progress.best_dice,
                record.get("iou", float("nan")),
            )
        if self.run.cfg.tta and record.get("epoch") == self.run.cfg.epochs:
            self.score_best_mirrored()
        return record

    def score_best_mirrored(self) -> None:
        """``--tta``: ``best.pt``'s inference weights scored with the 8 mirrorings, into
        ``eval.json``. Rank 0 reads the file (the only rank that surely sees it) and sends the
        weights to the others, which score their share of the volumes."""
        path = checkpoint_dir(self.run.cfg.run_dir) / "best.pt"
        best: dict[str, Any] | CheckpointError | None = None
        if self.env.is_primary:
            try:
                state = load_checkpoint(path)
                best = {"epoch": state["epoch"], "weights": inference_weights(state)}
            except CheckpointError as exc:  # every rank stops with it, none waits for rank 0
                best = exc
        best = broadcast_object(best)
        if isinstance(best, CheckpointError):
            raise best
        model = copy.deepcopy(self.evaluated)
        model.load_state_dict(best["weights"])
        result, _ = self.validate(model, tta=True)
        report = self.run.cfg.run_dir / "eval.json"
        source = {"checkpoint": str(path), "tta": True}
        run_on_primary((OSError,), write_eval_report, report, result, best["epoch"], source)
        if self.env.is_primary:
            figures = result.summary()
            log.info(
                "best.pt (epoch %d) with mirroring: val dice %.4f (%.4f without), iou %.4f; in %s",
                best["epoch"],
                figures["dice"],
                self.progress.best_dice,
                figures["iou"],
                report,
            )

    def evaluate_only(self) -> dict[str, Any]:
        """``--eval-only``: score the checkpoint's inference weights, write ``eval.json``."""
        self.evaluated.load_state_dict(
            inference_weights(self.run.resumed)
        )  # as app.analysis.predict
        result, _ = self.validate(self.evaluated, tta=self.run.cfg.tta)
        epoch = self.progress.epoch
        report = self.run.cfg.run_dir / "eval.json"
        source = {"checkpoint": str(self.run.resume_from), "tta": self.run.cfg.tta}
        run_on_primary((OSError,), write_eval_report, report, result, epoch, source)
        if self.env.is_primary:
            log.info("eval of epoch %d: %s", epoch, result.summary())
        return result.summary()


def build(run: ResolvedRun, env: DistEnv, signals: StopSignals | None = None) -> Trainer:
    """Every part, in the order that fixes what the seeded generators give each, and a resumed
    run's state restored into them."""
    cfg = run.cfg
    # before the seed: its measurement draws no number that training would
    utilisation = (
        None if cfg.eval_only else Utilisation.for_run(cfg, env.device, run.decision.choice.label)
    )
    torch.manual_seed(cfg.seed)
    precision = build_precision(cfg, env.device)
    data = TrainData.load(cfg, env, run.resumed)
    model = build_model(cfg, env.device)
    optimizer = build_optimizer(model, cfg, env, precision.backend)
    scheduler = build_scheduler(optimizer, cfg)
    model, optimizer = prepare(model, optimizer, precision, env)
    if not cfg.eval_only:
        run.compiled = decide_compile(run, env, len(data.loader))
        if run.compiled.use:
            model = compile_model(model, cfg)
    loss_fn = build_loss(cfg)  # BCE + Dice, or CE + Dice for --num-classes K >= 2
    average = weight_average(unwrap(model), cfg)
    checkpointer = build_checkpointer(
        cfg.run_dir,
        model,
        optimizer,
        scheduler,
        precision,
        cfg,
        data.normalization,
        average,
        run.decision.to_dict(),
        run.plan,
        env.rank,
        env.world_size,
    )
    if run.resumed is not None:
        checkpointer.restore(run.resumed, run.resume_from)
    log.info(
        "world size %d on %s; %s; %d train / %d val volumes, %s; %.2fM parameters",
        env.world_size,
        env.device,
        precision.describe(),
        len(data.train_volumes),
        len(data.val_volumes),
        data.normalization.describe(),
        sum(p.numel() for p in model.parameters()) / 1e6,
    )
    parts = (model, optimizer, scheduler, precision, loss_fn, average, checkpointer)
    return Trainer(run, env, data, *parts, signals or StopSignals(), utilisation)


def decide_compile(run: ResolvedRun, env: DistEnv, steps_per_epoch: int) -> CompileDecision:
    """``--compile`` for the steps this run has left, with the precision probe's step time."""
    epochs_done = (run.resumed or {}).get("epoch", 0)
    steps = steps_per_epoch * max(0, run.cfg.epochs - epochs_done)
    decision = compiling.decide(run.cfg, env, steps, run.decision.step_s)
    if env.is_primary:
        log.info("%s", decision.log_line())
    return decision


def start_run_dir(run: ResolvedRun) -> None:
    save_config(run.settings, run.cfg.run_dir / "config.yaml", resolved=run.reasons)
    for path in remove_stale_temporaries(checkpoint_dir(run.cfg.run_dir)):
        log.info("removed %s, left by a checkpoint write that was interrupted", path)


def write_eval_report(
    path: Path, result: EvalResult, epoch: int, source: dict[str, Any] | None = None
) -> None:
    report = {"epoch": epoch, **(source or {}), **result.summary(), "volumes": result.volume_rows()}
    atomic_write_bytes(path, (json.dumps(report, indent=2) + "\n").encode())
