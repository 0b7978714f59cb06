"""Graceful stops and mid-epoch checkpoints.

Kubernetes sends SIGTERM, then SIGKILL after the pod's grace period; torchrun passes SIGTERM on
to every worker. Here a SIGTERM or SIGINT only raises a flag: the step in flight finishes. Every
``--stop-check-every`` steps the ranks agree in one all-reduce of two numbers (not one per step)
whether any of them was signalled and whether a time-based checkpoint (``--checkpoint-every-min``,
rank 0's clock) is due. If so, they sum their partial losses, rank 0 writes ``last.pt`` with the
position inside the epoch (``app.engine.epoch_position``), and on a signal every rank raises
:class:`Preempted`: the trainer exits with 128 + the signal number, which torchrun and a
PyTorchJob's ``OnFailure`` or ``ExitCode`` restart policy treat as "restart me".
"""

from __future__ import annotations

import logging
import math
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from app.config import checkpoint_minutes
from app.distributed import DistEnv, gather_object, reduce_tensor
from app.engine.checkpoint import rng_state
from app.engine.epoch_position import EpochPosition

log = logging.getLogger(__name__)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preempted(Exception):
    """Every rank stopped on a signal after the checkpoint was written."""

    def __init__(self, signum: int, epoch: int, step: int | None):
        name = signal.Signals(signum).name
        where = f"epoch {epoch} step {step}" if step is not None else f"the end of epoch {epoch}"
        super().__init__(f"stopped by {name} at {where}; --resume auto continues from there")
        self.exit_code = 128 + signum


class StopSignals:
    """While entered, SIGTERM and SIGINT set :attr:`received` instead of ending the process;
    the same signal a second time ends it at once (SystemExit)."""

    def __init__(self) -> None:
        self.received = 0
        self._seen: set[int] = set()
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        # the same signal twice is a second Ctrl-C: the user will not wait for a checkpoint.
        # A Ctrl-C under torchrun arrives as SIGINT (from the terminal) then SIGTERM (from
        # torchrun): both together still stop gracefully.
        if signum in self._seen:
            log.warning("%s again: stopping now, without a checkpoint", name)
            raise SystemExit(128 + signum)
        if not self._seen:
            log.warning("%s: stopping after the step in flight, with a checkpoint", name)
        self._seen.add(signum)
        self.received = signum

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():  # only it may set handlers
            self._previous = {sig: signal.signal(sig, self._handle) for sig in STOP_SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


CUDA_CHECKPOINT_EVERY_MIN = 30.0


def checkpoint_every_s(every_min: str, device: torch.device) -> float:
    """``--checkpoint-every-min`` in seconds (0: off); ``auto`` is 30 minutes on CUDA, where an
    hour of lost GPU time costs most, and off on CPU."""
    minutes = checkpoint_minutes(every_min)
    if minutes is None:
        minutes = CUDA_CHECKPOINT_EVERY_MIN if device.type == "cuda" else 0.0
    return minutes * 60.0


class CheckpointClock:
    """Whether ``every_s`` seconds have passed since the last checkpoint (``0``: never)."""

    def __init__(self, every_s: float):
        self.every_s = every_s
        self.reset()

    def reset(self) -> None:
        self.last = time.monotonic()

    def due(self) -> bool:
        return bool(self.every_s) and time.monotonic() - self.last >= self.every_s


WriteMidEpoch = Callable[[EpochPosition, list], None]


class EpochControl:
    """The loop's hook: :meth:`after_step` on every step (a collective every ``every`` steps),
    :meth:`after_epoch` once an epoch's checkpoint is written."""

    def __init__(
        self,
        signals: StopSignals,
        clock: CheckpointClock,
        every: int,
        env: DistEnv,
        write: WriteMidEpoch,
    ):
        self.signals = signals
        self.clock = clock
        self.every = every
        self.env = env
        self.write = write
        self.position = EpochPosition(0)
        self.order: list[int] = []
        self.started = time.perf_counter()
        self.last_step = 0

    def begin(self, position: EpochPosition, order: list[int]) -> None:
        """An epoch starts (or resumes) at ``position``, drawing samples in ``order``."""
        self.position = position
        self.order = order
        self.started = time.perf_counter() - position.elapsed_s
        # the last step's checkpoint is the epoch's own: no agreement there
        share = len(order) // self.env.world_size
        self.last_step = math.ceil(share / position.batch_size)

    def agree(self) -> tuple[int, bool]:
        """(the signal any rank received, whether rank 0's clock says a checkpoint is due)."""
        due = self.clock.due() and self.env.is_primary
        flags = torch.tensor([self.signals.received, int(due)], device=self.env.device)
        reduce_tensor(flags, dist.ReduceOp.MAX)
        signum, due = flags.tolist()
        return int(signum), bool(due)

    def after_step(self, step: int, totals: torch.Tensor) -> None:
        if step % self.every or step == self.last_step:
            return
        signum, due = self.agree()
        if not (signum or due):
            return
        summed = reduce_tensor(totals.clone())  # every rank's partial sums, for rank 0 to save
        position = EpochPosition(
            epoch=self.position.epoch,
            step=step,
            order=self.order,
            totals=summed.tolist(),
            world_size=self.env.world_size,
            batch_size=self.position.batch_size,
            elapsed_s=time.perf_counter() - self.started,
        )
        self.write(position, gather_object(rng_state()))
        self.clock.reset()
        if signum:
            raise Preempted(signum, position.epoch, step)

    def after_epoch(self, epoch: int, last: bool) -> None:
        """Stop at this epoch's end if a rank was signalled since the last check (its
        checkpoint is already written); nothing to stop after the last epoch."""
        self.clock.reset()
        signum, _ = self.agree()
        if signum and not last:
            raise Preempted(signum, epoch, None)


class NullControl:
    """For callers without checkpoints (the probes, the benchmarks): never stops."""

    def after_step(self, step: int, totals: torch.Tensor) -> None:
        pass


NO_CONTROL = NullControl()
