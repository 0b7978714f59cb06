"""How fast and how right the grain analysis (``app.analysis.grains``) is.

    python bench/grains.py scale                         # time per volume size, 74x320x320 .. 512^3
    python bench/grains.py params                        # splitting parameters against the truth
    python bench/grains.py postprocess --run runs/demo   # mask clean-up: Dice and object F1

- ``scale``: a synthetic 74x320x320 mask (``datasets/make_synthetic.py``), then that mask
  tiled to larger cubes (grains cut at the seams; only the time is read there). For each size
  the median of ``--repeats`` runs of :func:`app.analysis.grains.split_grains` (components, distance
  map, h-maxima seeds, watershed), :func:`app.analysis.grains.grain_table` and
  :func:`app.analysis.grains.match_grains`, and the peak memory of the process.
- ``params``: the watershed of the generator's true masks scored against its instance maps over
  a grid of ``h`` and ``smooth``: how the defaults were chosen, and the ceiling of the object F1
  that a perfect voxel mask would reach.
- ``postprocess``: a run's checkpoint predicts the val volumes once; then the masks with each
  clean-up (``--min-object-size``, ``--fill-holes``) are scored: global Dice and object F1
  against the instance maps.

Every figure holds on the machine in the header line only.
"""

from __future__ import annotations

import argparse
import importlib.util
import resource
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from app.analysis import grains  # noqa: E402
from app.analysis.masks import clean_mask  # noqa: E402
from app.precision.hardware import cpu_info  # noqa: E402


