"""What runs at the named points of the fit loop, so that the loop itself has no branch for it.

The loop calls every hook at ``epoch_started(position, order)``, ``trained(epoch, train_time)``
(after the epoch's steps and validation, before its checkpoint) and ``epoch_ended(epoch)``
(after its checkpoint). A hook implements the points it needs.
"""

from __future__ import annotations

import logging

from app.config import save_config
from app.distributed import DistEnv
from app.engine.data import TrainData
from app.engine.epoch_position import EpochPosition
from app.engine.preemption import EpochControl
from app.engine.resolve import ResolvedRun

log = logging.getLogger("app.train")


class Hook:
    def epoch_started(self, position: EpochPosition, order: list[int]) -> None:
        pass

    def trained(self, epoch: int, train_time: float) -> None:
        pass

    def epoch_ended(self, epoch: int) -> None:
        pass


class PlanRefit(Hook):
    """``--plan auto``: after ``REFIT_EPOCH`` the samples per volume are refitted to the measured
    epoch time; the patches of the epochs left change, nothing else does."""

    def __init__(self, run: ResolvedRun, data: TrainData, env: DistEnv):
        self.run, self.data, self.env = run, data, env

    def trained(self, epoch: int, train_time: float) -> None:
        if self.run.refit_plan(train_time, epoch):
            self.data.refit(self.run.cfg)
            if self.env.is_primary:
                path = self.run.cfg.run_dir / "config.yaml"
                save_config(self.run.settings, path, resolved=self.run.reasons)


class Preemption(Hook):
    """SIGTERM/SIGINT and time-based mid-epoch checkpoints (``app.engine.preemption``): the control
    learns each epoch's order at its start, checks after every step (inside
    ``app.engine.steps.train_one_epoch``) and stops at an epoch's end once its checkpoint is
    written."""

    def __init__(self, control: EpochControl, epochs: int):
        self.control, self.epochs = control, epochs

    def epoch_started(self, position: EpochPosition, order: list[int]) -> None:
        self.control.begin(position, order)

    def epoch_ended(self, epoch: int) -> None:
        self.control.after_epoch(epoch, last=epoch == self.epochs)
