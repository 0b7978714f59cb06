"""Training-step rate of the real trainer step on synthetic tensors: samples/s and voxels/s.

    python bench/train_step.py --config configs/demo.yaml --compare-auto   # what auto weighs here
    python bench/train_step.py --config configs/demo.yaml --compare-auto --include-excluded
    python bench/train_step.py --config configs/demo.yaml --compare-precision
    python bench/train_step.py --device cuda --compare-auto --steps 20 --repeats 5
    python bench/train_step.py --device cuda --opt-level O1 --compare-memory-format

Every trainer flag is accepted (``--config YAML``, ``--patch-size``, ``--batch-size``,
``--f-maps``, ``--depth``, ``--opt-level``, ``--amp-dtype``, ``--amp-backend``, ``--device``,
``--lr``, ...) and means what it means to ``python -m app.train``; the benchmark adds
``--steps``, ``--warmup``, ``--repeats`` and the comparisons below. The header names the device
and its features (CPU model, kernel level, native bf16/fp16, AMX, threads): a figure holds on
that hardware only.

What runs is the trainer's own step, ``app.engine.steps.SyntheticStepper``: ``UNet3d``,
``BCEDiceLoss``, fused Adam, ``build_precision`` and ``prepare()`` (world size 1), and
``app.engine.steps.train_one_epoch`` over ``--steps`` copies of one random batch already on the
device (autocast forward, ``zero_grad``, ``precision.backward``, ``precision.step`` with its
non-finite guard). No data loading is timed (see ``bench/data_pipeline.py`` for that).

``--compare-auto`` lists every candidate that ``--opt-level/--amp-dtype/--memory-format auto``
considers on this machine (``app.precision.auto``) and what its capability rules left out, runs
auto's own probe (not cached) and marks its pick, then times every candidate longer, interleaved
(repeat 1 of every level, then repeat 2, ...) so every level sees the same machine load; the
table gives medians over ``--repeats`` and the ratio to the first row. ``--include-excluded``
adds what the rules left out (one timed run each: emulated bf16 is slow).
``--compare-precision`` does the same for O0, O1 and O3 (``--amp-dtype``, or what ``auto`` meant
before it was measured: bf16 on CPU, fp16 on CUDA); ``--compare-memory-format`` for contiguous
vs channels_last_3d at the config's opt level. Fields still ``auto`` in those two are resolved by
the capability rules.

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
from app.distributed import DistEnv, resolve_device  # noqa: E402
from app.engine.steps import SyntheticStepper  # noqa: E402
from app.model import UNet3d  # noqa: E402
from app.precision import auto as autotune  # noqa: E402
from app.precision.amp import Precision  # noqa: E402
from app.precision.hardware import detect, machine_line  # noqa: E402


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
    cfg = load_config(rest)
    if cfg.plan == "auto":  # the trainer plans at start; a benchmark would time the defaults
        raise ConfigError(
            "--plan auto: the benchmark times the model its flags describe and plans nothing; "
            "write the plan with `python -m app.plan --data-root DIR --budget-s S --out "
            "plan.yaml` and pass --config plan.yaml"
        )
    return args, cfg


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
    parser.add_argument(
        "--compare-auto",
        action="store_true",
        help="every candidate that the config's auto settings consider on this machine, side by "
        "side, marking the one that auto's own probe picks (uncached)",
    )
    parser.add_argument(
        "--include-excluded",
        action="store_true",
        help="with --compare-auto, also time the settings the capability rules left out "
        "(emulated bf16 can be 60x slower: one timed run each)",
    )


# ----------------------------------------------------------------------------- measurement
@dataclass(frozen=True)
class LevelSpec:
    """One row of the table: a label and the precision settings that replace the config's."""

    label: str
    opt_level: str
    amp_dtype: str | None = None  # None: the config's --amp-dtype
    memory_format: str | None = None  # None: the config's --memory-format
    repeats: int | None = None  # None: --repeats (a very slow level may be timed once)
    note: str = ""  # shown after the row (why auto left it out, or that auto picked it)


@dataclass
class LevelResult:
    label: str
    max_repeats: int = 1
    description: str = ""
    note: str = ""
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


