"""The trainer's data: training patches with their resumable sampler and loader, the validation
volumes, their normalisation, and the classical floor the model's Dice is shown beside."""

from __future__ import annotations

import logging
import signal
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader

from app.analysis.floor import class_floors_from_volumes, floors_from_volumes
from app.config import Config
from app.data.dataset import DataError, Normalization, PatchDataset, load_train_val
from app.data.lazy import index_split, load_mapped_train_val
from app.distributed import DistEnv, run_on_primary
from app.engine.epoch_position import EpochPosition, ResumableSampler
from app.labels import LabelScheme

log = logging.getLogger("app.train")


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


def ignore_stop_signals(worker_id: int) -> None:
    """A terminal's Ctrl-C reaches DataLoader workers too; only the trainer decides to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


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


@dataclass
class TrainData:
    train_volumes: list
    val_volumes: list
    normalization: Normalization
    train_set: PatchDataset
    sampler: ResumableSampler
    loader: DataLoader
    env: DistEnv
    batch_size: int

    @classmethod
    def load(cls, cfg: Config, env: DistEnv, resumed: dict[str, Any] | None) -> TrainData:
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
        return cls(
            train_volumes,
            val_volumes,
            normalization,
            train_set,
            sampler,
            loader,
            env,
            cfg.batch_size,
        )

    def start_of(self, epoch: int) -> EpochPosition:
        return EpochPosition(epoch, world_size=self.env.world_size, batch_size=self.batch_size)

    def first_position(self, position: EpochPosition | None, start_epoch: int) -> EpochPosition:
        """Where the first epoch of this run starts: the step of a mid-epoch checkpoint's
        ``position`` (when this run can continue it), or step 0."""
        fresh = self.start_of(start_epoch + 1)
        if position is None:
            return fresh
        why = self.sampler.mismatch(position, self.batch_size)
        if why is not None:
            log.warning("%s: epoch %d starts again from its first step", why, position.epoch)
            return fresh
        log.info("epoch %d continues after step %d", position.epoch, position.step)
        return position

    def start(self, position: EpochPosition) -> None:
        """Draw ``position.epoch``'s patches, from ``position.step`` on."""
        self.sampler.start(position, self.batch_size)
        self.train_set.set_epoch(position.epoch)

    def refit(self, cfg: Config) -> None:
        """Another number of samples per volume (a plan refit): a new sampler and loader."""
        self.train_set.samples_per_volume = cfg.samples_per_volume
        self.sampler, self.loader = patch_loader(self.train_set, cfg, self.env)

    def classical_floor(self, labels: LabelScheme) -> dict:
        """The best intensity band picked on the training set, scored on validation (global
        Dice), on the images as the model sees them; logged beside the model's Dice as
        ``floor_dice`` (K >= 2: each class's band as ``floor_dice/NAME``, their mean as
        ``floor_dice``)."""
        floor = labels.choose(binary=mask_floor, classes=class_floor)
        return floor(self.train_volumes, self.val_volumes, labels.names)


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
