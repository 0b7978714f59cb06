"""Training-step rate of the real trainer step on synthetic tensors: samples/s and voxels/s.

    python bench/train_step.py                                  # the config defaults, one level
    python bench/train_step.py --config configs/demo.yaml --compare-precision
    python bench/train_step.py --device cuda --compare-precision --steps 20 --repeats 5
    python bench/train_step.py --device cuda --opt-level O1 --compare-memory-format

Every trainer flag is accepted (``--config YAML``, ``--patch-size``, ``--batch-size``,
``--f-maps``, ``--depth``, ``--opt-level``, ``--amp-dtype``, ``--amp-backend``, ``--device``,
``--lr``, ...) and means what it means to ``python -m app.train``; the benchmark adds
``--steps``, ``--warmup``, ``--repeats``, ``--compare-precision`` and ``--compare-memory-format``.

What runs is the trainer's own code: ``UNet3d``, ``BCEDiceLoss``, Adam, ``build_precision`` and
``prepare()`` (world size 1), and ``app.train.train_one_epoch`` over ``--steps`` copies of one
random batch of ``--batch-size`` x ``--patch-size`` already on the device, so the step sequence
(autocast forward, ``zero_grad``, ``precision.backward``, ``precision.step``) is the training
loop's. No data loading is timed (see ``bench/data_pipeline.py`` for that).

``--compare-precision`` builds one model per opt level (O0, O1 with ``--amp-dtype``, O3) and
times them interleaved (repeat 1 of every level, then repeat 2, ...), so every level sees the same
machine load; the table gives medians over ``--repeats`` and the ratio to O0.
``--compare-memory-format`` does the same for the trainer's ``--memory-format`` (contiguous vs
channels_last_3d, at the config's opt level): the measurement behind its ``auto`` default.

Peak memory: on CUDA ``torch.cuda.max_memory_allocated`` during the warm-up, minus what was
allocated before that level's model was built (so each level's own parameters, gradients,
optimizer state, activations and workspaces). On CPU the process's peak RSS (``ru_maxrss``),
reset before each level through ``/proc/self/clear_refs`` where Linux allows it; it includes
the ~0.3-0.5 GiB of the loaded libraries and memory that earlier levels freed but kept mapped.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")

from app.config import Config, ConfigError, build_parser, load_config  # noqa: E402
from app.distributed import DistEnv, prepare, resolve_device  # noqa: E402
from app.losses import BCEDiceLoss  # noqa: E402
from app.model import UNet3d, build_model, resolve_memory_format  # noqa: E402
from app.precision import Precision, build_precision  # noqa: E402
from app.tracking import NullTracker  # noqa: E402
from app.train import scaled_lr, train_one_epoch  # noqa: E402


# ----------------------------------------------------------------------------- arguments
def parse_args(
    argv: Sequence[str] | None,
    prog: str,
    description: str,
    add_bench_args: Callable[[argparse._ActionsContainer], None],
) -> tuple[argparse.Namespace, Config]:
    """The benchmark's own flags, and a :class:`Config` from ``--config`` + the trainer flags.

    One parser with both sets checks the command line and prints ``--help``; the benchmark
    flags are then taken out and the rest goes through ``app.config.load_config``.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    full = build_parser()
    full.prog, full.description = prog, description
    add_bench_args(full.add_argument_group("benchmark"))
    full.parse_args(argv)  # --help, and usage errors that name this script
    bench = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    add_bench_args(bench)
    args, rest = bench.parse_known_args(argv)
    return args, load_config(rest)


def _add_args(parser: argparse._ActionsContainer) -> None:
    parser.add_argument("--steps", type=int, default=10, help="training steps per timed run")
    parser.add_argument(
        "--warmup",
        type=int,
        default=3,
        help="untimed steps per level before timing (at least 1; peak memory is taken here)",
    )
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per level (medians)")
    parser.add_argument(
        "--compare-precision",
        action="store_true",
        help="time O0, O1 (--amp-dtype) and O3 side by side, with ratios to O0",
    )
    parser.add_argument(
        "--compare-memory-format",
        action="store_true",
        help="time --memory-format contiguous and channels_last side by side",
    )


# ----------------------------------------------------------------------------- measurement
@dataclass(frozen=True)
class LevelSpec:
    """One row of the table: a label and the precision settings that replace the config's."""

    label: str
    opt_level: str
    amp_dtype: str | None = None  # None: the config's --amp-dtype
    memory_format: str | None = None  # None: the config's --memory-format


