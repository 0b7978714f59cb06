"""``auto`` precision and memory format, decided on the machine that trains.

    python -m app.autotune --config configs/demo.yaml    # what auto resolves to here, and why

``--opt-level``, ``--amp-dtype`` and ``--memory-format`` default to ``auto``. They are resolved
once, before anything is built:

1. **Capability rules** (``app.precision.hardware``) say which candidates are safe: a device never
   gets a half dtype by default that it cannot compute natively (CPU bf16 autocast without
   AVX512-BF16 or AMX is emulated, measured 62x slower than fp32 on an AVX2 EPYC), nor one that a
   known library bug computes wrongly. Settings the user gave are kept as given.
2. **A one-convolution screen** on CPU: each precision times one small 3x3x3 convolution and
   its norm, forward and backward (milliseconds). A precision more than ``TOO_SLOW`` times
   slower than the fastest is left out before anything costly runs: oneDNN's fp16 on CPUs with
   AVX512-FP16 but no AMX-FP16 falls back to reference kernels (measured 180x slower than fp32
   on a Sapphire Rapids class Xeon), and a full training step there takes tens of seconds.
3. **A kernel check** for every mixed-precision candidate (``app.precision.kernel_check``): one
   training pass at the configured model, patch and batch size, with each convolution's output and
   weight gradient recomputed in float32 from the same inputs. A candidate whose kernels are wrong
   at this shape is left out, with the layer named (oneDNN's bf16 weight gradient on Zen 4 is
   garbage for inputs 2 voxels deep).
4. **A measured probe**, when more than one candidate is left: every candidate runs the real
   training step (``app.engine.steps.SyntheticStepper``: forward, backward and optimizer step at the
   configured model, patch and batch size) for a few seconds in all, interleaved, and the fastest
   wins; within 5% of it, the higher precision wins (fp32 over bf16 over fp16).
5. **A cache** per device, torch version, thread count, processes per node and model shape, in
   ``$IRONGRAIN_CACHE_DIR`` (else ``$XDG_CACHE_HOME/irongrain``, else ``~/.cache/irongrain``; one
   JSON file per decision; deleting the folder re-measures), so a later run starts at once.
   ``--no-auto-probe`` decides from the rules alone.

Rank 0 decides and broadcasts, so every rank runs the same precision; the ranks probe at the same
time, each on its own device (or sharing the CPU, as they will when training). A resumed run keeps
its checkpoint's precision and memory format. The decision is logged in one line with its reason
and recorded under ``resolved:`` in the run's ``config.yaml`` and in the checkpoint.

Size (over 500 lines): the five stages of one decision above and the command that shows it; the
stages share the candidate, decision and cache types, and each is short.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from app import cache
from app.config import Config, ConfigError
from app.distributed import DistEnv, broadcast_object
from app.precision.hardware import Capabilities, detect
from app.precision.kernel_check import check_convolutions

log = logging.getLogger(__name__)

AUTO_FIELDS = ("opt_level", "amp_dtype", "memory_format")
SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
PREFERENCE = ("float32", "bfloat16", "float16")  # among near-ties, the first wins
TIE = 0.05  # candidates within 5% of the fastest count as equally fast
TOO_SLOW = 10.0  # a candidate this much slower than the fastest in warm-up is not timed further
PROBE_TARGET_S = 0.25  # timed steps per candidate and round: about this long
PROBE_BUDGET_S = 10.0  # two timed rounds when they fit in this, else one
MAX_PROBE_STEPS = 8
SCREEN_INPUT = (2, 16, 8, 24, 24)  # batch, channels, D, H, W: a few ms at fp32 on one core
CACHE_VERSION = 2  # 2: decisions include the kernel check
EMULATED_BF16 = "emulated, measured up to 62x slower than fp32"
# cuDNN 9.10-9.14 returns wrong results for some bf16 3D convolutions (pytorch#163539; 9.15 fixes)
CUDNN_BF16_CONV3D_BUG = range(91000, 91500)


@dataclass(frozen=True)
class Candidate:
    """One setting of the three fields; ``amp_dtype`` is ``float32`` for O0."""

    opt_level: str
    amp_dtype: str
    memory_format: str

    @property
    def precision(self) -> str:
        if self.opt_level == "O0":
            return "fp32"
        half = SHORT.get(self.amp_dtype, self.amp_dtype)
        return f"{half} autocast" if self.opt_level == "O1" else f"{half} {self.opt_level}"

    @property
    def label(self) -> str:
        return f"{self.precision}, {self.memory_format}"

    def apply(self, cfg: Config) -> Config:
        """``cfg`` with these values (an O0 run keeps its ``amp_dtype``, which it never uses)."""
        dtype = cfg.amp_dtype if self.amp_dtype == "float32" else self.amp_dtype
        return dataclasses.replace(
            cfg, opt_level=self.opt_level, amp_dtype=dtype, memory_format=self.memory_format
        )


@dataclass(frozen=True)
class Decision:
    """What ``auto`` resolved to, where that came from, and why."""

    choice: Candidate
    source: str  # fixed | rules | probe | cache | checkpoint
    reason: str
    settings: dict[str, str]  # the three fields as given (``auto`` or a value)
    timings: dict[str, dict[str, Any]] = field(default_factory=dict)  # label -> ms / note

    def apply(self, cfg: Config) -> Config:
        return self.choice.apply(cfg)

    @property
    def step_s(self) -> float | None:
        """The probe's (or the cache's) step time of the chosen candidate, when it timed one."""
        ms = self.timings.get(self.choice.label, {}).get("ms")
        return ms / 1000.0 if ms else None

    def log_line(self) -> str:
        asked = [k for k in AUTO_FIELDS if self.settings.get(k) == "auto"]
        if self.source == "fixed":
            return f"precision {self.choice.label}, as set"
        return f"{'/'.join(asked)} auto -> {self.choice.label} ({self.reason})"

    def to_dict(self) -> dict[str, Any]:
        return {
            **dataclasses.asdict(self.choice),
            "label": self.choice.label,
            "source": self.source,
            "reason": self.reason,
            "settings": dict(self.settings),
            "timings": self.timings,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Decision:
        choice = Candidate(data["opt_level"], data["amp_dtype"], data["memory_format"])
        return cls(choice, data["source"], data["reason"], data["settings"], data["timings"])


def settings_of(cfg: Config) -> dict[str, str]:
    return {k: getattr(cfg, k) for k in AUTO_FIELDS}


def needs_deciding(cfg: Config) -> bool:
    """True when a field is ``auto`` and matters (an O0 run has no dtype to choose)."""
    dtype_matters = cfg.opt_level != "O0" and cfg.amp_backend == "native"
    return (
        cfg.opt_level == "auto"
        or cfg.memory_format == "auto"
        or (cfg.amp_dtype == "auto" and dtype_matters)
    )


# ----------------------------------------------------------------------------- 1. rules
def native_half_dtypes(caps: Capabilities) -> tuple[list[str], list[str]]:
    """The half dtypes this device computes natively and correctly (bf16 first), and a note
    for each one left out."""
    where = "CPU" if caps.device_type == "cpu" else f"GPU ({caps.isa})"
    dtypes, notes = [], []
    if not caps.native_bf16:
        cost = f" ({EMULATED_BF16})" if caps.device_type == "cpu" else ""
        notes.append(f"this {where} has no native bf16 ({caps.isa}): bf16 autocast not tried{cost}")
    elif caps.cudnn in CUDNN_BF16_CONV3D_BUG:
        notes.append(
            f"cuDNN {caps.cudnn} computes some bf16 3D convolutions wrongly (pytorch#163539, "
            "fixed in 9.15): bf16 autocast not tried"
        )
    else:
        dtypes.append("bfloat16")
    if caps.native_fp16:  # most CPUs have none, so its absence is not worth a note
        dtypes.append("float16")
    return dtypes, notes


def candidates(cfg: Config, caps: Capabilities) -> tuple[list[Candidate], list[str]]:
    """Every safe setting of the ``auto`` fields (given fields kept as given), and notes on
    what was left out and why."""
    formats = (
        ["channels_last", "contiguous"] if cfg.memory_format == "auto" else [cfg.memory_format]
    )
    if cfg.amp_backend == "apex":
        # the legacy recipe: apex O1 in fp16, in the layout it was written for
        level = "O1" if cfg.opt_level == "auto" else cfg.opt_level
        if cfg.memory_format == "auto":
            formats = ["contiguous"]
        dtype = "float32" if level == "O0" else "float16"
        return [Candidate(level, dtype, f) for f in formats], ["apex: O1 fp16 by default"]

    native, notes = native_half_dtypes(caps)
    if cfg.amp_dtype != "auto":
        if cfg.amp_dtype not in native and cfg.opt_level != "O0":
            notes.append(f"--amp-dtype {cfg.amp_dtype} as set, though not native here")
        halves = [cfg.amp_dtype]
    else:
        halves = native
    if cfg.opt_level == "auto":
        levels = [("O0", "float32")] + [("O1", h) for h in halves]
    elif cfg.opt_level == "O0":
        levels = [("O0", "float32")]
    else:
        if not halves:  # an explicit half level with no native dtype: the legacy dtype, warned
            halves = ["float16" if caps.device_type == "cuda" else "bfloat16"]
            notes.append(
                f"--opt-level {cfg.opt_level} with no native half dtype: {halves[0]} "
                "(slow here; --opt-level O0 is faster)"
            )
        levels = [(cfg.opt_level, h) for h in halves]
    return [Candidate(lv, dt, f) for lv, dt in levels for f in formats], notes


def rule_choice(cands: list[Candidate], caps: Capabilities) -> tuple[Candidate, str]:
    """Without a probe: bf16 autocast where the CPU or GPU computes bf16 natively, else fp32 on
    CPU and fp16 on GPU; channels_last on CPU (measured faster at fp32 on AVX2 and at bf16 on
    AVX512-BF16 and AMX CPUs), contiguous on CUDA."""
    if caps.device_type == "cpu":
        native = caps.native_bf16
        precisions = [("O1", "bfloat16"), ("O0", "float32")] if native else [("O0", "float32")]
        formats = ["channels_last", "contiguous"]
        why = f"rule for CPUs {'with' if native else 'without'} native bf16"
    else:
        precisions = [("O1", "bfloat16"), ("O1", "float16")]
        formats = ["contiguous", "channels_last"]
        why = "rule for GPUs"
    ranked = [Candidate(lv, dt, f) for lv, dt in precisions for f in formats]
    for wanted in ranked:
        if wanted in cands:
            return wanted, why
    for fmt in formats:  # the precision was fixed by the user: only the format is chosen
        for cand in cands:
            if cand.memory_format == fmt:
                return cand, why
    return cands[0], why


# ----------------------------------------------------------------------------- 2. probe
def probe(
    cfg: Config,
    env: DistEnv,
    cands: list[Candidate],
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, dict[str, Any]]:
    """Time the real training step of every candidate on this rank: ``{label: {"ms": step
    milliseconds or None, "note": why it was not timed}}``.

    World size 1 (no collective: every rank probes at once, its own device busy as in training),
    inside ``fork_rng`` so that training starts from the seeds it would have without a probe.
    """
    from app.engine.steps import SyntheticStepper  # the step imports the model, data-free

    local = DistEnv(rank=0, local_rank=env.local_rank, world_size=1, device=env.device)
    warmup_steps = 2 if env.device.type == "cuda" else 1  # cuDNN benchmarks its first step
    results: dict[str, dict[str, Any]] = {}
    steppers: dict[Candidate, SyntheticStepper] = {}
    warm: dict[Candidate, float] = {}
    rng_devices = [env.device] if env.device.type == "cuda" else []
    with torch.random.fork_rng(devices=rng_devices):
        slow = screen(cfg, cands, env.device, clock)
        for cand in cands:
            if cand.precision in slow:
                results[cand.label] = {"ms": None, "note": slow[cand.precision]}
                continue
            try:
                wrong = kernel_problem(cand, cfg, env.device)
                if wrong:
                    results[cand.label] = {"ms": None, "note": wrong}
                    continue
                torch.manual_seed(cfg.seed)
                stepper = SyntheticStepper(cand.apply(cfg), local)
                started = clock()
                totals = stepper.run(warmup_steps)
                warm[cand] = (clock() - started) / warmup_steps
            except (RuntimeError, ConfigError) as exc:  # out of memory, an unsupported kernel
                results[cand.label] = {"ms": None, "note": f"failed: {first_line(exc)}"}
                continue
            if totals.skipped or not math.isfinite(totals.loss):
                results[cand.label] = {"ms": None, "note": "non-finite gradients"}
                continue
            steppers[cand] = stepper
        fastest = min(warm.values(), default=0.0)
        for cand in list(steppers):
            if warm[cand] > TOO_SLOW * fastest:
                del steppers[cand]
                ratio = warm[cand] / fastest
                results[cand.label] = {"ms": None, "note": f"{ratio:.0f}x slower in warm-up"}
        steps = max(1, min(MAX_PROBE_STEPS, round(PROBE_TARGET_S / max(fastest, 1e-9))))
        planned = 2 * steps * sum(warm[c] for c in steppers)
        rounds = 2 if planned <= PROBE_BUDGET_S else 1
        times: dict[Candidate, list[float]] = {c: [] for c in steppers}
        for _ in range(rounds):  # interleaved: every candidate sees the same machine load
            for cand, stepper in steppers.items():
                started = clock()
                totals = stepper.run(steps)
                times[cand].append((clock() - started) / steps)
                if totals.skipped or not math.isfinite(totals.loss):
                    times[cand].append(math.inf)
        for cand, seconds in times.items():
            best = min(seconds)
            results[cand.label] = (
                {"ms": best * 1000.0, "note": ""}
                if math.isfinite(best)
                else {"ms": None, "note": "non-finite gradients"}
            )
        del steppers
        if env.device.type == "cuda":
            torch.cuda.empty_cache()
    return {c.label: results[c.label] for c in cands}


def screen(
    cfg: Config,
    cands: list[Candidate],
    device: torch.device,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, str]:
    """``{precision: why it is left out}`` for each precision far slower than the fastest at
    one small convolution and norm, forward and backward (CPU only: on CUDA the first calls
    time cuDNN's own benchmarking, and no native dtype there falls back to reference code)."""
    from app.model import norm_layer

    precisions = {c.precision: c for c in cands}
    if device.type != "cpu" or cfg.amp_backend != "native" or len(precisions) < 2:
        return {}
    layer = torch.nn.Sequential(
        torch.nn.Conv3d(SCREEN_INPUT[1], SCREEN_INPUT[1], 3, padding=1),
        norm_layer(cfg.norm, SCREEN_INPUT[1]),
    )
    x = torch.randn(SCREEN_INPUT).requires_grad_()
    seconds = {}
    for name, cand in precisions.items():
        dtype = getattr(torch, cand.amp_dtype)
        runs = []
        for _ in range(2):  # the first call also creates the kernels
            started = clock()
            with torch.autocast("cpu", dtype=dtype, enabled=cand.opt_level != "O0"):
                out = layer(x)
            out.float().sum().backward()
            runs.append(clock() - started)
        seconds[name] = runs[-1]
    fastest_name = min(seconds, key=seconds.get)
    fastest = seconds[fastest_name]
    return {
        name: f"{s / fastest:.0f}x slower than {fastest_name} at one convolution"
        for name, s in seconds.items()
        if s > TOO_SLOW * fastest
    }


def kernel_problem(cand: Candidate, cfg: Config, device: torch.device) -> str:
    """Why ``cand``'s convolutions cannot be trusted at this shape, or "" (fp32 and the
    pure-half O3 level are not checked; O3 is never an ``auto`` candidate)."""
    if cand.opt_level != "O1" or cfg.amp_backend != "native":
        return ""
    error = check_convolutions(cand.apply(cfg), device)
    return "" if error.ok else f"wrong kernels: {error.describe()}"


def warn_if_wrong(cand: Candidate, cfg: Config, device: torch.device) -> None:
    """A precision the user set is kept, but not silently when its kernels are wrong here."""
    if cand.memory_format == "auto":
        return
    try:
        wrong = kernel_problem(cand, cfg, device)
    except RuntimeError as exc:  # the run itself will say it better
        log.debug("kernel check failed: %s", first_line(exc))
        return
    if wrong:
        patch = "x".join(map(str, cfg.patch_size))
        log.warning(
            "%s as set, but at patch %s, depth %d its %s: the weights it updates learn from "
            "garbage. Use --opt-level O0, or another --patch-size/--depth (oneDNN's bf16 "
            "weight gradient fails where a layer's input is 2 voxels deep)",
            cand.label,
            patch,
            cfg.depth,
            wrong,
        )


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:200]