def build_level(
    cfg: Config, env: DistEnv
) -> tuple[torch.nn.Module, torch.optim.Optimizer, Precision]:
    """The trainer's model, Adam and precision for ``cfg``, through ``prepare()`` for ``env``
    (for checks that drive the step themselves; timing uses ``SyntheticStepper`` directly)."""
    torch.manual_seed(cfg.seed)
    stepper = SyntheticStepper(cfg, env)
    return stepper.model, stepper.optimizer, stepper.precision


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
    levels: list[tuple[LevelResult, SyntheticStepper]] = []
    results = []
    for spec in specs:
        result = LevelResult(spec.label, max_repeats=spec.repeats or repeats, note=spec.note)
        results.append(result)
        level_cfg = dataclasses.replace(
            cfg,
            opt_level=spec.opt_level,
            amp_dtype=spec.amp_dtype or cfg.amp_dtype,
            memory_format=spec.memory_format or cfg.memory_format,
        )
        try:
            start = reset_peak_memory(device)
            torch.manual_seed(cfg.seed)
            stepper = SyntheticStepper(level_cfg, env)
            result.description = stepper.precision.describe()
            result.warmup_loss = stepper.run(max(warmup, 1)).loss
            result.peak_mib = peak_memory_mib(device, start)
            levels.append((result, stepper))
        except (ConfigError, RuntimeError) as exc:
            result.error = f"{type(exc).__name__}: {exc}"
    for repeat in range(repeats):
        for result, stepper in levels:
            if result.error or repeat >= result.max_repeats:
                continue
            try:
                sync(device)
                started = time.perf_counter()
                totals = stepper.run(steps)  # ends with a host sync
                sync(device)
                result.seconds.append(time.perf_counter() - started)
                # a skipped (non-finite) step is reported through the loss, and still timed
                result.losses.append(totals.loss if not totals.skipped else math.nan)
            except RuntimeError as exc:
                result.error = f"{type(exc).__name__}: {exc}"
    return results