@dataclass
class LevelResult:
    label: str
    description: str = ""
    seconds: list[float] = field(default_factory=list)  # one per timed run of `steps` steps
    losses: list[float] = field(default_factory=list)  # mean loss of each timed run
    peak_mib: float | None = None
    warmup_loss: float = math.nan
    error: str | None = None  # an exception: the level has no (or no further) timed runs

    @property
    def finite(self) -> bool:
        return all(math.isfinite(x) for x in (self.warmup_loss, *self.losses))

    def samples_per_s(self, steps: int, batch_size: int) -> float:
        return statistics.median(steps * batch_size / s for s in self.seconds)

    def spread(self, steps: int, batch_size: int) -> tuple[float, float]:
        rates = [steps * batch_size / s for s in self.seconds]
        return min(rates), max(rates)

    def ms_per_step(self, steps: int) -> float:
        return 1000 * statistics.median(self.seconds) / steps


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak_memory(device: torch.device) -> int:
    """Start a peak-memory window; returns the bytes allocated now (CUDA) or 0."""
    if device.type == "cuda":
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    with contextlib.suppress(OSError):  # Linux >= 4.0: "5" resets the peak RSS, ru_maxrss
        Path("/proc/self/clear_refs").write_text("5")
    return 0


def peak_memory_mib(device: torch.device, start: int) -> float:
    if device.type == "cuda":
        sync(device)
        return (torch.cuda.max_memory_allocated(device) - start) / 2**20
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss / 2**20 if sys.platform == "darwin" else maxrss / 2**10  # bytes vs KiB


def memory_label(device: torch.device) -> str:
    if device.type == "cuda":
        return "peak MiB: torch.cuda.max_memory_allocated during warm-up, this level's tensors"
    return "peak MiB: process peak RSS (ru_maxrss), reset per level where /proc allows"


def synthetic_batch(
    cfg: Config, device: torch.device, offset: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random images (plus ``offset``) and a ~30% foreground mask of ``batch x 1 x patch``."""
    generator = torch.Generator().manual_seed(cfg.seed)
    shape = (cfg.batch_size, 1, *cfg.patch_size)
    images = torch.randn(shape, generator=generator) + offset
    labels = (torch.rand(shape, generator=generator) < 0.3).float()
    return images.to(device), labels.to(device)


@dataclass
class _Level:
    result: LevelResult
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    precision: Precision


def build_level(
    cfg: Config, env: DistEnv
) -> tuple[torch.nn.Module, torch.optim.Optimizer, Precision]:
    """The trainer's model, Adam and precision for ``cfg``, through ``prepare()`` for ``env``."""
    precision = build_precision(cfg, env.device)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg, env.device)  # in cfg's --memory-format
    optimizer = torch.optim.Adam(
        model.parameters(), lr=scaled_lr(cfg, env.world_size), weight_decay=cfg.weight_decay
    )
    model, optimizer = prepare(model, optimizer, precision, env)
    return model, optimizer, precision


def run_steps(level: _Level, batch, steps: int, loss_fn, env: DistEnv) -> float:
    """``steps`` steps of ``app.train.train_one_epoch``; returns its mean loss."""
    loss, _ = train_one_epoch(
        level.model,
        [batch] * steps,
        level.optimizer,
        level.precision,
        loss_fn,
        NullTracker(),
        env,
        1,
        1,
    )
    return loss


def measure(
    cfg: Config,
    device: torch.device,
    specs: Sequence[LevelSpec],
    steps: int,
    warmup: int,
    repeats: int,
) -> list[LevelResult]:
    """Build every level, warm it up (peak memory), then time them interleaved.

    A level that fails to build or to step gets ``error`` set and is left out of later runs;
    the others go on. A level whose loss is not finite keeps being timed (``finite`` is False).
    """
    env = DistEnv(0, 0, 1, device)
    loss_fn = BCEDiceLoss(cfg.bce_weight, cfg.dice_weight)
    batch = synthetic_batch(cfg, device)
    levels: list[_Level] = []
    results = []
    for spec in specs:
        result = LevelResult(spec.label)
        results.append(result)
        level_cfg = dataclasses.replace(
            cfg,
            opt_level=spec.opt_level,
            amp_dtype=spec.amp_dtype or cfg.amp_dtype,
            memory_format=spec.memory_format or cfg.memory_format,
        )
        try:
            start = reset_peak_memory(device)
            model, optimizer, precision = build_level(level_cfg, env)
            result.description = precision.describe()
            level = _Level(result, model, optimizer, precision)
            result.warmup_loss = run_steps(level, batch, max(warmup, 1), loss_fn, env)
            result.peak_mib = peak_memory_mib(device, start)
            levels.append(level)
        except (ConfigError, RuntimeError) as exc:
            result.error = f"{type(exc).__name__}: {exc}"
    for _ in range(repeats):
        for level in levels:
            if level.result.error:
                continue
            try:
                sync(device)
                started = time.perf_counter()
                loss = run_steps(level, batch, steps, loss_fn, env)  # ends with a host sync
                sync(device)
                level.result.seconds.append(time.perf_counter() - started)
                level.result.losses.append(loss)  # a non-finite loss is reported, still timed
            except RuntimeError as exc:
                level.result.error = f"{type(exc).__name__}: {exc}"
    return results


