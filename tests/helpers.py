"""Shared test helpers, imported as a plain module (``from helpers import ...``): tiny datasets
written in the trainer's layout, the TINY training flags, and a CPU-only environment.

Importing this module sets the environment the tests were written for (one thread, a private
``auto`` cache) before torch is imported, so a script that imports it gets the same runs.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")
# Tiny tensors: one thread is much faster than two competing for 2 cores, in this process and in
# the trainers that tests start (torchrun sets the same for its workers).
os.environ["OMP_NUM_THREADS"] = "1"
# auto decisions of test runs are cached apart from the user's (~/.cache/irongrain)
os.environ["IRONGRAIN_CACHE_DIR"] = tempfile.mkdtemp(prefix="irongrain-test-cache-")
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from app.data.volume_io import VolumeMeta, write_volume  # noqa: E402
from app.precision.hardware import detect  # noqa: E402

torch.set_num_threads(1)


def blob_volume(shape, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """A few bright noisy ellipsoids on a darker background: learnable in a handful of steps."""
    grid = np.stack(np.meshgrid(*[np.arange(s) for s in shape], indexing="ij"), -1).astype(float)
    label = np.zeros(shape, bool)
    for _ in range(4):
        centre = rng.uniform(0, shape)
        radii = rng.uniform(2, max(3, min(shape) / 3), 3)
        label |= (((grid - centre) / radii) ** 2).sum(-1) < 1
    image = label * 1.0 + rng.normal(0, 0.3, shape)
    return image.astype(np.float32), label.astype(np.uint8)


def write_dataset(
    root: Path,
    n_train: int = 3,
    n_val: int = 3,
    shape=(16, 32, 32),
    ext: str = ".nii.gz",
    seed: int = 0,
) -> Path:
    rng = np.random.default_rng(seed)
    for split, count in (("train_patches", n_train), ("val_patches", n_val)):
        for kind in ("images", "labels"):
            (root / split / kind).mkdir(parents=True, exist_ok=True)
        for i in range(count):
            image, label = blob_volume(shape, rng)
            meta = VolumeMeta(ext, affine=np.diag([0.5, 0.5, 0.5, 1.0]))
            write_volume(root / split / "images" / f"vol_{i:02d}{ext}", image, meta)
            write_volume(root / split / "labels" / f"vol_{i:02d}{ext}", label, meta)
    return root


def phase_volume(shape, rng: np.random.Generator, num_classes: int):
    """Blobs of classes 1..K-1, each class brighter than the last, on a dark noisy background."""
    grid = np.stack(np.meshgrid(*[np.arange(s) for s in shape], indexing="ij"), -1).astype(float)
    label = np.zeros(shape, np.uint8)
    for c in range(1, num_classes):
        for _ in range(2):
            centre = rng.uniform(0, shape)
            radii = rng.uniform(2, max(3, min(shape) / 3), 3)
            label[(((grid - centre) / radii) ** 2).sum(-1) < 1] = c
    image = label * 1.0 + rng.normal(0, 0.25, shape)
    return image.astype(np.float32), label


def write_phases(root, num_classes=3, n_train=3, n_val=3, shape=(16, 32, 32), seed=0):
    """A K-class dataset of :func:`phase_volume` label maps."""
    rng = np.random.default_rng(seed)
    for split, count in (("train_patches", n_train), ("val_patches", n_val)):
        for kind in ("images", "labels"):
            (root / split / kind).mkdir(parents=True, exist_ok=True)
        for i in range(count):
            image, label = phase_volume(shape, rng, num_classes)
            meta = VolumeMeta(".nii.gz", affine=np.eye(4))
            write_volume(root / split / "images" / f"vol_{i:02d}.nii.gz", image, meta)
            write_volume(root / split / "labels" / f"vol_{i:02d}.nii.gz", label, meta)
    return root


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The precision the tests were written for (auto is tested on its own): bf16 autocast wherever the
# CPU computes bf16. A CPU that only emulates it (AVX2) ran the tiny step 10x slower in bf16 (597
# against 60 ms) and the suite in 24 minutes, so there the runs are fp32; the tests of bf16 itself
# set their own flags (BF16).
BF16 = ["--opt-level", "O1", "--amp-dtype", "bfloat16"]
NATIVE_BF16 = detect(torch.device("cpu")).native_bf16
TINY_PRECISION = BF16 if NATIVE_BF16 else ["--opt-level", "O0"]

TINY = [
    "--patch-size",
    "16",
    "32",
    "32",
    "--f-maps",
    "4",
    "--depth",
    "3",
    "--batch-size",
    "2",
    "--samples-per-volume",
    "2",
    "--num-workers",
    "0",
    "--device",
    "cpu",
    "--log-every",
    "1",
    "--val-every",  # every epoch: the tests read each epoch's metrics (auto is tested alone)
    "1",
    "--memory-format",
    "channels_last",
    "--compile",  # compiling is tested on its own (tests/test_compile.py)
    "off",
    *TINY_PRECISION,
]
# the per-epoch figures that are clock readings, left out wherever records are compared
TIMING = (
    "epoch_time_s",
    "train_time_s",
    "val_time_s",
    "samples_per_s",
    "voxels_per_s",
    "gflop_per_s",
    "peak_gflop_per_s",
    "utilisation",
)


def train_tiny(data: Path, run_dir: Path, *extra: str, epochs: int = 2) -> Path:
    """Train the TINY configuration in this process and return the run dir."""
    from app.train import main as train_main

    args = [
        "--data-root",
        str(data),
        "--output-dir",
        str(run_dir),
        "--resume",
        "none",
        "--epochs",
        str(epochs),
        "--lr",
        "0.01",
        *TINY,
        *extra,
    ]
    assert train_main(args) == 0
    return run_dir


def records(run_dir: Path | str) -> list[dict]:
    """The run's ``metrics.jsonl``, one dict per epoch."""
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