def pick(
    cands: list[Candidate], timings: dict[str, dict[str, Any]]
) -> tuple[Candidate, str] | None:
    """The fastest candidate, or the most precise one within ``TIE`` of it; with the reason."""
    measured = [(c, timings[c.label]["ms"]) for c in cands if timings[c.label]["ms"] is not None]
    if not measured:
        return None
    fastest = min(ms for _, ms in measured)
    near = [(c, ms) for c, ms in measured if ms <= fastest * (1 + TIE)]
    choice, _ = min(near, key=lambda item: (PREFERENCE.index(item[0].amp_dtype), item[1]))
    parts = []
    for cand, entry in sorted(
        timings.items(), key=lambda kv: math.inf if kv[1]["ms"] is None else kv[1]["ms"]
    ):
        if entry["ms"] is None:
            parts.append(f"{cand} not timed ({entry['note']})")
        else:
            ratio = entry["ms"] / fastest
            slower = f" ({ratio:.2f}x)" if ratio >= 1.005 else ""
            parts.append(f"{cand} {entry['ms']:.0f} ms{slower}")
    return choice, "measured per step: " + "; ".join(parts)


# ----------------------------------------------------------------------------- 3. cache
def cache_facts(cfg: Config, caps: Capabilities, cands: list[Candidate]) -> dict[str, Any]:
    """Everything a cached decision depends on: any change measures again."""
    return {
        "version": CACHE_VERSION,
        "device": caps.fingerprint(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "threads": torch.get_num_threads() if caps.device_type == "cpu" else None,
        "processes_per_node": int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1),
        "model": {
            "f_maps": cfg.f_maps,
            "depth": cfg.depth,
            "norm": cfg.norm,  # InstanceNorm is 25x slower channels_last on CPU (torch 2.13)
            "block": cfg.block,  # other layers, other kernels: the kernel check must see them
            "activation": cfg.activation,
            "patch_size": list(cfg.patch_size),
            "batch_size": cfg.batch_size,
            "amp_backend": cfg.amp_backend,
        },
        "candidates": [c.label for c in cands],
    }


