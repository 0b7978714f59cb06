"""``--compile auto|on|off``: ``torch.compile`` of the model the training step runs, when it pays.

What is compiled is the prepared model (DDP-wrapped when distributed, so that dynamo's
DDPOptimizer splits the graph at DDP's gradient buckets), for the training batch size only
(:class:`CompiledModel`): an epoch's shorter last batch runs eager instead of compiling a
second graph. Validation, the weight average, checkpoints and ``app.analysis.predict`` use the
uncompiled module, so checkpoint keys are unchanged and a compiled run's checkpoint loads in an
uncompiled one and back.

``auto`` decides on the machine that trains, for this run's length:

1. off with apex (it patches the functions dynamo would trace), or without a C++ compiler or
   Python's headers (inductor builds its CPU kernels with them, Triton its GPU launchers);
2. off without measuring when even the best speed-up seen so far (``PRIOR_SPEEDUP``, 1.26x on
   a Zen 4 CPU) could not repay a typical compile (``PRIOR_COMPILE_S``) in this run's steps:
   ``make demo`` never pays for a compile;
3. otherwise measured once per machine, precision and model shape (cached like the precision
   decision, ``app.cache``): the training step eager and compiled, interleaved, and the compile
   time; on when the steps left save more than ``MARGIN`` times the compile time.

Compiling is not always faster: on the Zen 4 CPU of bench/README.md the BatchNorm demo model
ran 0.87x as fast compiled (inductor's channels_last BatchNorm is slower than oneDNN's), which
is why ``auto`` measures rather than assumes.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import sysconfig
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from app import cache
from app.config import Config, ConfigError
from app.distributed import DistEnv, broadcast_object
from app.engine.steps import SyntheticStepper
from app.precision.auto import Candidate, cache_facts
from app.precision.hardware import detect

PRIOR_SPEEDUP = 1.3  # the best seen: 1.26x (the bf16 demo step on Zen 4; 1.15-1.22x here)
PRIOR_COMPILE_S = 30.0  # 18-36 s measured on 2 CPU cores; GPUs compile in a similar time
MARGIN = 1.5  # compile only when the saving is clearly larger than the compile
TARGET_S = 0.5  # timed steps per variant and round: about this long
MAX_STEPS = 8
COMPILE_CACHE_VERSION = 1
COMPILERS = ("CXX", "CC")  # environment variables naming a compiler, before the usual names


@dataclass(frozen=True)
class CompileDecision:
    use: bool
    source: str  # set | rules | prior | measured | cached
    reason: str
    figures: dict[str, float] = dataclasses.field(default_factory=dict)

    def log_line(self) -> str:
        return f"compile {'on' if self.use else 'off'} ({self.reason})"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def missing_compiler() -> str:
    """Why torch.compile cannot build kernels here, or ""."""
    names = [os.environ.get(var, "") for var in COMPILERS] + ["c++", "g++", "clang++", "cc"]
    if not any(name and shutil.which(name) for name in names):
        return "no C++ compiler on PATH (inductor builds its kernels with one; set CXX)"
    headers = Path(sysconfig.get_paths()["include"]) / "Python.h"
    if not headers.is_file():
        return f"no {headers} (inductor's kernels include it: install python3-dev)"
    return ""


def cannot_compile(cfg: Config) -> str:
    """Why ``auto`` must not compile this run, or "" (checked before anything is measured)."""
    return "apex owns the model's functions" if cfg.amp_backend != "native" else missing_compiler()


def prior_too_short(steps_left: int, step_s: float) -> str:
    """Why the run cannot repay a compile even at ``PRIOR_SPEEDUP``, or ""."""
    best_saving = steps_left * step_s * (1.0 - 1.0 / PRIOR_SPEEDUP)
    if best_saving >= MARGIN * PRIOR_COMPILE_S:
        return ""
    return (
        f"too short to repay it: {steps_left} steps of {step_s * 1000:.0f} ms would save at "
        f"most {best_saving:.0f} s at {PRIOR_SPEEDUP}x, against about {PRIOR_COMPILE_S:.0f} s "
        "of compiling"
    )


def verdict(steps_left: int, figures: dict[str, float]) -> tuple[bool, str]:
    """On or off for measured ``figures`` (``eager_s``, ``compiled_s``, ``compile_s``)."""
    eager, compiled, compile_s = figures["eager_s"], figures["compiled_s"], figures["compile_s"]
    saving = steps_left * (eager - compiled)
    use = saving > MARGIN * compile_s
    return use, (
        f"measured per step: eager {eager * 1000:.0f} ms, compiled {compiled * 1000:.0f} ms "
        f"({eager / compiled:.2f}x), compiling {compile_s:.0f} s; {steps_left} steps "
        f"{'save' if saving >= 0 else 'lose'} {abs(saving):.0f} s"
        + (" -> on" if use else f", not {MARGIN:g}x the compile -> off")
    )


def step_seconds(run_steps: Callable[[int], Any], steps: int) -> float:
    started = time.perf_counter()
    run_steps(steps)
    return (time.perf_counter() - started) / steps


def measure(cfg: Config, env: DistEnv) -> dict[str, float]:
    """The training step eager and compiled at world size 1 (every rank measures at once, sharing
    the machine as in training), interleaved, and the compile time of the first compiled step."""
    local = DistEnv(rank=0, local_rank=env.local_rank, world_size=1, device=env.device)
    with torch.random.fork_rng(devices=[env.device] if env.device.type == "cuda" else []):
        torch.manual_seed(cfg.seed)
        eager = SyntheticStepper(cfg, local)
        compiled = SyntheticStepper(cfg, local, compile=True)
        eager_s = step_seconds(eager.run, 1)
        first_s = step_seconds(compiled.run, 1)  # traces and compiles
        steps = max(1, min(MAX_STEPS, round(TARGET_S / max(eager_s, 1e-6))))
        times: dict[str, list[float]] = {"eager_s": [], "compiled_s": []}
        for _ in range(2):
            times["eager_s"].append(step_seconds(eager.run, steps))
            times["compiled_s"].append(step_seconds(compiled.run, steps))
    figures = {name: min(seconds) for name, seconds in times.items()}
    figures["compile_s"] = max(0.0, first_s - figures["compiled_s"])
    return figures


def eager_step_s(cfg: Config, env: DistEnv) -> float:
    """A few eager training steps, when the precision probe did not time one."""
    local = DistEnv(rank=0, local_rank=env.local_rank, world_size=1, device=env.device)
    with torch.random.fork_rng(devices=[env.device] if env.device.type == "cuda" else []):
        stepper = SyntheticStepper(cfg, local)
        stepper.run(1)
        return step_seconds(stepper.run, 3)


def compile_facts(cfg: Config, device: torch.device) -> dict[str, Any]:
    dtype = "float32" if cfg.opt_level == "O0" else cfg.amp_dtype
    precision = Candidate(cfg.opt_level, dtype, cfg.memory_format)
    return {
        **cache_facts(cfg, detect(device), [precision]),
        "compile_version": COMPILE_CACHE_VERSION,
        "pool_kernels": list(cfg.pool_kernels or []),
    }


def decide_on_primary(cfg: Config, env: DistEnv, steps_left: int, step_s: float) -> dict:
    """Rank 0: a decision from the setting, the rules, the prior or the cache; or what every
    rank must measure."""
    if cfg.compile != "auto":
        return {"decision": CompileDecision(cfg.compile == "on", "set", "as set").to_dict()}
    why_not = cannot_compile(cfg)
    if why_not:
        return {"decision": CompileDecision(False, "rules", why_not).to_dict()}
    short = prior_too_short(steps_left, step_s)
    if short:
        return {"decision": CompileDecision(False, "prior", short).to_dict()}
    facts = compile_facts(cfg, env.device)
    path = cache.cache_file("compile", facts)
    figures = cache.load(path, facts, "figures")
    if figures is not None:
        use, why = verdict(steps_left, figures)
        return {
            "decision": CompileDecision(
                use, "cached", f"{why}; cached in {path}", figures
            ).to_dict()
        }
    return {"decision": None, "facts": facts, "path": str(path)}


def decide(cfg: Config, env: DistEnv, steps_left: int, step_s: float | None) -> CompileDecision:
    """Whether this run compiles; call on every rank (collectives inside). ``step_s``: the
    precision probe's step, when it timed one."""
    if cfg.compile == "on":
        problem = missing_compiler()
        if problem:
            raise ConfigError(f"--compile on: {problem}; or use --compile off")
    if cfg.compile == "auto" and step_s is None and not cannot_compile(cfg):
        step_s = broadcast_object(eager_step_s(cfg, env))
    plan = broadcast_object(
        decide_on_primary(cfg, env, steps_left, step_s or 0.0) if env.is_primary else None
    )
    if plan["decision"] is not None:
        return CompileDecision(**plan["decision"])
    figures = measure(cfg, env)
    decision = None
    if env.is_primary:
        cache.store(Path(plan["path"]), plan["facts"], "figures", figures)
        use, why = verdict(steps_left, figures)
        decision = CompileDecision(use, "measured", why, figures).to_dict()
    return CompileDecision(**broadcast_object(decision))
