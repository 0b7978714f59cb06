"""Atomic checkpoint writes, restore, and resume discovery.

A checkpoint is plain data (tensors, numbers, strings, lists, dicts) so that it loads with
``torch.load(..., weights_only=True)``:

``model`` (the unwrapped state_dict), ``ema`` (``None``, or the weight average of ``--ema-decay``:
its decay, update count and weights, ``app.engine.ema``), ``optimizer``, ``scheduler``,
``precision`` (backend, opt level, dtype, and the GradScaler or apex ``amp`` state), ``epoch``
(epochs completed), ``best_dice``, ``metrics`` (that epoch's record), ``config`` (with its ``auto``
settings resolved), ``resolved`` (that decision and its reason, ``app.precision.auto``) and ``rng``
(torch, CUDA, numpy and Python generator states). A mid-epoch checkpoint
(``app.engine.preemption``) adds ``position`` (the epoch, step, sample order and partial sums,
``app.engine.epoch_position``) and ``rng_per_rank``; its ``epoch`` counts the epochs completed. A
model holding NaN or Inf is never written.

Writes are atomic (``app.atomic``): a writer killed at any point leaves the previous file intact.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from app.atomic import atomic_write, os_cause

FORMAT_VERSION = 1
REQUIRED_KEYS = (
    "format_version",
    "model",
    "optimizer",
    "scheduler",
    "precision",
    "epoch",
    "config",
)


class CheckpointError(RuntimeError):
    """A checkpoint is unusable; the message names the file."""


def save_checkpoint(path: Path | str, state: dict[str, Any]) -> None:
    """Write ``state`` atomically; refuses weights holding NaN or Inf, keeping the file there."""
    average = (state.get("ema") or {}).get("weights", {})
    bad = [
        name
        for name, tensor in [*state.get("model", {}).items(), *average.items()]
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all())
    ]
    if bad:
        raise CheckpointError(
            f"{path}: not written, the model's {', '.join(bad[:3])}"
            f"{' and more' if len(bad) > 3 else ''} hold NaN or Inf; the previous file is kept"
        )
    try:
        atomic_write(path, lambda f: torch.save(state, f))
    except OSError as exc:  # a full or read-only disk: the atomic write kept the old file
        kept = f"the previous {Path(path).name} is kept" if Path(path).is_file() else "none kept"
        raise CheckpointError(f"{path}: checkpoint not written: {os_cause(exc)}; {kept}") from exc


def load_checkpoint(path: Path | str) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: checkpoint not found")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(
            f"{path}: not a readable checkpoint, corrupt or truncated? "
            f"({type(exc).__name__}: {exc})"
        ) from exc
    missing = [k for k in REQUIRED_KEYS if not isinstance(state, dict) or k not in state]
    if missing:
        raise CheckpointError(f"{path}: not a checkpoint of this trainer (missing {missing})")
    if state["format_version"] != FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: checkpoint format {state['format_version']}, this "
            f"trainer reads format {FORMAT_VERSION}"
        )
    return state


def rng_state() -> dict[str, Any]:
    """Generator states as plain data (numpy's key array becomes a tensor)."""
    numpy_state = np.random.get_state(legacy=False)
    numpy_state["state"]["key"] = torch.from_numpy(numpy_state["state"]["key"].astype(np.int64))
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": numpy_state,
        "python": random.getstate(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    numpy_state = dict(state["numpy"])
    numpy_state["state"] = {
        **numpy_state["state"],
        "key": state["numpy"]["state"]["key"].numpy().astype(np.uint32),
    }
    np.random.set_state(numpy_state)
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))


def remove_stale_temporaries(folder: Path) -> list[Path]:
    """Delete temporary files that a writer killed mid-write left behind (never a checkpoint)."""
    stale = sorted(folder.glob(".*.pt.*.tmp")) if folder.is_dir() else []
    for path in stale:
        path.unlink(missing_ok=True)
    return stale


def checkpoint_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def resume_path(resume: str, run_dir: Path) -> Path | None:
    """The checkpoint to resume from, or None to start fresh; refuses to overwrite a run."""
    last = checkpoint_dir(run_dir) / "last.pt"
    if resume == "auto":
        return last if last.is_file() else None
    if resume == "none":
        if last.is_file():
            raise CheckpointError(
                f"{last}: --resume none, but this run dir already has checkpoints; use "
                "--resume auto to continue it, or a new --output-dir"
            )
        return None
    path = Path(resume)
    if not path.is_file():
        raise CheckpointError(f"--resume {path}: checkpoint not found")
    return path