# ----------------------------------------------------------------------------- report
def versions_line(device: torch.device) -> str:
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return (
        f"torch {torch.__version__} (CUDA {torch.version.cuda or '-'}, cuDNN {cudnn or '-'}) "
        f"on {machine_line(device)}"
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
    width = max([8, *(len(r.label) for r in results)])
    head = (
        f"{'level':<{width}} {'samples/s':>10} {'(min..max)':>20} {'voxels/s':>10} "
        f"{'ms/step':>9} {'peak MiB':>9} {'vs base':>7} {'loss':>7}  precision"
    )
    lines = [head]
    for r in results:
        if r.label not in rates:
            lines.append(f"{r.label:<{width}} error: {r.error or 'no timed run'}  {r.note}")
            continue
        low, high = r.spread(steps, cfg.batch_size)
        ratio = f"{rates[r.label] / base:.2f}x" if base else "-"
        peak = f"{r.peak_mib:.0f}" if r.peak_mib is not None else "-"
        lines.append(
            f"{r.label:<{width}} {rates[r.label]:>10.3g} {f'({low:.3g}..{high:.3g})':>20} "
            f"{rates[r.label] * voxels:>10.3g} {r.ms_per_step(steps):>9.1f} {peak:>9} "
            f"{ratio:>7} {r.losses[-1]:>7.4f}  {r.description}{'  ' + r.note if r.note else ''}"
        )
    if base:
        lines.append(f"vs base: samples/s relative to '{baseline}'")
    for r in results:
        if r.label in rates and not r.finite:
            lines.append(
                f"warning: {r.label}: the loss is not finite (warm-up {r.warmup_loss:.4g}, last "
                f"{r.losses[-1]:.4g}); its rate is still a speed figure, not a usable training"
            )
    return lines


def rules_resolved(cfg: Config, device: torch.device) -> Config:
    """``cfg`` with its ``auto`` fields resolved by the capability rules (no probe): what a
    single level or a fixed comparison runs."""
    caps = detect(device)
    cands, _ = autotune.candidates(cfg, caps)
    choice, _ = autotune.rule_choice(cands, caps)
    return choice.apply(cfg)


def auto_specs(cfg: Config, device: torch.device, include_excluded: bool) -> list[LevelSpec]:
    """Every candidate of ``auto`` on this machine, the pick of auto's own probe marked; with
    ``include_excluded``, also what the rules left out, timed once."""
    caps = detect(device)
    cands, notes = autotune.candidates(cfg, caps)
    picked = None
    if len(cands) > 1:
        env = DistEnv(0, 0, 1, device)
        timings = autotune.probe(cfg, env, cands)
        chosen = autotune.pick(cands, timings)
        picked = chosen[0] if chosen else None
        print(f"auto probe: {chosen[1] if chosen else 'nothing could be timed'}")
    else:
        picked = cands[0]
    for note in notes:
        print(f"auto left out: {note}")
    specs = [
        LevelSpec(
            c.label,
            c.opt_level,
            None if c.amp_dtype == "float32" else c.amp_dtype,
            c.memory_format,
            note="<- auto picks" if c == picked else "",
        )
        for c in cands
    ]
    if include_excluded and cfg.amp_backend == "native":
        formats = {c.memory_format for c in cands}
        for dtype in ("bfloat16", "float16"):
            for fmt in sorted(formats):
                extra = autotune.Candidate("O1", dtype, fmt)
                if extra not in cands:
                    specs.append(
                        LevelSpec(extra.label, "O1", dtype, fmt, repeats=1, note="(left out)")
                    )
    return specs


def level_specs(
    cfg: Config, device: torch.device, mode: str, include_excluded: bool = False
) -> list[LevelSpec]:
    if mode == "auto":
        return auto_specs(cfg, device, include_excluded)
    if mode == "memory":
        return [
            LevelSpec("contig", cfg.opt_level, memory_format="contiguous"),
            LevelSpec("chlast", cfg.opt_level, memory_format="channels_last"),
        ]
    if mode == "one":
        return [LevelSpec(cfg.opt_level, cfg.opt_level)]
    if cfg.amp_backend != "native":
        raise ConfigError(
            "--compare-precision needs --amp-backend native: apex patches torch functions for "
            "the whole process, so time one apex --opt-level per run"
        )
    return [LevelSpec("O0", "O0"), LevelSpec("O1", "O1"), LevelSpec("O3", "O3")]


def comparison_mode(args: argparse.Namespace) -> str:
    chosen = [
        name
        for name, on in (
            ("precision", args.compare_precision),
            ("memory", args.compare_memory_format),
            ("auto", args.compare_auto),
        )
        if on
    ]
    if len(chosen) > 1:
        raise ConfigError(
            "choose one of --compare-precision, --compare-memory-format and --compare-auto"
        )
    if args.include_excluded and chosen != ["auto"]:
        raise ConfigError("--include-excluded goes with --compare-auto")
    return chosen[0] if chosen else "one"


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args, cfg = parse_args(argv, "bench/train_step.py", __doc__.split("\n\n")[0], _add_args)
        if args.steps < 1 or args.repeats < 1 or args.warmup < 0:
            raise ConfigError("--steps and --repeats must be at least 1, --warmup 0 or more")
        mode = comparison_mode(args)
        device = resolve_device(cfg.device, 0)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        params = sum(p.numel() for p in UNet3d(1, 1, cfg.f_maps, cfg.depth).parameters())
        print(f"train_step: {versions_line(device)}")
        print(
            f"UNet3d(f_maps={cfg.f_maps}, depth={cfg.depth}) {params / 1e6:.2f}M params, Adam, "
            f"BCEDiceLoss; batch {cfg.batch_size} x {'x'.join(map(str, cfg.patch_size))} "
            f"({math.prod(cfg.patch_size):,} voxels/sample); {args.steps} steps per run, "
            f"{args.warmup} warm-up, {args.repeats} runs per level"
        )
        if mode != "auto":  # fixed levels: what is still auto, the rules resolve
            cfg = rules_resolved(cfg, device)
            print(
                f"auto rules (no probe): --opt-level {cfg.opt_level} --amp-dtype "
                f"{cfg.amp_dtype} --memory-format {cfg.memory_format}"
            )
        specs = level_specs(cfg, device, mode, args.include_excluded)
        print(memory_label(device) + (", interleaved" if len(specs) > 1 else ""))
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
