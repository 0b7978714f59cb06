"""How close the training step is to the machine: model FLOPs per step, achieved FLOP/s, the
practical peak in the same precision and their ratio, for several model widths and precisions.

    python bench/utilisation.py --config configs/demo.yaml                 # f_maps 8, 16, 32
    python bench/utilisation.py --config configs/demo.yaml --with-compiled     # and compiled steps
    python bench/utilisation.py --device cuda --f-maps-list 16 32 64 --precisions bf16 fp16

Every trainer flag is accepted (``--config``, ``--patch-size``, ``--batch-size``, ``--depth``,
``--norm``, ``--block``, ...). Each row is one width (``--f-maps-list``) in one precision
(``--precisions``: fp32, bf16, fp16; each as autocast O1 except fp32): the trainer's own step
(``app.engine.steps.SyntheticStepper``, world size 1, data already on the device) timed in
``--repeats`` interleaved runs of ``--steps`` steps (medians), its FLOPs counted by
``app.engine.utilisation.step_flops`` (convolutions, forward and backward), and the peak of that
precision measured in the same run by ``app.engine.utilisation.measure_peak`` (a 64->64 3x3x3
convolution, forward and both backward passes, never cached here): once in every repeat, the
best of them (fp32's where the device has no native arithmetic for a half precision).
``--with-compiled`` adds the same step under ``torch.compile`` (``--compile on``'s
wrapper): its time after compiling, the ratio to eager and the compile time.

A benchmark, not a test: figures hold on the hardware named in the header.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from app.config import Config, ConfigError  # noqa: E402
from app.distributed import DistEnv, resolve_device  # noqa: E402
from app.engine.compiling import step_seconds  # noqa: E402
from app.engine.steps import SyntheticStepper  # noqa: E402
from app.engine.utilisation import (  # noqa: E402
    autocast_dtype,
    measure_peak,
    peak_dtype,
    step_flops,
)
from bench.train_step import parse_args, versions_line  # noqa: E402

PRECISIONS = {"fp32": ("O0", "bfloat16"), "bf16": ("O1", "bfloat16"), "fp16": ("O1", "float16")}


def _add_args(parser: argparse._ActionsContainer) -> None:
    parser.add_argument("--steps", type=int, default=5, help="training steps per timed run")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per row (medians)")
    parser.add_argument(
        "--f-maps-list", type=int, nargs="+", default=[8, 16, 32], help="model widths, one row each"
    )
    parser.add_argument(
        "--precisions",
        nargs="+",
        choices=sorted(PRECISIONS),
        default=["fp32", "bf16"],
        help="precisions, one row each",
    )
    parser.add_argument(
        "--with-compiled", action="store_true", help="also time the step compiled (slow: compiles)"
    )


@dataclasses.dataclass
class Row:
    label: str
    cfg: Config
    eager: SyntheticStepper
    compiled: SyntheticStepper | None = None
    compile_s: float = 0.0
    times: dict[str, list[float]] = dataclasses.field(default_factory=dict)


def row_config(rows: list[Row], precision: str) -> Config:
    return next(row.cfg for row in rows if row.label.endswith(f", {precision}"))


def main(argv: list[str] | None = None) -> int:
    try:
        args, cfg = parse_args(argv, "bench/utilisation.py", __doc__.splitlines()[0], _add_args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    device = resolve_device(cfg.device, 0)
    env = DistEnv(0, 0, 1, device)
    # every row compiles the same forward at other shapes: keep them all compiled
    torch._dynamo.config.recompile_limit = 64
    torch._dynamo.config.accumulated_recompile_limit = 1024
    memory_format = "contiguous" if device.type == "cuda" else "channels_last"
    if cfg.memory_format != "auto":
        memory_format = cfg.memory_format
    print(versions_line(device))
    print(
        f"patch {'x'.join(map(str, cfg.patch_size))}, batch {cfg.batch_size}, depth "
        f"{cfg.depth}, norm {cfg.norm}, block {cfg.block}, {memory_format}; "
        f"{args.steps} steps x {args.repeats} runs, medians"
    )
    rows: list[Row] = []
    peaks: dict[str, float] = {}
    for name in args.precisions:
        level, dtype = PRECISIONS[name]
        for f_maps in args.f_maps_list:
            row_cfg = dataclasses.replace(
                cfg, f_maps=f_maps, opt_level=level, amp_dtype=dtype, memory_format=memory_format
            )
            torch.manual_seed(cfg.seed)
            row = Row(f"f_maps {f_maps}, {name}", row_cfg, SyntheticStepper(row_cfg, env))
            row.eager.run(1)
            if args.with_compiled:
                row.compiled = SyntheticStepper(row_cfg, env, compile=True)
                first = step_seconds(row.compiled.run, 1)
                row.compile_s = first - step_seconds(row.compiled.run, 1)
            rows.append(row)
    channels_last = memory_format == "channels_last"
    for _ in range(args.repeats):  # interleaved: every row and peak sees the same machine load
        for name in args.precisions:
            dtype = peak_dtype(device, autocast_dtype(row_config(rows, name)))
            peaks[name] = max(peaks.get(name, 0.0), measure_peak(device, dtype, channels_last))
        for row in rows:
            row.times.setdefault("eager", []).append(step_seconds(row.eager.run, args.steps))
            if row.compiled:
                row.times.setdefault("compiled", []).append(
                    step_seconds(row.compiled.run, args.steps)
                )
    head = (
        f"{'model, precision':<20} {'GFLOP/step':>10} {'ms/step':>8} {'GFLOP/s':>8} "
        f"{'peak':>6} {'util':>5}"
    )
    if args.with_compiled:
        head += f" {'compiled ms':>11} {'speed-up':>8} {'util':>5} {'compile s':>9}"
    print(head)
    for row in rows:
        flop = step_flops(row.cfg)
        peak = peaks[row.label.rsplit(", ", 1)[1]]
        eager = statistics.median(row.times["eager"])
        line = (
            f"{row.label:<20} {flop / 1e9:>10.1f} {eager * 1000:>8.0f} {flop / eager / 1e9:>8.0f} "
            f"{peak / 1e9:>6.0f} {flop / eager / peak:>5.0%}"
        )
        if row.compiled:
            compiled = statistics.median(row.times["compiled"])
            line += (
                f" {compiled * 1000:>11.0f} {eager / compiled:>7.2f}x "
                f"{flop / compiled / peak:>5.0%} {row.compile_s:>9.0f}"
            )
        print(line)
    for name in args.precisions:
        dtype = autocast_dtype(row_config(rows, name))
        if peak_dtype(device, dtype) != dtype:
            print(f"{name}: this device has no native {name}; its peak is fp32's")
    print(
        "GFLOP/step: convolutions forward and backward; peak: GFLOP/s of a 64->64 3x3x3 "
        "convolution (forward + both backward passes) in that precision, this run; util: "
        "achieved / peak"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
