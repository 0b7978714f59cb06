"""DDP step time with and without the gradient restriding of ``app.model.use_channels_last``.

    python bench/ddp_strides.py --config configs/demo.yaml      # 2 gloo ranks, 1 thread each

Under channels_last, the CPU convolution backward returns the 1x1x1 head's weight gradient with
contiguous strides (the same bytes as the parameter's channels_last strides), and DDP's reducer
warned "Grad strides do not match bucket view strides ... may impair performance" on every run.
``use_channels_last`` now gives such gradients the parameter's strides (a view, no copy). This
benchmark times the real training step (``app.engine.steps.train_one_epoch`` through ``prepare()``,
2 processes as ``make demo`` runs them, one thread each as torchrun sets) with the fix and without,
interleaved, and counts the warnings each variant raised.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from app.config import load_config  # noqa: E402
from app.distributed import DistEnv, prepare  # noqa: E402
from app.engine.steps import build_optimizer, synthetic_batch, train_one_epoch  # noqa: E402
from app.engine.tracking import NullTracker  # noqa: E402
from app.losses import BCEDiceLoss  # noqa: E402
from app.model import UNet3d, use_channels_last  # noqa: E402
from app.precision.amp import build_precision  # noqa: E402
from app.precision.hardware import machine_line  # noqa: E402

VARIANTS = {"restrided (now)": True, "as before": False}


def worker(rank: int, port: int, argv: list[str], steps: int, repeats: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    cfg = load_config(argv)
    env = DistEnv(rank, rank, 2, torch.device("cpu"))
    batch = synthetic_batch(cfg, env.device, offset=float(rank))
    loss_fn = BCEDiceLoss(cfg.bce_weight, cfg.dice_weight)
    levels, warned = {}, {}
    for name, restride in VARIANTS.items():
        torch.manual_seed(cfg.seed)
        precision = build_precision(cfg, env.device)
        model = use_channels_last(UNet3d(1, 1, cfg.f_maps, cfg.depth), restride)
        optimizer = build_optimizer(model, cfg, env, precision.backend)
        model, optimizer = prepare(model, optimizer, precision, env)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            train_one_epoch(model, [batch] * 2, optimizer, precision, loss_fn, NullTracker(),
                            env, 1, 1)  # fmt: skip
        warned[name] = sum("Grad strides" in str(w.message) for w in caught)
        levels[name] = (model, optimizer, precision)
    times = {name: [] for name in VARIANTS}
    for _ in range(repeats):
        for name, (model, optimizer, precision) in levels.items():
            dist.barrier()
            started = time.perf_counter()
            train_one_epoch(model, [batch] * steps, optimizer, precision, loss_fn, NullTracker(),
                            env, 1, 1)  # fmt: skip
            times[name].append((time.perf_counter() - started) / steps)
    if rank == 0:
        Path(out).write_text(json.dumps({"times": times, "warned": warned}))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5)
    args, rest = parser.parse_known_args(argv)
    rest = [*rest, "--device", "cpu", "--memory-format", "channels_last"]
    cfg = load_config(rest)
    if cfg.opt_level == "auto":  # the demo's warning appeared at fp32
        rest += ["--opt-level", "O0"]
        cfg = load_config(rest)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.spawn(worker, args=(port, rest, args.steps, args.repeats, out), nprocs=2)
        result = json.loads(Path(out).read_text())
    torch.set_num_threads(1)
    print(f"ddp_strides: torch {torch.__version__} on {machine_line(torch.device('cpu'))} per rank")
    print(
        f"2 gloo ranks, UNet3d(f_maps={cfg.f_maps}, depth={cfg.depth}) channels_last, "
        f"--opt-level {cfg.opt_level}, batch {cfg.batch_size} x "
        f"{'x'.join(map(str, cfg.patch_size))}; medians of {args.repeats} x {args.steps} steps, "
        "interleaved"
    )
    base = statistics.median(result["times"]["as before"])
    for name, seconds in result["times"].items():
        ms = 1000 * statistics.median(seconds)
        print(
            f"{name:<16} {ms:8.1f} ms/step ({1000 * min(seconds):.1f}..{1000 * max(seconds):.1f})"
            f"  {base * 1000 / ms:.3f}x vs before   stride warnings: {result['warned'][name]}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
