"""Where training stands inside an epoch, and the sampler that continues from there.

A mid-epoch checkpoint (``app.engine.preemption``) records an :class:`EpochPosition`: the epoch, the
steps every rank has taken, the epoch's global sample order and the partial loss sums of all
ranks. ``--resume auto`` hands it to :class:`ResumableSampler`, which yields what is left of each
rank's share of that order, and to ``app.engine.steps.train_one_epoch``, which continues the sums;
the epoch then ends with the figures of an uninterrupted one.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch.utils.data import DistributedSampler

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EpochPosition:
    epoch: int
    step: int = 0  # steps taken by each rank
    order: list[int] = field(default_factory=list)  # the epoch's global order ([]: draw it)
    totals: list[float] = field(default_factory=lambda: [0.0] * 4)  # all ranks' partial sums
    world_size: int = 1
    batch_size: int = 1
    elapsed_s: float = 0.0  # training time of the epoch before the checkpoint

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def saved_in(cls, state: dict[str, Any] | None) -> EpochPosition | None:
        saved = (state or {}).get("position")
        return cls(**saved) if saved else None

    def rank_totals(self, rank: int, device: torch.device) -> torch.Tensor:
        """This rank's starting sums: the primary carries every rank's, so that the reduction
        at the end of the epoch counts them once."""
        totals = self.totals if rank == 0 else [0.0] * 4
        return torch.tensor(totals, dtype=torch.float64, device=device)


class ResumableSampler(DistributedSampler):
    """``DistributedSampler`` with shuffling (the same order for a seed and an epoch), which can
    start an epoch part-way through a saved order."""

    def __init__(self, dataset, num_replicas: int, rank: int, seed: int):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed)
        self._order: list[int] | None = None
        self._skip = 0

    def epoch_order(self) -> list[int]:
        """The global order of this epoch, padded as ``DistributedSampler`` pads it."""
        if self._order is not None:
            return self._order
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        indices = torch.randperm(len(self.dataset), generator=generator).tolist()
        padding = self.total_size - len(indices)
        indices += (indices * math.ceil(padding / len(indices)))[:padding]
        return indices

    def mismatch(self, position: EpochPosition, batch_size: int) -> str | None:
        """Why ``position`` cannot be continued here (another world size, batch size or data
        set), or ``None``."""
        now = (self.num_replicas, batch_size, self.total_size)
        then = (position.world_size, position.batch_size, len(position.order))
        if now == then and max(position.order, default=-1) < len(self.dataset):
            return None
        return (
            f"epoch {position.epoch} stopped at step {position.step} with (processes, batch, "
            f"samples) {then}, this run has {now}"
        )

    def start(self, position: EpochPosition, batch_size: int) -> None:
        """Begin ``position.epoch`` at ``position.step`` (0: its start, in a fresh order)."""
        self.set_epoch(position.epoch)
        self._order = list(position.order) if position.step else None
        self._skip = position.step * batch_size

    def __iter__(self):
        mine = self.epoch_order()[self.rank : self.total_size : self.num_replicas]
        return iter(mine[self._skip :])

    def __len__(self) -> int:
        return max(0, self.num_samples - self._skip)