def read_cache(path: Path, facts: dict[str, Any]) -> Decision | None:
    """The cached decision, or None; a damaged or foreign file is reported and ignored."""
    cached = cache.load(path, facts, "decision")
    try:
        return Decision.from_dict(cached) if cached is not None else None
    except (KeyError, TypeError) as exc:
        log.warning("ignoring the auto cache %s (%s); measuring again", path, first_line(exc))
        return None


def write_cache(path: Path, facts: dict[str, Any], decision: Decision) -> None:
    cache.store(path, facts, "decision", decision.to_dict())


# ----------------------------------------------------------------------------- decide
def from_checkpoint(cfg: Config, state: dict[str, Any], device: torch.device) -> Decision:
    """A resumed run keeps what it trained with; fields given explicitly are kept and, when they
    differ, refused later by ``check_same_precision`` with the values to use."""
    saved = state["precision"]
    opt_level = saved["opt_level"] if cfg.opt_level == "auto" else cfg.opt_level
    dtype = saved["dtype"] if cfg.amp_dtype == "auto" else cfg.amp_dtype
    memory = cfg.memory_format
    if memory == "auto":
        resolved = state.get("resolved") or {}
        memory = resolved.get("memory_format") or state["config"].get("memory_format", "auto")
    if memory == "auto":  # a checkpoint from before auto was measured: the rule it ran under
        memory = "channels_last" if device.type == "cpu" else "contiguous"
    return Decision(
        Candidate(opt_level, dtype, memory),
        "checkpoint",
        "kept from the checkpoint",
        settings_of(cfg),
    )