# ----------------------------------------------------------------------------- report
def versions_line(device: torch.device) -> str:
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    where = (
        f"{torch.cuda.get_device_name(device)}"
        if device.type == "cuda"
        else f"cpu, {torch.get_num_threads()} threads"
    )
    return (
        f"torch {torch.__version__} (CUDA {torch.version.cuda or '-'}, cuDNN {cudnn or '-'}) "
        f"on {where}"
    )


def format_table(
    results: Sequence[LevelResult], cfg: Config, steps: int, baseline: str | None = "O0"
) -> list[str]:
    voxels = math.prod(cfg.patch_size)
    rates = {
        r.label: r.samples_per_s(steps, cfg.batch_size)
        for r in results
        if r.seconds and not r.error
    }
    base = rates.get(baseline) if baseline else None
    head = (
        f"{'level':<8} {'samples/s':>10} {'(min..max)':>20} {'voxels/s':>10} {'ms/step':>9} "
        f"{'peak MiB':>9} {'vs ' + (baseline or '-'):>7} {'loss':>7}  precision"
    )
    lines = [head]
    for r in results:
        if r.label not in rates:
            lines.append(f"{r.label:<8} error: {r.error or 'no timed run'}")
            continue
        low, high = r.spread(steps, cfg.batch_size)
        ratio = f"{rates[r.label] / base:.2f}x" if base else "-"
        peak = f"{r.peak_mib:.0f}" if r.peak_mib is not None else "-"
        lines.append(
            f"{r.label:<8} {rates[r.label]:>10.3g} {f'({low:.3g}..{high:.3g})':>20} "
            f"{rates[r.label] * voxels:>10.3g} {r.ms_per_step(steps):>9.1f} {peak:>9} "
            f"{ratio:>7} {r.losses[-1]:>7.4f}  {r.description}"
        )
    for r in results:
        if r.label in rates and not r.finite:
            lines.append(
                f"warning: {r.label}: the loss is not finite (warm-up {r.warmup_loss:.4g}, last "
                f"{r.losses[-1]:.4g}); its rate is still a speed figure, not a usable training"
            )
    return lines


def level_specs(cfg: Config, compare: bool, compare_memory: bool = False) -> list[LevelSpec]:
    if compare and compare_memory:
        raise ConfigError("choose one of --compare-precision and --compare-memory-format")
    if compare_memory:
        return [
            LevelSpec("contig", cfg.opt_level, memory_format="contiguous"),
            LevelSpec("chlast", cfg.opt_level, memory_format="channels_last"),
        ]
    if not compare:
        return [LevelSpec(cfg.opt_level, cfg.opt_level)]
    if cfg.amp_backend != "native":
        raise ConfigError(
            "--compare-precision needs --amp-backend native: apex patches torch functions for "
            "the whole process, so time one apex --opt-level per run"
        )
    return [LevelSpec("O0", "O0"), LevelSpec("O1", "O1"), LevelSpec("O3", "O3")]


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args, cfg = parse_args(argv, "bench/train_step.py", __doc__.split("\n\n")[0], _add_args)
        if args.steps < 1 or args.repeats < 1 or args.warmup < 0:
            raise ConfigError("--steps and --repeats must be at least 1, --warmup 0 or more")
        device = resolve_device(cfg.device, 0)
        specs = level_specs(cfg, args.compare_precision, args.compare_memory_format)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        params = sum(p.numel() for p in UNet3d(1, 1, cfg.f_maps, cfg.depth).parameters())
        print(f"train_step: {versions_line(device)}")
        print(
            f"UNet3d(f_maps={cfg.f_maps}, depth={cfg.depth}) {params / 1e6:.2f}M params, Adam, "
            f"BCEDiceLoss; batch {cfg.batch_size} x {'x'.join(map(str, cfg.patch_size))} "
            f"({math.prod(cfg.patch_size):,} voxels/sample); {args.steps} steps per run, "
            f"{args.warmup} warm-up, {args.repeats} runs per level"
            f"{' interleaved' if len(specs) > 1 else ''}; --memory-format {cfg.memory_format} "
            f"({resolve_memory_format(cfg.memory_format, device)} here)"
        )
        print(memory_label(device))
        results = measure(cfg, device, specs, args.steps, args.warmup, args.repeats)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    baseline = specs[0].label if len(specs) > 1 else None
    for line in format_table(results, cfg, args.steps, baseline):
        print(line)
    return 1 if any(r.error for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