def synthetic():
    spec = importlib.util.spec_from_file_location("synth", ROOT / "datasets/make_synthetic.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def header(what: str) -> str:
    model, flags = cpu_info()
    native = ", ".join(f for f in ("amx_bf16", "avx512_bf16", "avx512f", "avx2") if f in flags)
    return f"grains {what}: {model} ({native}), numpy {np.__version__}"


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def tiled(mask: np.ndarray, side: int) -> np.ndarray:
    reps = [-(-side // s) for s in mask.shape]
    return np.tile(mask, reps)[:side, :side, :side]


def cmd_scale(args: argparse.Namespace) -> None:
    print(header("scale"))
    shape = tuple(args.shape)
    volume = synthetic().make_grain_volume(shape, np.random.default_rng(args.seed))
    truth = grains.drop_small(volume.instances.astype(np.int64), grains.GrainParams().min_size)
    cases = [("x".join(map(str, shape)), volume.label > 0, truth)]
    cases += [(f"{s}^3", tiled(volume.label > 0, s), None) for s in args.cubes]
    print(
        f"{'volume':>12} {'Mvoxels':>8} {'grains':>7} {'split s':>8} {'table s':>8} "
        f"{'match s':>8} {'peak GiB':>9}"
    )
    for name, mask, true in cases:
        repeats = args.repeats if mask.size <= 32e6 else 1
        times = {"split": [], "table": [], "match": []}
        for _ in range(repeats):
            started = time.perf_counter()
            found = grains.split_grains(mask)
            times["split"].append(time.perf_counter() - started)
            started = time.perf_counter()
            grains.grain_table(found)
            times["table"].append(time.perf_counter() - started)
            started = time.perf_counter()
            grains.match_grains(found, true if true is not None else found)
            times["match"].append(time.perf_counter() - started)
        med = {k: statistics.median(v) for k, v in times.items()}
        print(
            f"{name:>12} {mask.size / 1e6:8.1f} {int(found.max()):7d} {med['split']:8.2f} "
            f"{med['table']:8.2f} {med['match']:8.2f} {peak_rss_gib():9.2f}"
            + ("" if repeats > 1 else "  (1 run)"),
            flush=True,
        )


def cmd_params(args: argparse.Namespace) -> None:
    print(header("params"))
    synth = synthetic()
    shape = tuple(args.shape)
    volumes = [synth.make_grain_volume(shape, np.random.default_rng(i)) for i in range(args.n)]
    print(
        f"{args.n} synthetic volumes {'x'.join(map(str, shape))}; the watershed of the true "
        "masks against the instance maps"
    )
    print(
        f"{'h':>5} {'smooth':>6} {'pred':>6} {'true':>6} {'merged':>7} {'split':>6} "
        f"{'object F1':>9}"
    )
    n = np.zeros(5, dtype=int)
    for v in volumes:  # no watershed: every connected component is one grain
        min_size = grains.GrainParams().min_size
        found = grains.drop_small(grains.label_components(v.label > 0, connectivity=1), min_size)
        m = grains.match_grains(found, grains.drop_small(v.instances.astype(np.int64), min_size))
        n += (m.n_pred, m.n_true, m.matched, m.merged, m.split)
    f1 = grains.object_scores(n[2], n[0], n[1])["object_f1"]
    print(f"{'components only':>12} {n[0]:6d} {n[1]:6d} {n[3]:7d} {n[4]:6d} {f1:9.4f}")
    for smooth in args.smooth:
        for h in args.h:
            params = grains.GrainParams(h=h, smooth=smooth)
            n = np.zeros(5, dtype=int)
            for v in volumes:
                truth = grains.drop_small(v.instances.astype(np.int64), params.min_size)
                m = grains.match_grains(grains.split_grains(v.label > 0, params), truth)
                n += (m.n_pred, m.n_true, m.matched, m.merged, m.split)
            f1 = grains.object_scores(n[2], n[0], n[1])["object_f1"]
            mark = "  <- default" if params == grains.GrainParams() else ""
            print(f"{h:5.2f} {smooth:6.2f} {n[0]:6d} {n[1]:6d} {n[3]:7d} {n[4]:6d} {f1:9.4f}{mark}")


def cmd_postprocess(args: argparse.Namespace) -> None:
    import torch

    from app.analysis.predict import load_predictor
    from app.data.dataset import SPLITS, load_volume_pair, pair_files
    from app.labels import THRESHOLD

    print(header("postprocess"))
    checkpoint = args.run / "checkpoints" / f"{args.checkpoint}.pt"
    predictor = load_predictor(checkpoint, torch.device("cpu"))
    root = Path(args.data_root or predictor.cfg.data_root)
    val = root / SPLITS["val"]
    rng = np.random.default_rng(0)
    maps = grains.instance_maps(val / "instances")
    params = grains.GrainParams()
    cases = []
    for name, image_path, label_path in pair_files(val):
        vol = load_volume_pair(name, image_path, label_path, predictor.normalization, rng)
        truth = grains.true_instances(vol.label > 0, label_path, maps.get(name), params)
        cases.append((predictor.probabilities(vol.image) > THRESHOLD, vol.label > 0, truth))
    source = "instance maps" if maps else "watershed of the labels"
    print(f"{checkpoint} on {len(cases)} val volumes of {val}; true grains: {source}")
    print(f"{'clean-up':>24} {'Dice':>7} {'object F1':>9} {'merged':>7} {'split':>6}")
    for min_size in args.min_sizes:
        for fill in (False, True):
            tp = fp = fn = matched = n_pred = n_true = merged = split = 0
            for mask, label, truth in cases:
                mask = clean_mask(mask, min_size, fill)
                tp += int((mask & label).sum())
                fp += int((mask & ~label).sum())
                fn += int((~mask & label).sum())
                m = grains.match_grains(grains.split_grains(mask, params), truth)
                matched, n_pred, n_true = matched + m.matched, n_pred + m.n_pred, n_true + m.n_true
                merged, split = merged + m.merged, split + m.split
            f1 = grains.object_scores(matched, n_pred, n_true)["object_f1"]
            name = f"min {min_size}" + (" + fill holes" if fill else "")
            print(f"{name:>24} {2 * tp / (2 * tp + fp + fn):7.4f} {f1:9.4f} {merged:7d} {split:6d}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    scale = sub.add_parser("scale", help="time per volume size")
    scale.add_argument("--shape", type=int, nargs=3, default=[74, 320, 320], help="generated")
    scale.add_argument("--cubes", type=int, nargs="*", default=[128, 256, 512], help="tiled")
    scale.add_argument("--repeats", type=int, default=3)
    scale.add_argument("--seed", type=int, default=1)
    params = sub.add_parser("params", help="splitting parameters against the truth")
    params.add_argument("--shape", type=int, nargs=3, default=[32, 96, 96])
    params.add_argument("--n", type=int, default=3, help="volumes")
    params.add_argument("--h", type=float, nargs="+", default=[0.1, 0.2, 0.3, 0.5, 1.0])
    params.add_argument("--smooth", type=float, nargs="+", default=[0.0, 0.7, 1.0, 1.5])
    post = sub.add_parser("postprocess", help="mask clean-up: Dice and object F1")
    post.add_argument("--run", type=Path, required=True, help="run directory of app.train")
    post.add_argument("--checkpoint", choices=["best", "last"], default="best")
    post.add_argument("--data-root", help="default: the checkpoint's data_root")
    post.add_argument("--min-sizes", type=int, nargs="+", default=[0, 10, 20, 50, 100])
    args = parser.parse_args(argv)
    {"scale": cmd_scale, "params": cmd_params, "postprocess": cmd_postprocess}[args.command](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
