"""Training on a data set larger than memory: peak RSS per rank and step rate, side by side.

    python bench/large_data.py --work /tmp/irongrain-large            # 8 x 512^3: 5 GiB of .npy
    python bench/large_data.py --work /tmp/x --volumes 2 --shape 64 128 128 --epochs 1   # quick

It writes two synthetic sets of ``.npy`` volumes under ``--work`` (float32 images, uint8 labels,
blocky grains in noise): a small one (``--small-volumes`` of ``--small-shape``) and a large one
(``--volumes`` of ``--shape``; the default is 4 GiB of images and 1 GiB of labels). Then it trains
each through ``launch.sh`` with 2 CPU processes, as a user would (bf16 autocast where the CPU
computes bf16 natively, fp32 elsewhere):

- small set, ``--data-access memory`` (every volume loaded: the usual path),
- small set, ``--data-access mmap``,
- large set, ``--data-access mmap`` (indexed on the first run, then read by patches),

and prints for each the peak resident memory of the largest rank (``VmHWM``, polled from
``/proc``), the training samples/s (median over the epochs, ``metrics.jsonl``) and the wall time.
Delete ``--work`` afterwards (``--keep`` keeps it; the sets are reused when present).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from app.precision.hardware import detect, machine_line  # noqa: E402

TRAIN = ["--patch-size", "32", "64", "64", "--f-maps", "8", "--depth", "4", "--batch-size", "2"]
TRAIN += ["--memory-format", "channels_last", "--compile", "off"]
TRAIN += ["--device", "cpu", "--num-workers", "0", "--val-every", "1"]
TRAIN += ["--val-mode", "patches", "--no-log-images"]


def precision() -> tuple[str, list[str]]:
    """bf16 autocast where this CPU computes bf16 natively, else fp32: emulated bf16 (an AVX2
    CPU) made each run 200 s instead of 20 s, timing the emulation instead of the data path."""
    if detect(torch.device("cpu")).native_bf16:
        return "bf16 autocast", ["--opt-level", "O1", "--amp-dtype", "bfloat16"]
    return "fp32", ["--opt-level", "O0"]


def write_volume_pair(images: Path, labels: Path, name: str, shape, rng) -> None:
    """One float32 image and uint8 label, written a slab at a time (bounded memory)."""
    grains = rng.random(tuple(math.ceil(s / 16) for s in shape)) > 0.7  # 16-voxel blocky grains
    image = np.lib.format.open_memmap(images / f"{name}.npy", "w+", np.float32, tuple(shape))
    label = np.lib.format.open_memmap(labels / f"{name}.npy", "w+", np.uint8, tuple(shape))
    for start in range(0, shape[0], 16):
        stop = min(start + 16, shape[0])
        coarse = grains[start // 16 : math.ceil(stop / 16)]
        mask = coarse.repeat(16, 0).repeat(16, 1).repeat(16, 2)
        mask = mask[(start % 16) : (start % 16) + stop - start, : shape[1], : shape[2]]
        noise = rng.standard_normal((stop - start, *shape[1:]), dtype=np.float32)
        image[start:stop] = mask * np.float32(1.5) + noise
        label[start:stop] = mask
        image.flush()
        label.flush()
    del image, label


def make_set(root: Path, volumes: int, shape, val_shape, seed: int) -> int:
    """A data root of ``volumes`` training and 2 validation pairs; its size in bytes."""
    done = root / ".complete"
    if not done.is_file():
        rng = np.random.default_rng(seed)
        for split, count, size in (("train", volumes, shape), ("val", 2, val_shape)):
            images, labels = root / f"{split}_patches/images", root / f"{split}_patches/labels"
            images.mkdir(parents=True, exist_ok=True)
            labels.mkdir(parents=True, exist_ok=True)
            for i in range(count):
                write_volume_pair(images, labels, f"vol_{i:02d}", size, rng)
        done.touch()
    return sum(p.stat().st_size for p in root.rglob("*.npy"))


def rank_peaks(marker: str) -> dict[int, int]:
    """VmHWM (kB) of the trainer processes started with ``marker``, by rank."""
    peaks = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
            if f"BENCH_MARKER={marker}".encode() not in environ:
                continue
            rank = next(int(e[5:]) for e in environ if e.startswith(b"RANK="))
            status = (proc / "status").read_text()
        except (OSError, StopIteration, ValueError):
            continue
        for line in status.splitlines():
            if line.startswith("VmHWM:"):
                peaks[rank] = int(line.split()[1])
    return peaks


def train(data: Path, run_dir: Path, access: str, args) -> dict:
    marker = uuid.uuid4().hex
    env = {**os.environ, "NPROC_PER_NODE": "2", "PYTHON": sys.executable, "BENCH_MARKER": marker}
    argv = [
        *TRAIN,
        *precision()[1],
        "--data-root",
        str(data),
        "--output-dir",
        str(run_dir),
        "--resume",
        "none",
    ]
    argv += ["--data-access", access, "--epochs", str(args.epochs)]
    argv += ["--samples-per-volume", str(args.samples_per_volume)]
    shutil.rmtree(run_dir, ignore_errors=True)
    started = time.perf_counter()
    proc = subprocess.Popen(
        ["bash", "launch.sh", *argv],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    peaks: dict[int, int] = {}
    while proc.poll() is None:
        for rank, kb in rank_peaks(marker).items():
            peaks[rank] = max(peaks.get(rank, 0), kb)
        time.sleep(0.1)
    output = proc.communicate()[0]
    if proc.returncode != 0:
        raise SystemExit(f"error: training on {data} failed:\n{output[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {
        "peak_mib": max(peaks.values(), default=0) / 1024,
        "ranks": len(peaks),
        "samples_per_s": statistics.median(r["samples_per_s"] for r in records),
        "wall_s": time.perf_counter() - started,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, required=True, help="folder for the sets and runs")
    parser.add_argument("--volumes", type=int, default=8, help="large set: training volumes")
    parser.add_argument("--shape", type=int, nargs=3, default=[512, 512, 512])
    parser.add_argument("--small-volumes", type=int, default=8)
    parser.add_argument("--small-shape", type=int, nargs=3, default=[64, 128, 128])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--samples-per-volume", type=int, default=8)
    parser.add_argument("--keep", action="store_true", help="keep --work afterwards")
    args = parser.parse_args(argv)
    if min(args.shape + args.small_shape) < 64 or args.volumes < 1 or args.epochs < 1:
        print("error: shapes must be at least 64 per axis, --volumes and --epochs >= 1",
              file=sys.stderr)  # fmt: skip
        return 2
    args.work.mkdir(parents=True, exist_ok=True)
    small_shape = args.small_shape
    try:
        small = args.work / "small"
        small_bytes = make_set(small, args.small_volumes, small_shape, small_shape, 0)
        large = args.work / "large"
        started = time.perf_counter()
        large_bytes = make_set(large, args.volumes, args.shape, small_shape, 1)
        made_s = time.perf_counter() - started
        rows = [
            ("small, memory", small_bytes, train(small, args.work / "run-memory", "memory", args)),
            ("small, mmap", small_bytes, train(small, args.work / "run-mmap-small", "mmap", args)),
            ("large, mmap", large_bytes, train(large, args.work / "run-mmap-large", "mmap", args)),
        ]
    finally:
        if not args.keep:
            shutil.rmtree(args.work, ignore_errors=True)
    torch.set_num_threads(1)
    print(f"large_data: torch {torch.__version__} on {machine_line(torch.device('cpu'))} per rank")
    print(
        f"2 CPU processes (launch.sh), UNet3d f_maps 8 depth 4, {precision()[0]}, batch 2 x "
        f"32x64x64, {args.samples_per_volume} patches/volume/epoch, {args.epochs} epochs, "
        f"num_workers 0; large set written in {made_s:.0f} s"
    )
    print(f"{'set, access':<16} {'data GiB':>9} {'peak RSS/rank MiB':>18} {'samples/s':>10} "
          f"{'wall s':>7}")  # fmt: skip
    base = rows[0][2]["samples_per_s"]
    for name, size, r in rows:
        print(
            f"{name:<16} {size / 2**30:9.2f} {r['peak_mib']:18.0f} {r['samples_per_s']:10.2f} "
            f"{r['wall_s']:7.0f}   {r['samples_per_s'] / base:.2f}x of memory"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
