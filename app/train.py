"""Train a 3D U-Net on IronGrain volumes: ``python -m app.train --help`` (or ``bash launch.sh``).

parse -> resolve -> build -> fit: the flags and YAML become a config (``app.config``), resolving
plans the run and decides its ``auto`` settings on this machine (``app.engine.resolve``), the
trainer is built from parts that own their state, and fits: epochs of {train under autocast,
scheduler.step() once, exact sharded evaluation}, rank 0 writing metrics, TensorBoard and
checkpoints (``app.engine``).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import torch

from app.atomic import os_cause
from app.config import Config, ConfigError, load_config_and_given
from app.data.dataset import DataError
from app.data.volume_io import VolumeError
from app.distributed import PEER_LOST_EXIT, DistEnv, distributed_session, peer_lost
from app.engine.checkpoint import CheckpointError
from app.engine.preemption import Preempted, StopSignals
from app.engine.resolve import resolve
from app.engine.steps import NonFiniteError
from app.engine.trainer import build

log = logging.getLogger("app.train")
USER_ERRORS = (ConfigError, DataError, VolumeError, CheckpointError, NonFiniteError)


def train(
    settings: Config, env: DistEnv, given: frozenset[str] = frozenset(), signals=None
) -> dict[str, Any]:
    """Train (or, with ``--eval-only``, evaluate) under ``settings``; ``given``: the settings the
    user set, which ``--plan auto`` keeps; ``signals``: SIGTERM/SIGINT, on which every rank stops
    with a checkpoint (:class:`Preempted`)."""
    # fixed patch and window sizes: let cuDNN pick the fastest 3D convolution algorithms once
    torch.backends.cudnn.benchmark = env.device.type == "cuda"
    run = resolve(settings, given, env)
    trainer = build(run, env, signals)
    return trainer.evaluate_only() if run.cfg.eval_only else trainer.fit()


def one_line(exc: Exception) -> str:
    """The message of ``exc``; a DataLoader worker's error arrives with the worker's traceback
    in its text, and only its last line, the error itself, is kept."""
    text = str(exc)
    if "Original Traceback" not in text:
        return text
    return text.strip().splitlines()[-1].split(": ", 1)[-1]


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
        cfg, given = load_config_and_given(argv)  # parse
        with distributed_session(cfg) as env, StopSignals() as signals:
            setup_logging(env.rank)
            log_versions()
            train(cfg, env, given, signals)  # resolve -> build -> fit
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
        where = exc.filename or (f"--output-dir {cfg.output_dir}" if cfg else "a file")
        print(f"error: {where}: {os_cause(exc)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