def plan_on_primary(cfg: Config, env: DistEnv) -> dict[str, Any]:
    """Rank 0: a decision from rules or the cache, or the candidates every rank must probe."""
    caps = detect(env.device)
    cands, notes = candidates(cfg, caps)
    settings = settings_of(cfg)
    if len(cands) == 1 or not cfg.auto_probe:
        choice, why = (
            (cands[0], "the only candidate") if len(cands) == 1 else rule_choice(cands, caps)
        )
        if len(cands) > 1:
            why += ", probe off (--no-auto-probe)"
        reason = "; ".join([*notes, why])
        return {"decision": Decision(choice, "rules", reason, settings).to_dict()}
    facts = cache_facts(cfg, caps, cands)
    path = cache.cache_file("auto", facts)
    cached = read_cache(path, facts)
    if cached is not None:
        reason = f"cached in {path}: {cached.reason}"
        decision = dataclasses.replace(cached, source="cache", reason=reason, settings=settings)
        return {"decision": decision.to_dict()}
    return {
        "decision": None,
        "candidates": [dataclasses.asdict(c) for c in cands],
        "notes": notes,
        "facts": facts,
        "path": str(path),
    }


def decide(cfg: Config, env: DistEnv, resumed: dict[str, Any] | None = None) -> Decision:
    """Resolve the ``auto`` fields of ``cfg``; call on every rank (collectives inside)."""
    if not needs_deciding(cfg):
        dtype = "float32" if cfg.opt_level == "O0" else cfg.amp_dtype
        fixed = Candidate(cfg.opt_level, dtype, cfg.memory_format)
        if env.is_primary:
            warn_if_wrong(fixed, cfg, env.device)
        return Decision(fixed, "fixed", "as set", settings_of(cfg))
    if resumed is not None:  # every rank holds the same checkpoint: no collective needed
        return from_checkpoint(cfg, resumed, env.device)
    plan = broadcast_object(plan_on_primary(cfg, env) if env.is_primary else None)
    if plan["decision"] is not None:
        return Decision.from_dict(plan["decision"])

    cands = [Candidate(**c) for c in plan["candidates"]]
    started = time.perf_counter()
    timings = probe(cfg, env, cands)
    decision = None
    if env.is_primary:
        picked = pick(cands, timings)
        if picked is None:  # nothing could be timed: the rules, and no cache
            choice, why = rule_choice(cands, detect(env.device))
            reason = "; ".join([*plan["notes"], f"probe failed for every candidate, {why}"])
            decision = Decision(choice, "rules", reason, settings_of(cfg), timings)
        else:
            choice, measured = picked
            took = f"probe {time.perf_counter() - started:.1f} s"
            reason = "; ".join([*plan["notes"], f"{measured} ({took})"])
            decision = Decision(choice, "probe", reason, settings_of(cfg), timings)
            write_cache(Path(plan["path"]), plan["facts"], decision)
    return Decision.from_dict(broadcast_object(decision.to_dict() if decision else None))


def main(argv: list[str] | None = None) -> int:
    """Print the capabilities, the candidates and the decision for a config, on one process."""
    from app.config import load_config
    from app.distributed import resolve_device

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        cfg = load_config(argv)
        device = resolve_device(cfg.device, 0)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    caps = detect(device)
    cands, notes = candidates(cfg, caps)
    print(f"device: {caps.describe()}, {torch.get_num_threads()} threads")
    print("candidates: " + ", ".join(f"[{c.label}]" for c in cands))
    for note in notes:
        print(f"left out: {note}")
    decision = decide(cfg, DistEnv(0, 0, 1, device))
    print(decision.log_line())
    return 0


if __name__ == "__main__":
    sys.exit(main())
