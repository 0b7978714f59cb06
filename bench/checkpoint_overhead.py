"""What graceful preemption and ``--checkpoint-every-min`` cost the training step.

    python bench/checkpoint_overhead.py --config configs/demo.yaml   # 2 gloo ranks, 1 thread each

Three variants of the real step (``app.engine.steps.train_one_epoch`` through ``prepare()``, 2 gloo
processes as ``make demo`` runs them) are timed interleaved: ``off`` (no control, the step as
before), ``agree`` (the ranks' agreement every ``--stop-check-every`` steps, no checkpoint due)
and ``checkpoints`` (the agreement, plus a mid-epoch checkpoint written by rank 0 whenever
``--period-s`` seconds have passed: the trainer's own path, with a short period so that a
benchmark of a minute sees several). From the measured write time it projects the cost at the
periods a user sets (30 minutes, the CUDA default, and 5).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from app.config import ConfigError, load_config  # noqa: E402
from app.data.dataset import Normalization  # noqa: E402
from app.distributed import DistEnv  # noqa: E402
from app.engine.checkpointer import build_checkpointer  # noqa: E402
from app.engine.epoch_position import EpochPosition  # noqa: E402
from app.engine.preemption import NO_CONTROL, CheckpointClock, EpochControl, StopSignals  # noqa: E402
from app.engine.steps import SyntheticStepper, build_scheduler, train_one_epoch  # noqa: E402
from app.engine.tracking import NullTracker  # noqa: E402
from app.precision.hardware import machine_line  # noqa: E402

VARIANTS = ("off", "agree", "checkpoints")


def worker(rank: int, port: int, argv: list[str], args: dict, folder: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    cfg = load_config([*argv, "--output-dir", folder])
    env = DistEnv(rank, rank, 2, torch.device("cpu"))
    stepper = SyntheticStepper(cfg, env)
    checkpointer = build_checkpointer(
        cfg.run_dir,
        stepper.model,
        stepper.optimizer,
        build_scheduler(stepper.optimizer, cfg),
        stepper.precision,
        cfg,
        Normalization(cfg.normalization),
    )
    writes: list[float] = []

    def write(position, rngs):  # the trainer's mid-epoch write, timed on every rank
        started = time.perf_counter()
        checkpointer.save_recovery(position, rngs)
        writes.append(time.perf_counter() - started)

    steps = args["steps"]
    order = list(range((steps + 1) * 2 * cfg.batch_size))  # an epoch longer than a timed run
    controls = {
        "off": NO_CONTROL,
        "agree": EpochControl(StopSignals(), CheckpointClock(0), cfg.stop_check_every, env, write),
        "checkpoints": EpochControl(
            StopSignals(), CheckpointClock(args["period_s"]), cfg.stop_check_every, env, write
        ),
    }
    batches = [stepper.batch] * steps
    train_one_epoch(stepper.model, batches[:2], stepper.optimizer, stepper.precision,
                    stepper.loss_fn, NullTracker(), env, 1, 1)  # fmt: skip
    times = {name: [] for name in VARIANTS}
    for _ in range(args["repeats"]):
        for name in VARIANTS:
            control = controls[name]
            if control is not NO_CONTROL:
                control.begin(EpochPosition(1, world_size=2, batch_size=cfg.batch_size), order)
            dist.barrier()
            started = time.perf_counter()
            train_one_epoch(stepper.model, batches, stepper.optimizer, stepper.precision,
                            stepper.loss_fn, NullTracker(), env, 1, 1, None, control)  # fmt: skip
            times[name].append((time.perf_counter() - started) / steps)
    agreements = []  # the collective alone, which load on a shared machine cannot hide
    for _ in range(args["agreements"]):
        started = time.perf_counter()
        controls["agree"].agree()
        agreements.append(time.perf_counter() - started)
    if rank == 0:
        size = (Path(folder) / "checkpoints" / "last.pt").stat().st_size if writes else 0
        result = {"times": times, "writes": writes, "bytes": size, "agreements": agreements}
        Path(out).write_text(json.dumps(result))
    # As app.distributed's session ends: DDP sits in reference cycles, so collect it before its
    # process group goes, and leave together; else gloo can abort at exit ("terminate called
    # without an active exception").
    stepper = checkpointer = controls = write = None
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="steps per timed run")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per variant")
    parser.add_argument("--period-s", type=float, default=5.0, help="checkpoint period here")
    parser.add_argument("--agreements", type=int, default=200, help="agreements timed alone")
    args, rest = parser.parse_known_args(argv)
    rest = [*rest, "--device", "cpu"]
    try:
        cfg = load_config(rest)
        if cfg.opt_level == "auto" or cfg.amp_dtype == "auto" or cfg.memory_format == "auto":
            rest += ["--opt-level", "O0", "--memory-format", "channels_last"]
            cfg = load_config(rest)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if min(args.steps, args.repeats, args.agreements) < 1 or args.period_s <= 0:
        print(
            "error: --steps, --repeats, --agreements and --period-s must be positive",
            file=sys.stderr,
        )
        return 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.spawn(worker, args=(port, rest, vars(args), tmp, out), nprocs=2)
        result = json.loads(Path(out).read_text())
    torch.set_num_threads(1)
    print(f"checkpoint_overhead: torch {torch.__version__} on {machine_line(torch.device('cpu'))}")
    print(
        f"2 gloo ranks, UNet3d(f_maps={cfg.f_maps}, depth={cfg.depth}), --opt-level "
        f"{cfg.opt_level}, batch {cfg.batch_size} x {'x'.join(map(str, cfg.patch_size))}, "
        f"--stop-check-every {cfg.stop_check_every}; medians of {args.repeats} x {args.steps} "
        "steps, interleaved"
    )
    base = statistics.median(result["times"]["off"])
    for name in VARIANTS:
        seconds = result["times"][name]
        ms = 1000 * statistics.median(seconds)
        print(
            f"{name:<12} {ms:8.1f} ms/step ({1000 * min(seconds):.1f}..{1000 * max(seconds):.1f})"
            f"  {ms / (base * 1000):.4f}x of off"
        )
    agree_s = statistics.median(result["agreements"])
    share = agree_s / cfg.stop_check_every / base
    print(
        f"one agreement alone: {1e6 * agree_s:.0f} us (median of {args.agreements}), every "
        f"{cfg.stop_check_every} steps: {100 * share:.4f}% of a step"
    )
    writes = result["writes"]
    if writes:
        write_s = statistics.median(writes)
        print(
            f"{len(writes)} checkpoints of {result['bytes'] / 1e6:.2f} MB while timing "
            f"(every {args.period_s:g} s), median write {1000 * write_s:.1f} ms"
        )
        for minutes in (30, 5):  # the parts measured alone, over the step of `off`
            projected = share + write_s / (minutes * 60)
            print(
                f"--checkpoint-every-min {minutes}: projected cost {100 * projected:.3f}% "
                "of the step time"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
