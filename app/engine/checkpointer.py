"""The checkpoint manager: one place that saves and restores every part of a trainer.

``save_last`` writes ``last.pt`` at an epoch's end (and ``best.pt`` when its Dice is the best so
far), ``save_recovery`` writes ``last.pt`` mid-epoch with the position in the epoch and every
rank's generators (``app.engine.preemption`` calls it), ``restore`` loads a checkpoint into the
parts. Rank 0 writes; a failed write stops every rank (``run_on_primary``). The format is
``app.engine.checkpoint``'s: the same keys as every earlier ``last.pt``, so old runs resume.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

from app.data.dataset import Normalization
from app.distributed import run_on_primary
from app.engine.checkpoint import FORMAT_VERSION, CheckpointError, checkpoint_dir, save_checkpoint
from app.engine.epoch_position import EpochPosition
from app.engine.parts import (
    AverageState,
    ModelWeights,
    OptimizerState,
    Progress,
    RandomState,
    SamplerPosition,
)
from app.plan import Plan
from app.precision.amp import Precision

log = logging.getLogger("app.train")
WRITE_ERRORS = (OSError, CheckpointError)  # what rank 0's writes at the end of an epoch raise


@dataclasses.dataclass
class Checkpointer:
    """Saves and restores the parts; ``resolved``, ``normalization`` and ``plan`` are the run's
    fixed facts that every checkpoint carries beside them."""

    run_dir: Path
    model: ModelWeights
    average: AverageState
    optimizer: OptimizerState
    scheduler: Any  # an LRScheduler: state_dict/load_state_dict of its own
    precision: Precision
    progress: Progress
    rng: RandomState
    position: SamplerPosition
    normalization: Normalization
    resolved: dict[str, Any]
    plan: Plan | None

    def state(self) -> dict[str, Any]:
        return {
            "format_version": FORMAT_VERSION,
            "model": self.model.state_dict(),
            "ema": self.average.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "precision": self.precision.state_dict(),
            **self.progress.state_dict(),  # epoch, best_dice, metrics, config
            "resolved": self.resolved or {},
            "normalization": self.normalization.to_dict(),
            "plan": dataclasses.asdict(self.plan) if self.plan else None,
            "rng": self.rng.state_dict(),
        }

    @property
    def folder(self) -> Path:
        return checkpoint_dir(self.run_dir)

    def save_last(self, improved: bool) -> None:
        """``last.pt`` of the progress so far, and ``best.pt`` when it ``improved``."""
        state = self.state()
        save_checkpoint(self.folder / "last.pt", state)
        if improved:
            save_checkpoint(self.folder / "best.pt", state)

    def save_recovery(self, position: EpochPosition, rng_per_rank: list) -> None:
        """``last.pt`` at ``position`` (the epochs before it completed), with every rank's
        generators; ``best.pt`` is chosen at epochs' ends only. Rank 0 writes."""
        run_on_primary(WRITE_ERRORS, self._write_recovery, position, rng_per_rank)

    def _write_recovery(self, position: EpochPosition, rng_per_rank: list) -> None:
        self.position.position = position
        state = self.state()
        state.update(epoch=position.epoch - 1, position=self.position.state_dict())
        state.update(rng_per_rank=rng_per_rank)
        path = self.folder / "last.pt"
        save_checkpoint(path, state)
        log.info("mid-epoch checkpoint %s: epoch %d step %d", path, position.epoch, position.step)

    def restore(self, state: dict[str, Any], path: Path) -> None:
        """Load checkpoint ``state`` (read from ``path``) into the prepared parts."""
        self.model.load_state_dict(state["model"], state["config"], path)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.precision.load_state_dict(state["precision"])  # after initialize(), as apex requires
        self.rng.load_state_dict(state["rng"], state.get("rng_per_rank"))
        self.average.load_state_dict(state.get("ema"), state["model"], path)
        self.progress.load_state_dict(state)
        self.position.load_state_dict(state.get("position"))
        log.info(
            "resumed from %s at epoch %d (best dice %.4f)", path, state["epoch"], state["best_dice"]
        )


def build_checkpointer(
    run_dir: Path,
    model,
    optimizer,
    scheduler,
    precision: Precision,
    cfg,
    normalization: Normalization,
    average=None,
    resolved: dict[str, Any] | None = None,
    plan: Plan | None = None,
    rank: int = 0,
    world_size: int = 1,
) -> Checkpointer:
    """A :class:`Checkpointer` of these objects, each wrapped in the part that owns its state."""
    return Checkpointer(
        Path(run_dir),
        ModelWeights(model),
        AverageState(average),
        OptimizerState(optimizer),
        scheduler,
        precision,
        Progress(cfg),
        RandomState(rank, world_size),
        SamplerPosition(),
        normalization,
        resolved or {},
        plan,
    )
