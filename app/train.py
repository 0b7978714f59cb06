"""Train a 3D U-Net on IronGrain volumes: ``python -m app.train --help`` (or ``bash launch.sh``).

config -> data + DistributedSampler -> UNet3d -> prepare(): SyncBN -> AMP -> DDP -> epochs of
{train under autocast, scheduler.step() once, exact sharded evaluation} -> primary rank writes
metrics, TensorBoard and checkpoints, then every rank passes a barrier.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import ChainedScheduler, LinearLR, LRScheduler, MultiStepLR
from torch.utils.data import DataLoader

from app.atomic import atomic_write_bytes, os_cause
from app.autotune import Decision, decide
from app.checkpoint import (
    CheckpointError,
    checkpoint_dir,
    load_checkpoint,
    remove_stale_temporaries,
    resume_path,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from app.config import Config, ConfigError, load_config_and_given, save_config
from app.data import DataError, Normalization, PatchDataset, load_train_val
from app.distributed import (
    DistEnv,
    broadcast_buffers,
    broadcast_object,
    distributed_session,
    prepare,
    run_on_primary,
    unwrap,
)
from app.ema import WeightAverage, inference_weights
from app.epoch_position import EpochPosition, ResumableSampler
from app.floor import class_floors_from_volumes, floors_from_volumes
from app.labels import LabelScheme, build_loss
from app.lazy_data import index_split, load_mapped_train_val
from app.model import build_model
from app.plan import REFIT_EPOCH, Plan, apply_plan, plan_for
from app.precision import Precision, build_precision
from app.preemption import (
    CheckpointClock,
    EpochControl,
    Preempted,
    StopSignals,
    checkpoint_every_s,
)
from app.preflight import check_data_root, check_output_dir
from app.steps import NonFiniteError, build_optimizer, check_steps_taken, train_one_epoch
from app.tracking import make_tracker
from app.validation import EvalResult, ValidationCadence, evaluate
from app.volume_io import VolumeError

log = logging.getLogger("app.train")
USER_ERRORS = (ConfigError, DataError, VolumeError, CheckpointError, NonFiniteError)
# A collective that failed or timed out: another rank (or its node) is gone. Exit as a lost
# connection (128 + SIGHUP) so that restart policies that retry only exit codes >= 128 (the
# PyTorchJob's ExitCode policy) restart the job from last.pt; 1..127 would fail it for good.
PEER_LOST_EXIT = 128 + signal.SIGHUP


def peer_lost(exc: BaseException) -> bool:
    """A collective failed because another rank is gone: NCCL raises DistError; gloo a plain
    RuntimeError from its transport ("Connection closed by peer", "Timed out waiting")."""
    if isinstance(exc, torch.distributed.DistError):
        return True
    return isinstance(exc, RuntimeError) and "gloo/transport" in str(exc)


WRITE_ERRORS = (OSError, CheckpointError)  # what rank 0's writes at the end of an epoch raise


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: Config) -> LRScheduler:
    """MultiStepLR over epochs, after an optional linear warmup; stepped once per epoch."""
    multistep = MultiStepLR(optimizer, milestones=list(cfg.milestones), gamma=cfg.gamma)
    if not cfg.warmup_epochs:
        return multistep
    warmup = LinearLR(
        optimizer, start_factor=1.0 / (cfg.warmup_epochs + 1), total_iters=cfg.warmup_epochs
    )
    return ChainedScheduler([warmup, multistep], optimizer=optimizer)


def run_evaluation(model, val_volumes, loss_fn, precision, env: DistEnv, cfg: Config):
    """Exact sharded evaluation of ``model`` (a module, or the weight average's copy)."""
    broadcast_buffers(model)  # every rank evaluates the model that rank 0 saves
    return evaluate(
        model,
        val_volumes,
        loss_fn,
        precision,
        env,
        tuple(cfg.patch_size),
        cfg.val_mode,
        cfg.sw_overlap,
        cfg.sw_batch_size,
        cfg.classes,
    )


def checkpoint_state(
    model,
    optimizer,
    scheduler,
    precision: Precision,
    epoch: int,
    best_dice: float,
    record: dict[str, Any],
    cfg: Config,
    normalization: Normalization,
    resolved: dict[str, Any] | None = None,
    plan: Plan | None = None,
    average: WeightAverage | None = None,
) -> dict[str, Any]:
    return {
        "format_version": 1,
        "model": unwrap(model).state_dict(),
        "ema": average.state_dict() if average else None,
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "precision": precision.state_dict(),
        "epoch": epoch,
        "best_dice": best_dice,
        "metrics": record,
        "config": cfg.to_dict(),
        "resolved": resolved or {},
        "normalization": normalization.to_dict(),
        "plan": dataclasses.asdict(plan) if plan else None,
        "rng": rng_state(),
    }


@dataclasses.dataclass
class Saver:
    """What every checkpoint holds besides the epoch's figures; rank 0 writes."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: LRScheduler
    precision: Precision
    normalization: Normalization
    resolved: dict[str, Any]
    plan: Plan | None
    average: WeightAverage | None
    # what a mid-epoch checkpoint carries of the epochs before it; end_of_epoch updates them
    cfg: Config
    best_dice: float = -1.0
    record: dict[str, Any] = dataclasses.field(default_factory=dict)

    def state(self, epoch: int, best_dice: float, record: dict, cfg: Config) -> dict[str, Any]:
        return checkpoint_state(
            self.model,
            self.optimizer,
            self.scheduler,
            self.precision,
            epoch,
            best_dice,
            record,
            cfg,
            self.normalization,
            self.resolved,
            self.plan,
            self.average,
        )

    def end_of_epoch(
        self, tracker, record: dict, sample, cfg: Config, best_dice: float, improved: bool
    ) -> None:
        """The epoch's metrics, then ``last.pt`` (and ``best.pt`` when it improved)."""
        self.cfg, self.best_dice, self.record = cfg, best_dice, record
        tracker.log_epoch(record, sample)
        state = self.state(record["epoch"], best_dice, record, cfg)
        save_checkpoint(checkpoint_dir(cfg.run_dir) / "last.pt", state)
        if improved:
            save_checkpoint(checkpoint_dir(cfg.run_dir) / "best.pt", state)

    def mid_epoch(self, position: EpochPosition, rng_per_rank: list) -> None:
        """``last.pt`` at ``position`` (the epochs before it completed), with every rank's
        generators; ``best.pt`` is chosen at epochs' ends only."""
        state = self.state(position.epoch - 1, self.best_dice, self.record, self.cfg)
        state.update(position=position.to_dict(), rng_per_rank=rng_per_rank)
        path = checkpoint_dir(self.cfg.run_dir) / "last.pt"
        save_checkpoint(path, state)
        log.info("mid-epoch checkpoint %s: epoch %d step %d", path, position.epoch, position.step)

    def write_mid_epoch(self, position: EpochPosition, rng_per_rank: list) -> None:
        """:meth:`mid_epoch` on rank 0; a failed write stops every rank."""
        run_on_primary(WRITE_ERRORS, self.mid_epoch, position, rng_per_rank)


def restore(
    state: dict[str, Any],
    path: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: LRScheduler,
    precision: Precision,
    average: WeightAverage | None,
    rank: int = 0,
    world_size: int = 1,
) -> tuple[int, float, dict | None]:
    """Load checkpoint ``state`` (read from ``path``) into the prepared objects; returns
    (epoch, best Dice, its metrics)."""
    try:
        unwrap(model).load_state_dict(state["model"])
    except RuntimeError as exc:
        saved = state["config"]
        raise CheckpointError(
            f"{path}: its weights do not fit this model: it was trained with --f-maps "
            f"{saved.get('f_maps')} --depth {saved.get('depth')} --num-classes "
            f"{saved.get('num_classes', 1)}; resume with those, or use a "
            f"new --output-dir ({str(exc).splitlines()[0]})"
        ) from exc
    kernels = [group.get("fused") for group in optimizer.param_groups]
    optimizer.load_state_dict(state["optimizer"])
    for group, fused in zip(optimizer.param_groups, kernels):
        group["fused"] = fused  # which Adam kernel runs is this run's choice, not saved state
    scheduler.load_state_dict(state["scheduler"])
    precision.load_state_dict(state["precision"])  # after initialize(), as apex requires
    set_rng_state(own_rng_state(state, rank, world_size))
    if average is not None:
        if state.get("ema"):
            average.load_state_dict(state["ema"])
        else:
            log.info("%s has no weight average: --ema-decay starts one from its weights", path)
            average.model.load_state_dict(state["model"])
    log.info(
        "resumed from %s at epoch %d (best dice %.4f)", path, state["epoch"], state["best_dice"]
    )
    return state["epoch"], state["best_dice"], state.get("metrics")


def own_rng_state(state: dict[str, Any], rank: int, world_size: int) -> dict[str, Any]:
    """This rank's generators as a mid-epoch checkpoint saved them (every rank's), else rank
    0's (an end-of-epoch checkpoint, or another world size)."""
    per_rank = state.get("rng_per_rank") or []
    return per_rank[rank] if len(per_rank) == world_size else state["rng"]


def start_of(epoch: int, env: DistEnv, cfg: Config) -> EpochPosition:
    return EpochPosition(epoch, world_size=env.world_size, batch_size=cfg.batch_size)


def resume_position(
    resumed: dict[str, Any] | None,
    start_epoch: int,
    sampler: ResumableSampler,
    cfg: Config,
    env: DistEnv,
) -> EpochPosition:
    """Where the first epoch of this run starts: a mid-epoch checkpoint's step, or step 0."""
    fresh = start_of(start_epoch + 1, env, cfg)
    position = EpochPosition.saved_in(resumed)
    if position is None:
        return fresh
    why = sampler.mismatch(position, cfg.batch_size)
    if why is not None:
        log.warning("%s: epoch %d starts again from its first step", why, position.epoch)
        return fresh
    log.info("epoch %d continues after step %d", position.epoch, position.step)
    return position


def weight_average(module: nn.Module, cfg: Config) -> WeightAverage | None:
    if not cfg.ema_decay:
        return None
    try:
        return WeightAverage(module, cfg.ema_decay)
    except ValueError as exc:
        raise ConfigError(f"--ema-decay {cfg.ema_decay:g}: {exc}") from exc


def write_eval_report(path: Path, result: EvalResult, epoch: int) -> None:
    report = {"epoch": epoch, **result.summary(), "volumes": result.volume_rows()}
    atomic_write_bytes(path, (json.dumps(report, indent=2) + "\n").encode())


def load_data(cfg: Config, resumed: dict[str, Any] | None) -> tuple[list, list, Normalization]:
    """Training and validation volumes, normalised with a resumed run's statistics (its weights
    were trained on them) or with statistics fitted here; ``--data-access mmap`` reads training
    patches from disk, indexed once by rank 0."""
    fitted = Normalization.saved_in(resumed)
    if cfg.data_access == "mmap" and not cfg.eval_only:
        index_dir = cfg.run_dir / "data_index"
        run_on_primary((DataError, OSError), index_split, cfg.data_root, index_dir)
        return load_mapped_train_val(cfg.data_root, cfg.normalization, cfg.seed, index_dir, fitted)
    return load_train_val(
        cfg.data_root,
        cfg.normalization,
        cfg.seed,
        fitted=fitted,
        with_train=not cfg.eval_only,
        num_classes=cfg.num_classes,
    )


def classical_floor(train_volumes: list, val_volumes: list, labels: LabelScheme) -> dict:
    """The best intensity band picked on the training set, scored on validation (global Dice),
    on the images as the model sees them; logged beside the model's Dice as ``floor_dice``
    (K >= 2: each class's band as ``floor_dice/NAME``, their mean as ``floor_dice``)."""
    floor = labels.choose(binary=mask_floor, classes=class_floor)
    return floor(train_volumes, val_volumes, labels.names)


def class_floor(train_volumes: list, val_volumes: list, classes: list[str]) -> dict:
    bands = class_floors_from_volumes(train_volumes, val_volumes, classes)
    for name, band in bands.items():
        log.info("classical floor of class %s: %s", name, band.describe())
    figures = {f"floor_dice/{name}": band.val_dice for name, band in bands.items()}
    return {"floor_dice": sum(figures.values()) / len(figures), **figures}


def mask_floor(train_volumes: list, val_volumes: list, classes: list[str]) -> dict:
    started = time.perf_counter()
    # volumes read by patches give a strided sample of their voxels
    floors = floors_from_volumes([v.sampled() for v in train_volumes], val_volumes)
    band, otsu = floors.band, floors.otsu
    log.info(
        "classical floor (%.1f s): band %s, train Dice %.4f, val Dice %.4f (floor_dice); "
        "Otsu %s, val Dice %.4f",
        time.perf_counter() - started,
        band.rule(),
        band.train_dice,
        band.val_dice,
        otsu.rule(),
        otsu.val_dice,
    )
    return {"floor_dice": floors.band.val_dice}


def planned(
    settings: Config, given: frozenset[str], env: DistEnv, resumed: dict[str, Any] | None
) -> tuple[Config, Plan | None]:
    """``settings`` with ``--plan auto`` applied to what was not given: planned on rank 0 and
    broadcast, or a resumed run's own plan (a new one could differ, and its weights would not
    fit)."""
    if settings.plan != "auto":
        return settings, None
    saved = (resumed or {}).get("plan")
    if saved:
        plan = Plan(**saved)
    else:
        result: Plan | str | None = None
        if env.is_primary:
            try:
                processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
                result = plan_for(settings, env.device, processes)
            except (DataError, VolumeError) as exc:
                result = str(exc)
        result = broadcast_object(result)
        if isinstance(result, str):  # every rank stops with the same message
            raise DataError(f"--plan auto: {result}")
        plan = result
    if env.is_primary:
        kept = sorted(given & set(plan.values))
        log.info(
            "--plan auto (%s)%s:\n%s",
            "the resumed run's plan" if saved else f"for {settings.plan_budget_s:g} s",
            f", keeping the given {', '.join(kept)}" if kept else "",
            plan.describe(),
        )
    return apply_plan(settings, given, plan), plan


def fit_plan_to_step(
    plan: Plan, settings: Config, given: frozenset[str], decision: Decision, env: DistEnv
) -> Config:
    """The plan's samples per volume rescaled to the step the precision probe measured (the
    same figures on every rank: the decision is broadcast)."""
    measured = decision.timings.get(decision.choice.label, {}).get("ms")
    if measured is None or plan.fit_to_step(measured / 1000.0, given) is None:
        return settings
    if env.is_primary:
        log.info("--plan auto: samples_per_volume %s", plan.reasons["samples_per_volume"])
    return apply_plan(settings, given, plan)


def patch_loader(
    train_set: PatchDataset, cfg: Config, env: DistEnv
) -> tuple[ResumableSampler, DataLoader]:
    sampler = ResumableSampler(train_set, env.world_size, env.rank, cfg.seed)  # same on all ranks
    loader = DataLoader(
        train_set,
        batch_size=cfg.batch_size,
        sampler=sampler,
        num_workers=cfg.num_workers,
        pin_memory=env.device.type == "cuda",
        worker_init_fn=ignore_stop_signals,
        # workers' seeds come from here, not from the global generator: a resumed epoch's
        # loader then leaves the generators where the uninterrupted run had them
        generator=torch.Generator().manual_seed(cfg.seed),
    )
    return sampler, loader


def ignore_stop_signals(worker_id: int) -> None:
    """A terminal's Ctrl-C reaches DataLoader workers too; only the trainer decides to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def refit_plan_to_epoch(
    plan: Plan, settings: Config, given: frozenset[str], train_time: float, epoch: int
) -> Config | None:
    """``settings`` with the plan's samples per volume refitted so that the epochs left fill
    ``--plan-budget-s`` (rank 0's epoch time, so that every rank draws the same patches), or
    ``None`` when the epochs already fit."""
    train_time = broadcast_object(train_time)
    if plan.fit_to_epoch(train_time, epoch, settings.plan_budget_s, given) is None:
        return None
    log.info("--plan auto: samples_per_volume %s", plan.reasons["samples_per_volume"])
    return apply_plan(settings, given, plan)


def train(
    settings: Config,
    env: DistEnv,
    given: frozenset[str] = frozenset(),
    signals: StopSignals | None = None,
) -> dict[str, Any]:
    """Train (or, with ``--eval-only``, evaluate) under ``settings``, whose ``auto`` fields are
    resolved here for this machine (``app.autotune``); ``given``: the settings the user set,
    which ``--plan auto`` keeps; ``signals``: raised by SIGTERM/SIGINT, on which every rank
    stops with a checkpoint (:class:`Preempted`)."""
    # fixed patch and window sizes: let cuDNN pick the fastest 3D convolution algorithms once
    torch.backends.cudnn.benchmark = env.device.type == "cuda"
    run_on_primary((ConfigError, DataError), preflight, settings)
    # decided on the primary rank so that every rank resumes from the same file
    resume_from = broadcast_object(
        resume_path(settings.resume, settings.run_dir) if env.is_primary else None
    )
    if settings.eval_only and resume_from is None:
        raise ConfigError(
            f"--eval-only needs a checkpoint: {settings.run_dir}/checkpoints/last.pt does "
            "not exist; pass --resume PATH or the --output-dir of a trained run"
        )
    resumed = load_checkpoint(resume_from) if resume_from is not None else None
    settings, plan = planned(settings, given, env, resumed)
    decision = decide(settings, env, resumed)
    if env.is_primary:
        log.info("%s", decision.log_line())
    if plan is not None and resumed is None:
        settings = fit_plan_to_step(plan, settings, given, decision, env)
    cfg = decision.apply(settings)
    torch.manual_seed(cfg.seed)
    precision = build_precision(cfg, env.device)

    train_volumes, val_volumes, normalization = load_data(cfg, resumed)
    train_set = PatchDataset(
        train_volumes,
        cfg.patch_size,
        cfg.samples_per_volume,
        cfg.foreground_fraction,
        cfg.augment,
        cfg.seed,
        cfg.augment_level,
    )
    sampler, loader = patch_loader(train_set, cfg, env)

    model = build_model(cfg, env.device)
    optimizer = build_optimizer(model, cfg, env, precision.backend)
    scheduler = build_scheduler(optimizer, cfg)
    model, optimizer = prepare(model, optimizer, precision, env)
    loss_fn = build_loss(cfg)  # BCE + Dice, or CE + Dice for --num-classes K >= 2
    average = weight_average(unwrap(model), cfg)
    evaluated = average.model if average else unwrap(model)  # what best.pt is chosen by

    start_epoch, best_dice, resumed_metrics = 0, -1.0, None
    if resumed is not None:
        start_epoch, best_dice, resumed_metrics = restore(
            resumed,
            resume_from,
            model,
            optimizer,
            scheduler,
            precision,
            average,
            env.rank,
            env.world_size,
        )

    log.info(
        "world size %d on %s; %s; %d train / %d val volumes, %s; %.2fM parameters",
        env.world_size,
        env.device,
        precision.describe(),
        len(train_volumes),
        len(val_volumes),
        normalization.describe(),
        sum(p.numel() for p in model.parameters()) / 1e6,
    )

    if cfg.eval_only:
        evaluated.load_state_dict(inference_weights(resumed))  # the weights app.predict uses
        result, _ = run_evaluation(evaluated, val_volumes, loss_fn, precision, env, cfg)
        report = cfg.run_dir / "eval.json"
        run_on_primary((OSError,), write_eval_report, report, result, start_epoch)
        if env.is_primary:
            log.info("eval of epoch %d: %s", start_epoch, result.summary())
        return result.summary()

    floor = classical_floor(train_volumes, val_volumes, cfg.labels) if env.is_primary else None
    tracker = make_tracker(cfg, env, start_epoch)
    resolved = decision.to_dict() | ({"plan": plan.reasons} if plan else {})
    run_on_primary((OSError,), start_run_dir, settings, cfg, resolved)
    record: dict[str, Any] = {}
    if start_epoch >= cfg.epochs:
        log.info(
            "nothing to train: %s is at epoch %d and --epochs is %d; its metrics: %s",
            resume_from,
            start_epoch,
            cfg.epochs,
            resumed_metrics,
        )
    saver = Saver(
        model,
        optimizer,
        scheduler,
        precision,
        normalization,
        decision.to_dict(),
        plan,
        average,
        cfg,
        best_dice,
        resumed_metrics or {},
    )
    every_s = checkpoint_every_s(cfg.checkpoint_every_min, env.device)
    if every_s and env.is_primary:
        log.info("mid-epoch checkpoints every %g min (--checkpoint-every-min)", every_s / 60)
    control = EpochControl(
        signals or StopSignals(),
        CheckpointClock(every_s),
        cfg.stop_check_every,
        env,
        saver.write_mid_epoch,
    )
    first = resume_position(resumed, start_epoch, sampler, cfg, env)
    cadence = ValidationCadence(cfg.val_every, cfg.epochs, start_epoch, cfg.val_share)
    for epoch in range(start_epoch + 1, cfg.epochs + 1):
        # the first epoch may continue a mid-epoch checkpoint; the others start at step 0
        position = first if epoch == first.epoch else start_of(epoch, env, cfg)
        sampler.start(position, cfg.batch_size)
        train_set.set_epoch(epoch)
        control.begin(position, sampler.epoch_order())
        started = time.perf_counter() - position.elapsed_s  # a resumed epoch's earlier part too
        lr = optimizer.param_groups[0]["lr"]
        totals = train_one_epoch(
            model,
            loader,
            optimizer,
            precision,
            loss_fn,
            tracker,
            env,
            epoch,
            cfg.epochs,
            average,
            control,
            position,
        )
        train_time = time.perf_counter() - started
        check_steps_taken(totals, epoch, cfg)  # before anything of this epoch is saved
        scheduler.step()  # milestones are epochs

        record = {
            "epoch": epoch,
            "train_loss": totals.loss,
            "skipped_steps": totals.skipped,
            "lr": lr,
        }
        sample, val_time = None, 0.0
        if cadence.due(epoch):
            val_started = time.perf_counter()
            result, sample = run_evaluation(evaluated, val_volumes, loss_fn, precision, env, cfg)
            val_time = time.perf_counter() - val_started
            record.update(result.summary())
            if floor is not None:
                record.update(floor)
            if cadence.auto:  # rank 0's times, so that every rank picks the same next epoch
                cadence.measured(epoch, *broadcast_object((val_time, train_time)))
        voxels = totals.samples * math.prod(cfg.patch_size)
        record.update(
            train_time_s=train_time,
            val_time_s=val_time,
            epoch_time_s=time.perf_counter() - started,
            samples_per_s=totals.samples / train_time,
            voxels_per_s=voxels / train_time,
            world_size=env.world_size,
        )
        if plan is not None and epoch == REFIT_EPOCH:
            refitted = refit_plan_to_epoch(plan, settings, given, train_time, epoch)
            if refitted is not None:  # the patches of the epochs left; nothing else changes
                settings = refitted
                cfg = dataclasses.replace(cfg, samples_per_volume=settings.samples_per_volume)
                train_set.samples_per_volume = cfg.samples_per_volume
                sampler, loader = patch_loader(train_set, cfg, env)
                if env.is_primary:
                    save_config(settings, cfg.run_dir / "config.yaml", resolved=resolved)

        improved = record.get("dice", -1.0) > best_dice
        best_dice = max(best_dice, record.get("dice", -1.0))
        # a full disk stops every rank, not only the one writing
        run_on_primary(
            WRITE_ERRORS, saver.end_of_epoch, tracker, record, sample, cfg, best_dice, improved
        )
        control.after_epoch(epoch, last=epoch == cfg.epochs)

    tracker.finish(record)
    if env.is_primary and record:
        log.info(
            "finished epoch %d: val dice %.4f (best %.4f), iou %.4f",
            record["epoch"],
            record.get("dice", float("nan")),
            best_dice,
            record.get("iou", float("nan")),
        )
    return record


def preflight(settings: Config) -> None:
    check_output_dir(settings.run_dir)
    check_data_root(Path(settings.data_root))


def start_run_dir(settings: Config, cfg: Config, resolved: dict[str, Any]) -> None:
    save_config(settings, cfg.run_dir / "config.yaml", resolved=resolved)
    for path in remove_stale_temporaries(checkpoint_dir(cfg.run_dir)):
        log.info("removed %s, left by a checkpoint write that was interrupted", path)


def one_line(exc: Exception) -> str:
    """The message of ``exc``; a DataLoader worker's error arrives with the worker's traceback
    in its text, and only its last line, the error itself, is kept."""
    text = str(exc)
    if "Original Traceback" not in text:
        return text
    return text.strip().splitlines()[-1].split(": ", 1)[-1]


def io_error_line(exc: OSError, cfg: Config | None) -> str:
    """One line for an I/O error that no check caught earlier (a disk filling up mid-run)."""
    where = exc.filename or (f"--output-dir {cfg.output_dir}" if cfg else "a file")
    return f"{where}: {os_cause(exc)}"


def setup_logging(rank: int) -> None:
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s %(levelname)s [rank {rank}] %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        force=True,
    )


def log_versions() -> None:
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    log.info("torch %s, CUDA %s, cuDNN %s", torch.__version__, torch.version.cuda, cudnn)
    if torch.__version__.startswith("2.9.0") and torch.cuda.is_available():
        log.warning("torch 2.9.0 disabled cuDNN for fp16/bf16 3D convolutions: AMP is ~4x slower")


def main(argv: list[str] | None = None) -> int:
    setup_logging(int(os.environ.get("RANK", "0") or 0))
    cfg = None
    try:
        cfg, given = load_config_and_given(argv)
        with distributed_session(cfg) as env, StopSignals() as signals:
            setup_logging(env.rank)
            log_versions()
            train(cfg, env, given, signals)
    except Preempted as exc:  # the checkpoint is written: restart and --resume auto
        log.warning("%s", exc)
        return exc.exit_code
    except USER_ERRORS as exc:
        print(f"error: {one_line(exc)}", file=sys.stderr)
        return 2
    except RuntimeError as exc:
        if not peer_lost(exc):
            raise
        print(f"error: lost contact with another rank: {one_line(exc)}", file=sys.stderr)
        return PEER_LOST_EXIT
    except OSError as exc:  # the last good checkpoint is intact: writes are atomic
        print(f"error: {io_error_line(exc, cfg)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
