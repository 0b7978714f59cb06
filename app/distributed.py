"""Process group, device, rank helpers and ``prepare()``: SyncBN -> AMP -> DDP, in that order.

torchrun (and, through it, a Kubeflow PyTorchJob) sets ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT``. The deprecated ``torch.distributed.launch`` passes
``--local_rank`` instead of ``LOCAL_RANK``. One process with none of this runs without a process
group.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import logging
import os
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from app.config import Config, ConfigError
from app.precision.amp import Precision, import_apex

log = logging.getLogger(__name__)


# A collective that failed or timed out: another rank (or its node) is gone. Exit as a lost
# connection (128 + SIGHUP) so that restart policies that retry only exit codes >= 128 (the
# PyTorchJob's ExitCode policy) restart the job from last.pt; 1..127 would fail it for good.
PEER_LOST_EXIT = 128 + signal.SIGHUP


def peer_lost(exc: BaseException) -> bool:
    """A collective failed because another rank is gone: NCCL raises DistError; gloo a plain
    RuntimeError from its transport ("Connection closed by peer", "Timed out waiting")."""
    if isinstance(exc, dist.DistError):
        return True
    return isinstance(exc, RuntimeError) and "gloo/transport" in str(exc)


@dataclass(frozen=True)
class DistEnv:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_primary(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"environment variable {name}={value!r} is not an integer") from None


def resolve_device(requested: str, local_rank: int) -> torch.device:
    if requested == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: CUDA is not available on this machine; use --device cpu")
    if requested == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    if local_rank >= torch.cuda.device_count():
        raise ConfigError(
            f"LOCAL_RANK {local_rank} but only {torch.cuda.device_count()} GPU(s) "
            "are visible; lower NPROC_PER_NODE"
        )
    return torch.device("cuda", local_rank)


def restart_store(rank: int, world_size: int, timeout: datetime.timedelta) -> dist.Store:
    """The launcher's key-value store, under a prefix unique to this torchrun restart.

    After an elastic restart the store can still hold the previous attempt's keys, among them
    the gloo addresses of the dead workers; a new rank that reads one before its peer rewrites it
    fails with "connectFullMesh ... Connection refused". A per-attempt prefix rules that out.
    """
    store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world_size, timeout=timeout))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"irongrain/attempt_{attempt}", store)


def init_distributed(cfg: Config) -> DistEnv:
    world_size = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", cfg.local_rank if cfg.local_rank >= 0 else 0)
    if world_size < 1 or not 0 <= rank < world_size:
        raise ConfigError(f"RANK={rank} and WORLD_SIZE={world_size} are inconsistent")
    device = resolve_device(cfg.device, local_rank)
    if world_size > 1:
        for name in ("MASTER_ADDR", "MASTER_PORT"):
            if not os.environ.get(name):
                raise ConfigError(
                    f"WORLD_SIZE={world_size} but {name} is not set; start with "
                    "launch.sh (torchrun), which sets it"
                )
        backend = cfg.dist_backend
        if backend == "auto":
            backend = "nccl" if device.type == "cuda" else "gloo"
        if backend == "nccl" and device.type != "cuda":
            raise ConfigError("--dist-backend nccl needs CUDA; use gloo on CPU")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        timeout = datetime.timedelta(seconds=cfg.dist_timeout_s)
        dist.init_process_group(
            backend,
            store=restart_store(rank, world_size, timeout),
            rank=rank,
            world_size=world_size,
            timeout=timeout,
            device_id=device if backend == "nccl" else None,
        )
    elif device.type == "cuda":
        torch.cuda.set_device(device)
    return DistEnv(rank, local_rank, world_size, device)


@contextlib.contextmanager
def distributed_session(cfg: Config) -> Iterator[DistEnv]:
    """The process group for the ``with`` block; destroyed on normal exit and on error."""
    env = init_distributed(cfg)
    try:
        yield env
    finally:
        if dist.is_initialized():
            # DDP sits in reference cycles: collect it before its process group goes, or gloo
            # can abort at exit ("terminate called without an active exception")
            gc.collect()
            dist.destroy_process_group()


# ----------------------------------------------------------------------------- collectives
def reduce_tensor(tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
    """All-reduce in place on every rank (a no-op without a process group) and return it."""
    if dist.is_initialized():
        dist.all_reduce(tensor, op=op)
    return tensor


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def broadcast_object(obj, src: int = 0):
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def gather_object(obj: Any) -> list:
    """``obj`` of every rank, in rank order, on every rank (``[obj]`` without a process
    group)."""
    if not dist.is_initialized():
        return [obj]
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def run_on_primary(
    catch: tuple[type[Exception], ...], action: Callable[..., object], *args: Any
) -> None:
    """Run ``action(*args)`` on the primary rank only, then raise on every rank what it raised
    (one of ``catch``), so that no rank waits in a collective for a rank that has stopped. The
    broadcast of the outcome is also the barrier after rank 0 writes: no rank runs ahead of a
    file it may need to resume from."""
    error = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            action(*args)
        except catch as exc:
            error = exc
    error = broadcast_object(error)
    if error is not None:
        raise error


def broadcast_buffers(model: nn.Module, src: int = 0) -> None:
    """Give every rank the buffers (BatchNorm running statistics) of rank ``src``.

    Without SyncBN (on CPU) each rank's running statistics follow its own batches, so ranks
    would otherwise validate slightly different models from the one rank 0 saves.
    """
    if dist.is_initialized():
        for buffer in model.buffers():
            dist.broadcast(buffer, src)


def unwrap(model: nn.Module) -> nn.Module:
    """The bare model under its wrappers: DDP (native or apex) and ``CompiledModel``."""
    while hasattr(model, "module"):
        model = model.module
    return model


# ----------------------------------------------------------------------------- prepare()
class NativeParallel:
    @staticmethod
    def convert_syncbn(model: nn.Module) -> nn.Module:
        return nn.SyncBatchNorm.convert_sync_batchnorm(model)

    @staticmethod
    def wrap(model: nn.Module, env: DistEnv) -> nn.Module:
        device_ids = [env.local_rank] if env.device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(model, device_ids=device_ids)


class ApexParallel:
    def __init__(self) -> None:
        self.parallel = import_apex("apex.parallel")

    def convert_syncbn(self, model: nn.Module) -> nn.Module:
        return self.parallel.convert_syncbn_model(model)

    def wrap(self, model: nn.Module, env: DistEnv) -> nn.Module:
        return self.parallel.DistributedDataParallel(model, delay_allreduce=True)


def prepare(
    model: nn.Module, optimizer: torch.optim.Optimizer, precision: Precision, env: DistEnv
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """SyncBN -> AMP -> DDP, the order of the original recipe (and of apex's requirements).

    The model must already be on ``env.device`` and ``optimizer`` built over its parameters.
    """
    parallel = ApexParallel() if precision.backend == "apex" else NativeParallel()
    if env.distributed and env.device.type == "cuda":
        model = parallel.convert_syncbn(model)
    elif env.distributed and env.is_primary:
        log.info("SyncBatchNorm runs on CUDA only: on CPU each process keeps its own BatchNorm")
    model, optimizer = precision.initialize(model, optimizer)
    if env.distributed:
        model = parallel.wrap(model, env)
    return model, optimizer
