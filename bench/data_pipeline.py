"""Data pipeline rate: training patches/s with augmentation off and at each level, side by side.

    python bench/data_pipeline.py                            # generated volumes, config defaults
    python bench/data_pipeline.py --config configs/demo.yaml --repeats 5
    python bench/data_pipeline.py --data-root datasets/IronGrain/74x320x320 --num-workers 4

Every trainer flag is accepted; the ones that matter here are ``--data-root``, ``--patch-size``,
``--batch-size``, ``--num-workers``, ``--samples-per-volume``, ``--foreground-fraction``,
``--normalization`` and ``--seed``. Without ``--data-root`` (on the command line or in the YAML
file) a small set is generated in a temporary folder with ``datasets/make_synthetic.py``
(``--gen-volumes`` volumes of ``--gen-shape``) and deleted at the end.

What runs is the trainer's pipeline: ``load_split`` + ``PatchDataset`` (augmentation off, then
each ``--augment-level``: flips, rot90, gamma, spatial, basic, full, see ``app/data/augment.py``) +
``DistributedSampler`` (one replica) + ``DataLoader`` with ``--num-workers`` and ``--batch-size``.
One timed run is one epoch, ``set_epoch`` included, and includes starting the worker processes,
since the trainer's workers are not persistent either. The modes alternate (epoch 1 off, flips, ...,
full, epoch 2 off, ...), so all see the same patches and the same machine load; the table gives
medians over ``--repeats`` epochs and the ratio to off. ``ms/patch`` is ``__getitem__`` in
this process alone (no DataLoader): the CPU cost of one patch, for one worker.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import torch
from torch.utils.data import DataLoader, DistributedSampler

ROOT = Path(__file__).resolve().parents[1]


def load_by_path(name: str, path: Path) -> ModuleType:
    """Import a script by file path (``bench/`` and ``datasets/`` are not packages)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


train_step = load_by_path("bench_train_step", ROOT / "bench" / "train_step.py")

from app.config import Config, ConfigError  # noqa: E402
from app.data.augment import LEVELS  # noqa: E402
from app.data.dataset import (  # noqa: E402
    DataError,
    Normalization,
    PatchDataset,
    load_split,
)
from app.data.volume_io import VolumeError  # noqa: E402


def _add_args(parser: argparse._ActionsContainer) -> None:
    parser.add_argument("--repeats", type=int, default=3, help="epochs timed per mode (medians)")
    parser.add_argument(
        "--gen-volumes",
        type=int,
        default=4,
        help="training volumes to generate when no --data-root is given",
    )
    parser.add_argument(
        "--gen-shape",
        type=int,
        nargs=3,
        metavar=("D", "H", "W"),
        help="shape of the generated volumes (default: 1.25 x --patch-size)",
    )


def generate(out: Path, n_volumes: int, shape: Sequence[int], seed: int) -> None:
    synth = load_by_path("irongrain_make_synthetic", ROOT / "datasets" / "make_synthetic.py")
    synth.generate(out, n_volumes, 1, tuple(shape), seed, log=lambda *_: None)


def time_epoch(loader: DataLoader, epoch: int) -> tuple[float, int]:
    loader.sampler.set_epoch(epoch)
    loader.dataset.set_epoch(epoch)
    started = time.perf_counter()
    patches = 0
    for images, _labels in loader:
        patches += images.shape[0]
    return time.perf_counter() - started, patches


def getitem_ms(dataset: PatchDataset, limit: int = 16) -> float:
    count = min(len(dataset), limit)
    started = time.perf_counter()
    for index in range(count):
        dataset[index]
    return 1000 * (time.perf_counter() - started) / count


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args, cfg = train_step.parse_args(
            argv, "bench/data_pipeline.py", __doc__.split("\n\n")[0], _add_args
        )
        if args.repeats < 1 or args.gen_volumes < 1:
            raise ConfigError("--repeats and --gen-volumes must be at least 1")
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    with contextlib.ExitStack() as stack:
        if cfg.data_root == Config().data_root:
            shape = args.gen_shape or [max(8, math.ceil(1.25 * p)) for p in cfg.patch_size]
            root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="irongrain-")))
            started = time.perf_counter()
            generate(root, args.gen_volumes, shape, cfg.seed)
            source = (
                f"{args.gen_volumes} volumes {'x'.join(map(str, shape))} generated by "
                f"datasets/make_synthetic.py in {time.perf_counter() - started:.1f} s"
            )
        else:
            root = Path(cfg.data_root)
            source = str(root)
        try:
            # As the trainer loads it: dataset normalisation is fitted on this split first.
            volumes = load_split(root, "train", "raw", cfg.seed)
            fitted = Normalization.fit(cfg.normalization, [vol.image for vol in volumes])
            for vol in volumes:
                vol.image = fitted(vol.image)
        except (DataError, VolumeError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        loaders = {}
        square = cfg.patch_size[1] == cfg.patch_size[2]
        for mode in ("off", *(level for level in LEVELS if square or level != "rot90")):
            dataset = PatchDataset(
                volumes,
                cfg.patch_size,
                cfg.samples_per_volume,
                cfg.foreground_fraction,
                mode != "off",
                cfg.seed,
                "basic" if mode == "off" else mode,
            )
            sampler = DistributedSampler(
                dataset, num_replicas=1, rank=0, shuffle=True, seed=cfg.seed
            )
            loaders[mode] = DataLoader(
                dataset,
                batch_size=cfg.batch_size,
                sampler=sampler,
                num_workers=cfg.num_workers,
                pin_memory=torch.cuda.is_available(),
            )
        per_epoch = len(loaders["off"].dataset)
        print(f"data_pipeline: torch {torch.__version__}, data: {source}")
        print(
            f"patch {'x'.join(map(str, cfg.patch_size))}, batch {cfg.batch_size}, {per_epoch} "
            f"patches per epoch ({len(volumes)} volumes x {cfg.samples_per_volume}), "
            f"{cfg.num_workers} workers, pin_memory "
            f"{'on' if torch.cuda.is_available() else 'off'}; {args.repeats} epochs per mode, "
            "interleaved, worker start-up included"
            + ("" if square else "; rot90 left out (it needs a patch with H == W)")
        )
        seconds: dict[str, list[float]] = {mode: [] for mode in loaders}
        for epoch in range(1, args.repeats + 1):
            for mode, loader in loaders.items():
                elapsed, patches = time_epoch(loader, epoch)
                assert patches == per_epoch, (patches, per_epoch)
                seconds[mode].append(elapsed)
        ms = {mode: getitem_ms(loader.dataset) for mode, loader in loaders.items()}

    voxels = math.prod(cfg.patch_size)
    rates = {m: [per_epoch / s for s in v] for m, v in seconds.items()}
    medians = {m: statistics.median(r) for m, r in rates.items()}
    print(
        f"{'augment':<8} {'patches/s':>10} {'(min..max)':>20} {'voxels/s':>10} "
        f"{'ms/patch':>9} {'vs off':>7}"
    )
    for mode, rate in medians.items():
        spread = f"({min(rates[mode]):.3g}..{max(rates[mode]):.3g})"
        print(
            f"{mode:<8} {rate:>10.3g} {spread:>20} {rate * voxels:>10.3g} {ms[mode]:>9.1f} "
            f"{rate / medians['off']:>6.2f}x"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
