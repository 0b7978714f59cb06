"""What only a GPU can check, in a few minutes on one GPU, one verdict line per check.

    bash bench/gpu_check.sh                      # on a GPU host, or in the image:
    docker run --rm --gpus all --ipc=host IMAGE bash bench/gpu_check.sh
    bash bench/gpu_check.sh --allow-cpu          # no GPU: the CPU-capable checks; CUDA-only SKIP
    python bench/gpu_check.py --only native scaler   # some checks (name prefixes)

Each line is ``PASS name: detail``, ``FAIL name: detail`` or ``SKIP name: reason``; ``WARN``
lines are advice and leave the exit code alone. The exit code is 1 when any check FAILs. The
checks, in order (the code run is the trainer's own: ``UNet3d``, ``BCEDiceLoss``,
``build_precision``, ``prepare()``, ``app.engine.steps.train_one_epoch``, the checkpoint manager,
``save_checkpoint``/``load_checkpoint``):

versions            torch, CUDA, cuDNN, NCCL, the GPU; WARN on torch 2.9.0 (slow half 3D convs)
native-*            O0, O1-fp16, O1-bf16 and O3 steps (bench/train_step.py): finite loss,
                    samples/s, voxels/s, peak memory; o1-speedup: the O1 / O0 rate ratios
scaler-checkpoint   fp16 GradScaler: a forced overflow halves the scale; scale and growth tracker
                    survive a checkpoint loaded with weights_only=True into a fresh precision
multiclass-fp16     --num-classes 3 under fp16 autocast (GradScaler on CUDA): 3 steps of CE +
                    Dice with a finite loss; the softmax and the loss float32, the per-class
                    counts under autocast equal to those outside it from the same logits
channels-last-3d    a channels_last_3d forward matches the contiguous one (fp32, and autocast)
memory-format-speed O1 step rate, channels_last vs contiguous (reported, not judged)
auto-decision       what --opt-level/--amp-dtype/--memory-format auto pick on this device, with
                    the step time of every candidate; the second decision comes from the cache
nccl-init           NCCL process group of world size 1: all_reduce and broadcast on the GPU
ddp-2proc-gloo      2 spawned ranks, both on cuda:0, gloo: prepare() (SyncBN -> AMP -> DDP),
                    3 steps; the parameters stay identical on both ranks
syncbn-2proc-gloo   same run: after a train-mode forward on different data per rank, both ranks'
                    running stats are equal and equal the statistics of the concatenated batch
apex-O1, apex-O2    when ``apex.amp`` imports: steps through ApexPrecision + prepare(), and the
                    amp state restored from a checkpoint in a fresh process
train-resume        ``python -m app.train`` on generated data for 2 epochs, then ``--resume auto``
                    to epoch 3: metrics.jsonl holds epochs 1..3
launch-2gpu-nccl    with 2 or more GPUs: ``NPROC_PER_NODE=2 bash launch.sh`` for one epoch (NCCL)
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import datetime
import gc
import importlib
import importlib.util
import json
import math
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

STARTED = time.perf_counter()  # elapsed time includes the imports below

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch import nn  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")


def load_by_path(name: str, path: Path):
    """Import a script by file path (``bench/`` and ``datasets/`` are not packages)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


train_step = load_by_path("bench_train_step", ROOT / "bench" / "train_step.py")

from app.config import Config  # noqa: E402
from app.data.dataset import Normalization  # noqa: E402
from app.distributed import DistEnv, distributed_session, prepare, unwrap  # noqa: E402
from app.engine.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from app.engine.checkpointer import build_checkpointer  # noqa: E402
from app.engine.steps import (  # noqa: E402
    SyntheticStepper,
    build_scheduler,
    synthetic_batch,
    train_one_epoch,
)
from app.engine.tracking import NullTracker, read_metrics  # noqa: E402
from app.engine.utilisation import Utilisation, synchronize  # noqa: E402
from app.labels import build_loss  # noqa: E402
from app.losses import BCEDiceLoss  # noqa: E402
from app.metrics import class_counts  # noqa: E402
from app.model import UNet3d, use_channels_last  # noqa: E402
from app.precision import auto as autotune  # noqa: E402
from app.precision.amp import ApexPrecision, build_precision, softmax  # noqa: E402
from app.precision.hardware import detect  # noqa: E402
from app.precision.kernel_check import check_convolutions  # noqa: E402


def checkpoint_state(model, optimizer, scheduler, precision, cfg) -> dict:
    """The trainer's checkpoint of these objects at epoch 1 (``app.engine.checkpointer``)."""
    checkpointer = build_checkpointer(
        cfg.run_dir, model, optimizer, scheduler, precision, cfg, Normalization(cfg.normalization)
    )
    checkpointer.progress.epoch, checkpointer.progress.best_dice = 1, 0.0
    return checkpointer.state()


LAUNCH_ENV_PREFIXES = (
    "PET_",
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "MASTER_",
    "NNODES",
    "NODE_RANK",
    "NPROC_PER_NODE",
    "MAX_RESTARTS",
    "TORCHELASTIC_",
    "GROUP_RANK",
    "ROLE_",
    "LOCAL_WORLD_SIZE",
)


@dataclass(frozen=True)
class Sizes:
    patch: tuple[int, int, int]  # native steps: a realistic-but-small U-Net
    f_maps: int
    depth: int
    batch: int
    steps: int
    warmup: int
    repeats: int
    small_patch: tuple[int, int, int]  # exactness checks, DDP, apex
    small_f_maps: int
    volume: tuple[int, int, int]  # generated volumes for train-resume
    train_patch: tuple[int, int, int]
    num_workers: int


GPU_SIZES = Sizes((32, 128, 128), 16, 4, 2, 5, 3, 3, (16, 64, 64), 8, (32, 80, 80), (32, 64, 64), 1)
CPU_SIZES = Sizes((16, 16, 16), 4, 3, 2, 2, 1, 2, (16, 16, 16), 4, (16, 24, 24), (16, 16, 16), 0)
SMALL_DEPTH = 3


def small_config(sizes: Sizes, device: torch.device, **overrides) -> Config:
    values = dict(
        device=device.type,
        patch_size=sizes.small_patch,
        f_maps=sizes.small_f_maps,
        depth=SMALL_DEPTH,
        batch_size=2,
        opt_level="O1",  # the exactness checks are about autocast
    )
    values.update(overrides)
    return Config(**values)


# ----------------------------------------------------------------------------- reporting
class Reporter:
    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()

    def line(self, kind: str, name: str, detail: str) -> None:
        self.counts[kind] += 1
        print(f"{kind} {name}: {' '.join(str(detail).split())}", flush=True)

    def pass_(self, name: str, detail: str) -> None:
        self.line("PASS", name, detail)

    def fail(self, name: str, detail: str) -> None:
        self.line("FAIL", name, detail)

    def skip(self, name: str, reason: str) -> None:
        self.line("SKIP", name, reason)

    def warn(self, name: str, detail: str) -> None:
        self.line("WARN", name, detail)

    def verdict(self, ok: bool, name: str, detail: str) -> None:
        (self.pass_ if ok else self.fail)(name, detail)


@dataclass
class Context:
    device: torch.device
    sizes: Sizes
    tmp: Path
    report: Reporter

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


def last_error_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "(no output)"


# ----------------------------------------------------------------------------- helpers
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_spawned(fn: Callable, nprocs: int, args: tuple, timeout: float) -> str | None:
    """Run ``fn(index, *args)`` in ``nprocs`` spawned processes; an error message or None."""
    context = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    try:
        while not context.join(timeout=max(0.1, min(5.0, deadline - time.monotonic()))):
            if time.monotonic() > deadline:
                for process in context.processes:
                    if process.is_alive():
                        process.terminate()
                for process in context.processes:
                    process.join(10)
                return f"timed out after {timeout:.0f} s"
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as exc:
        return f"{type(exc).__name__}: {last_error_line(str(exc))}"
    return None


def write_result(path: Path, fn: Callable[[], dict]) -> None:
    """Run ``fn`` and write its result (or the traceback) as JSON: how children report."""
    try:
        result = fn()
    except Exception:
        result = {"error": traceback.format_exc()}
    path.write_text(json.dumps(result))


def read_result(path: Path) -> dict:
    if not path.is_file():
        return {"error": f"no result file {path.name}"}
    return json.loads(path.read_text())


@contextlib.contextmanager
def exact_fp32():
    """TF32 off for the duration (cuDNN convolutions use it by default on Ampere and newer)."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without launcher variables, so a child trains as one process."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCH_ENV_PREFIXES)}
    env.update(NO_ALBUMENTATIONS_UPDATE="1", PYTHONUNBUFFERED="1", **extra)
    return env


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().double().flatten().cpu() for p in unwrap(model).parameters()])


def steps_of(model, optimizer, precision, batch, n: int, env: DistEnv, loss_fn=None) -> float:
    """``n`` training steps through ``app.engine.steps.train_one_epoch``; the mean loss of the steps
    taken (NaN when the non-finite guard skipped them all)."""
    loss_fn = loss_fn or BCEDiceLoss()
    totals = train_one_epoch(
        model, [batch] * n, optimizer, precision, loss_fn, NullTracker(), env, 1, 1
    )
    return totals.loss


# ----------------------------------------------------------------------------- checks
def check_versions(ctx: Context) -> None:
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    parts = [
        f"torch {torch.__version__}",
        f"CUDA {torch.version.cuda}",
        f"cuDNN {cudnn}",
        f"Python {platform.python_version()}",
    ]
    if ctx.cuda:
        if dist.is_nccl_available():
            nccl = torch.cuda.nccl.version()
            parts.append(f"NCCL {'.'.join(map(str, nccl)) if isinstance(nccl, tuple) else nccl}")
        props = torch.cuda.get_device_properties(ctx.device)
        parts.append(
            f"{torch.cuda.device_count()} GPU(s), cuda:0 {props.name} "
            f"(sm_{props.major}{props.minor}, {props.total_memory / 2**30:.0f} GiB)"
        )
    else:
        parts.append("no CUDA device: CPU mode")
    ok = not ctx.cuda or cudnn is not None
    ctx.report.verdict(ok, "versions", ", ".join(parts) + ("" if ok else "; cuDNN unavailable"))
    if torch.__version__.startswith("2.9.0"):
        ctx.report.warn(
            "torch-2.9.0",
            "torch 2.9.0 disabled cuDNN for fp16/bf16 3D convolutions (pytorch/pytorch#166122): "
            "AMP runs about 4x slower; use an image with another torch (the Dockerfile pins 2.8.0)",
        )


def speed_config(ctx: Context) -> Config:
    """The realistic-but-small training configuration that the speed checks time."""
    s = ctx.sizes
    return Config(
        device=ctx.device.type,
        patch_size=s.patch,
        f_maps=s.f_maps,
        depth=s.depth,
        batch_size=s.batch,
    )


def check_native_steps(ctx: Context) -> None:
    s = ctx.sizes
    cfg = speed_config(ctx)
    LevelSpec = train_step.LevelSpec
    specs = [LevelSpec("O0", "O0"), LevelSpec("O1-fp16", "O1", "float16")]
    if ctx.cuda and not torch.cuda.is_bf16_supported():
        ctx.report.skip("native-O1-bf16", "this GPU does not support bfloat16")
    else:
        specs.append(LevelSpec("O1-bf16", "O1", "bfloat16"))
    specs.append(LevelSpec("O3", "O3"))
    results = train_step.measure(cfg, ctx.device, specs, s.steps, s.warmup, s.repeats)
    voxels = math.prod(s.patch)
    rates = {}
    for r in results:
        name = f"native-{r.label}"
        if r.error or not r.seconds:
            ctx.report.fail(name, r.error or "no timed run")
            continue
        rate = r.samples_per_s(s.steps, s.batch)
        rates[r.label] = rate
        figures = (
            f"{rate:.3g} samples/s, {rate * voxels:.3g} voxels/s, {r.ms_per_step(s.steps):.1f} "
            f"ms/step, peak {r.peak_mib:.0f} MiB (median of {s.repeats} x {s.steps} steps, batch "
            f"{s.batch} x {'x'.join(map(str, s.patch))}, UNet3d f_maps {s.f_maps} depth "
            f"{s.depth}); {r.description}"
        )
        if r.finite:
            ctx.report.pass_(name, f"loss {r.losses[-1]:.4f} (finite); {figures}")
            continue
        ctx.report.fail(
            name,
            f"loss not finite: warm-up {r.warmup_loss:.4g}, then "
            f"{', '.join(f'{x:.4g}' for x in r.losses)}; {figures}",
        )
    if "O0" not in rates:
        ctx.report.fail("o1-speedup", "no O0 rate to compare with")
        return
    ratios = {k: v / rates["O0"] for k, v in rates.items() if k != "O0"}
    detail = ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()) + " samples/s vs O0"
    if not ctx.cuda:
        ctx.report.skip("o1-speedup", f"{detail} (CPU: reported, judged on CUDA only)")
    elif ratios.get("O1-fp16", 0.0) < 0.8:
        ctx.report.fail(
            "o1-speedup",
            f"{detail}: fp16 autocast is slower than fp32; cuDNN half 3D convolutions off? "
            "(torch 2.9.0 does that)",
        )
    else:
        ctx.report.pass_("o1-speedup", detail)


def check_scaler_checkpoint(ctx: Context) -> None:
    cfg = small_config(ctx.sizes, ctx.device, opt_level="O1", amp_dtype="float16")
    env = DistEnv(0, 0, 1, ctx.device)
    model, optimizer, precision = train_step.build_level(cfg, env)
    scheduler = build_scheduler(optimizer, cfg)
    batch = synthetic_batch(cfg, ctx.device)
    initial = precision.scaler.state_dict()
    steps_of(model, optimizer, precision, batch, 2, env)
    loss_fn = BCEDiceLoss()
    steps_of(model, optimizer, precision, batch, 1, env, lambda out, y: loss_fn(out, y) * 1e12)
    backed_off = precision.scaler.get_scale()
    loss = steps_of(model, optimizer, precision, batch, 3, env)
    saved = precision.scaler.state_dict()
    if not backed_off < initial["scale"] or saved["_growth_tracker"] != 3:
        ctx.report.fail(
            "scaler-checkpoint",
            f"GradScaler did not react as expected: scale {initial['scale']} -> {backed_off} "
            f"after an overflowing step (expected a back-off), growth tracker "
            f"{saved['_growth_tracker']} after 3 good steps (expected 3)",
        )
        return
    path = ctx.tmp / "scaler" / "last.pt"
    save_checkpoint(
        path,
        checkpoint_state(model, optimizer, scheduler, precision, cfg),
    )
    state = load_checkpoint(path)  # torch.load(weights_only=True)
    model2, optimizer2, precision2 = train_step.build_level(cfg, env)
    fresh = precision2.scaler.state_dict()
    unwrap(model2).load_state_dict(state["model"])
    optimizer2.load_state_dict(state["optimizer"])
    precision2.load_state_dict(state["precision"])
    restored = precision2.scaler.state_dict()
    next_loss = steps_of(model2, optimizer2, precision2, batch, 1, env)
    after = precision2.scaler.state_dict()
    ok = (
        restored == saved
        and fresh != saved
        and after["scale"] == saved["scale"]
        and after["_growth_tracker"] == saved["_growth_tracker"] + 1
        and math.isfinite(loss)
        and math.isfinite(next_loss)
    )
    ctx.report.verdict(
        ok,
        "scaler-checkpoint",
        f"{precision.describe()} on {ctx.device.type}: scale {initial['scale']} -> "
        f"{backed_off} after a forced overflow step, then 3 steps (loss {loss:.4f}): "
        f"saved scale {saved['scale']}, growth tracker {saved['_growth_tracker']}; "
        f"save_checkpoint -> load_checkpoint (weights_only=True) -> fresh precision "
        f"(scale {fresh['scale']}, tracker {fresh['_growth_tracker']}) .load_state_dict: scale "
        f"{restored['scale']}, tracker {restored['_growth_tracker']}; next step: scale "
        f"{after['scale']}, tracker {after['_growth_tracker']}, loss {next_loss:.4f}",
    )


def check_multiclass(ctx: Context) -> None:
    cfg = small_config(ctx.sizes, ctx.device, amp_dtype="float16", num_classes=3)
    env = DistEnv(0, 0, 1, ctx.device)
    model, optimizer, precision = train_step.build_level(cfg, env)
    batch = synthetic_batch(cfg, ctx.device)
    loss_fn = build_loss(cfg)
    loss = steps_of(model, optimizer, precision, batch, 3, env, loss_fn)
    images, labels = batch
    with torch.no_grad(), precision.autocast():
        logits = model(images)
        probs = softmax(logits, dim=1)
        value = loss_fn(logits, labels)
        counts = class_counts(logits, labels)
    reference = class_counts(logits.float(), labels)  # outside autocast, from the same logits
    ok = (
        probs.dtype == torch.float32
        and value.dtype == torch.float32
        and torch.equal(counts, reference)
        and math.isfinite(loss)
    )
    ctx.report.verdict(
        ok,
        "multiclass-fp16",
        f"{precision.describe()} on {ctx.device.type}, K = 3: 3 steps, loss {loss:.4f}; under "
        f"autocast the logits are {str(logits.dtype).removeprefix('torch.')}, the softmax "
        f"{str(probs.dtype).removeprefix('torch.')}, the loss "
        f"{str(value.dtype).removeprefix('torch.')}; per-class counts "
        f"{'equal' if torch.equal(counts, reference) else 'differ from'} those outside autocast",
    )


def check_channels_last(ctx: Context) -> None:
    cfg = small_config(ctx.sizes, ctx.device)
    torch.manual_seed(0)
    model = UNet3d(1, 1, cfg.f_maps, cfg.depth).to(ctx.device).eval()
    model_cl = use_channels_last(copy.deepcopy(model))  # what --memory-format channels_last does
    images, _ = synthetic_batch(cfg, ctx.device)
    images_cl = images  # the model's pre-hook converts its input
    precision = build_precision(cfg, ctx.device)  # O1, the default dtype here
    weight = model_cl.encoders[1][0].weight
    errors = {}
    with torch.no_grad():
        with exact_fp32():
            ref, out = model(images), model_cl(images_cl)
        errors["fp32"] = (float((out - ref).abs().max() / ref.abs().max()), 1e-4)
        with precision.autocast():
            ref, out = model(images).float(), model_cl(images_cl).float()
        tolerance = 2e-2 if precision.dtype == torch.float16 else 5e-2
        errors[precision.dtype_name] = (float((out - ref).abs().max() / ref.abs().max()), tolerance)
    weight_cl = weight.is_contiguous(memory_format=torch.channels_last_3d)
    ok = all(err <= tol for err, tol in errors.values()) and weight_cl
    ctx.report.verdict(
        ok,
        "channels-last-3d",
        f"UNet3d forward, channels_last_3d model and input vs contiguous, batch "
        f"{cfg.batch_size} x {'x'.join(map(str, cfg.patch_size))}: max |diff| / max |output| "
        + ", ".join(f"{k} {e:.1e} (tolerance {t:.0e})" for k, (e, t) in errors.items())
        + f"; conv weights channels_last_3d: {weight_cl}",
    )
    check_memory_format_speed(ctx)


def check_memory_format_speed(ctx: Context) -> None:
    """Training-step rate of --memory-format channels_last vs contiguous at O1: reported, not
    judged; it is the figure that should set the trainer's ``auto`` default on this GPU."""
    s = ctx.sizes
    cfg = speed_config(ctx)
    specs = [
        train_step.LevelSpec("contiguous", "O1", memory_format="contiguous"),
        train_step.LevelSpec("channels_last", "O1", memory_format="channels_last"),
    ]
    results = train_step.measure(cfg, ctx.device, specs, s.steps, s.warmup, s.repeats)
    rates = {r.label: r.samples_per_s(s.steps, s.batch) for r in results if r.seconds}
    if len(rates) != 2:
        ctx.report.fail("memory-format-speed", "; ".join(r.error or "" for r in results))
        return
    ratio = rates["channels_last"] / rates["contiguous"]
    ctx.report.pass_(
        "memory-format-speed",
        f"O1 training steps: channels_last {rates['channels_last']:.3g} vs contiguous "
        f"{rates['contiguous']:.3g} samples/s = {ratio:.2f}x (--memory-format auto measures "
        "this on each machine: see auto-decision)",
    )


def check_auto_decision(ctx: Context) -> None:
    """What ``auto`` decides on this device, with the alternatives it measured; then that the
    second decision comes from the cache, unchanged."""
    os.environ["IRONGRAIN_CACHE_DIR"] = str(ctx.tmp / "auto-cache")  # a fresh cache, this run's
    cfg = speed_config(ctx)
    caps = detect(ctx.device)
    cands, _ = autotune.candidates(cfg, caps)
    env = DistEnv(0, 0, 1, ctx.device)
    started = time.perf_counter()
    first = autotune.decide(cfg, env)
    took = time.perf_counter() - started
    again = autotune.decide(cfg, env)
    probed = len(cands) > 1
    ok = (first.source == "probe") == probed and (
        not probed or (again.source == "cache" and again.choice == first.choice)
    )
    ctx.report.verdict(
        ok,
        "auto-decision",
        f"{caps.describe()}; candidates {[c.label for c in cands]}; {first.log_line()}; "
        f"decided in {took:.1f} s; second decision from {again.source}",
    )


def check_utilisation(ctx: Context) -> None:
    """FLOPs per step over the practical peak (a large convolution, measured here) in bf16 and
    fp16 autocast: how close the training step gets to this device. Reported, not judged."""
    s = ctx.sizes
    parts = []
    for dtype in ("bfloat16", "float16") if ctx.cuda else ("bfloat16",):
        cfg = dataclasses.replace(
            speed_config(ctx), opt_level="O1", amp_dtype=dtype, memory_format="contiguous"
        )
        spec = train_step.LevelSpec(dtype, "O1", amp_dtype=dtype, memory_format="contiguous")
        result = train_step.measure(cfg, ctx.device, [spec], s.steps, s.warmup, s.repeats)[0]
        if not result.seconds:
            ctx.report.fail("utilisation", f"{dtype}: {result.error}")
            return
        step_s = result.ms_per_step(s.steps) / 1000.0
        os.environ["IRONGRAIN_CACHE_DIR"] = str(ctx.tmp / "peak-cache")  # measured, not cached
        use = Utilisation.for_run(cfg, ctx.device, f"{dtype} autocast, contiguous")
        parts.append(f"{dtype}: {use.describe(step_s)}")
    ctx.report.pass_("utilisation", "; ".join(parts))


def check_compile(ctx: Context) -> None:
    """--compile on: the compiled O1 step against eager (time, compile time, the same loss to
    autocast's precision), and that the checkpoint keys are the uncompiled model's."""
    s = ctx.sizes
    cfg = dataclasses.replace(
        speed_config(ctx), opt_level="O1", amp_dtype="bfloat16", memory_format="contiguous"
    )
    env = DistEnv(0, 0, 1, ctx.device)
    steppers = {}
    for name, compiled in (("eager", False), ("compiled", True)):
        torch.manual_seed(0)
        steppers[name] = SyntheticStepper(cfg, env, compile=compiled)
    started = time.perf_counter()
    losses = {name: stepper.run(1).loss for name, stepper in steppers.items()}
    first = time.perf_counter() - started
    times = {}
    for name, stepper in steppers.items():
        synchronize(ctx.device)
        started = time.perf_counter()
        stepper.run(s.steps)
        synchronize(ctx.device)
        times[name] = (time.perf_counter() - started) / s.steps
    keys_same = list(unwrap(steppers["compiled"].model).state_dict()) == list(
        unwrap(steppers["eager"].model).state_dict()
    )
    close = math.isclose(losses["eager"], losses["compiled"], rel_tol=2e-2)
    ctx.report.verdict(
        keys_same and close,
        "compile",
        f"bf16 O1 step eager {times['eager'] * 1000:.1f} ms, compiled "
        f"{times['compiled'] * 1000:.1f} ms ({times['eager'] / times['compiled']:.2f}x), first "
        f"steps incl. compiling {first:.0f} s; first losses {losses['eager']:.5f} / "
        f"{losses['compiled']:.5f}; checkpoint keys unchanged: {keys_same}",
    )


def check_kernels(ctx: Context) -> None:
    """Each half dtype's convolution outputs and weight gradients against float32 from the same
    inputs (``app.precision.kernel_check``), at the speed config and at a 16-deep patch with depth
    4 (the bottom 2 voxels deep, the shape oneDNN's bf16 gets wrong on Zen 4 CPUs)."""
    base = speed_config(ctx)
    shapes = [base, dataclasses.replace(base, patch_size=(16, 64, 64), depth=4)]
    if ctx.device.type == "cuda":
        dtypes = ["bfloat16", "float16"] if torch.cuda.is_bf16_supported() else ["float16"]
    else:  # a CPU's emulated half dtypes are never auto candidates: not worth the minutes
        dtypes, _ = autotune.native_half_dtypes(detect(ctx.device))
    if not dtypes:
        ctx.report.skip("kernels", "no native half dtype on this device")
    for dtype in dtypes:
        results = []
        for cfg in shapes:
            cfg = dataclasses.replace(cfg, opt_level="O1", amp_dtype=dtype)
            error = check_convolutions(cfg, ctx.device)
            patch = "x".join(map(str, cfg.patch_size))
            results.append((error.ok, f"{patch} depth {cfg.depth}: {error.describe()}"))
        ok = all(good for good, _ in results)
        ctx.report.verdict(ok, f"kernels-{dtype}", "; ".join(text for _, text in results))


def _nccl_worker(_index: int, port: int, out: str) -> None:
    def body() -> dict:
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        dist.init_process_group(
            "nccl",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=0,
            world_size=1,
            timeout=datetime.timedelta(seconds=60),
            device_id=device,
        )
        try:
            summed = torch.arange(4.0, device=device)
            dist.all_reduce(summed)
            sent = torch.full((2,), 7.0, device=device)
            dist.broadcast(sent, src=0)
            dist.barrier()
            torch.cuda.synchronize()
            return {"backend": dist.get_backend(), "sum": summed.tolist(), "bcast": sent.tolist()}
        finally:
            dist.destroy_process_group()

    write_result(Path(out), body)


def check_nccl(ctx: Context) -> None:
    if not ctx.cuda:
        ctx.report.skip("nccl-init", "NCCL needs CUDA")
        return
    if not dist.is_nccl_available():
        ctx.report.fail("nccl-init", "this torch build has no NCCL (dist.is_nccl_available())")
        return
    out = ctx.tmp / "nccl.json"
    error = run_spawned(_nccl_worker, 1, (free_port(), str(out)), timeout=90)
    result = read_result(out) if error is None else {"error": error}
    if "error" in result:
        ctx.report.fail("nccl-init", last_error_line(result["error"]))
        return
    ok = result["sum"] == [0.0, 1.0, 2.0, 3.0] and result["bcast"] == [7.0, 7.0]
    ctx.report.verdict(
        ok,
        "nccl-init",
        f"init_process_group('nccl', world_size=1, device_id=cuda:0): all_reduce "
        f"{result['sum']}, broadcast {result['bcast']}, barrier, destroy",
    )


def _ddp_worker(
    rank: int, world_size: int, port: int, device_type: str, out_dir: str, sizes: dict
) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK="0",  # both ranks on cuda:0: what NCCL refuses and gloo allows
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    cfg = small_config(
        Sizes(**sizes), torch.device(device_type), dist_backend="gloo", dist_timeout_s=120
    )

    def body() -> dict:
        with distributed_session(cfg) as env:  # app.distributed: env vars -> gloo group
            result = ddp_and_syncbn(cfg, env)
            gc.collect()  # free DDP, which holds the group, before the group is destroyed
            dist.barrier()
            return result

    write_result(Path(out_dir) / f"ddp-{rank}.json", body)


def ddp_and_syncbn(cfg: Config, env: DistEnv) -> dict:
    """One rank of the 2-process check: SyncBN statistics, then DDP steps."""
    model, optimizer, precision = train_step.build_level(cfg, env)  # SyncBN -> AMP -> DDP
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    first = norms[0]
    captured: list[torch.Tensor] = []
    hook = first.register_forward_pre_hook(
        lambda _module, inputs: captured.append(inputs[0].detach().double().cpu())
    )
    # different data on each rank (another seed and a shifted mean): local stats differ
    rank_cfg = dataclasses.replace(cfg, seed=cfg.seed + env.rank)
    batch = synthetic_batch(rank_cfg, env.device, offset=2.0 * env.rank)
    model.train()
    with torch.no_grad():
        model(batch[0])  # fp32: the statistics are compared exactly
    hook.remove()

    def gather(value):
        out = [None] * env.world_size
        dist.all_gather_object(out, value)
        return out

    dims = (0, 2, 3, 4)
    inputs = torch.cat(gather(captured[0]))
    momentum = first.momentum
    expected_mean = momentum * inputs.mean(dims)  # running stats start at 0 and 1
    expected_var = (1 - momentum) + momentum * inputs.var(dims, unbiased=True)
    local_mean = momentum * captured[0].mean(dims)
    mean_error = float((first.running_mean.double().cpu() - expected_mean).abs().max())
    var_error = float((first.running_var.double().cpu() - expected_var).abs().max())

    def buffers_across_ranks() -> float:
        mine = torch.cat([torch.cat([m.running_mean, m.running_var]) for m in norms])
        theirs = gather(mine.double().cpu())
        return float((theirs[0] - theirs[1]).abs().max())

    buffers_after_forward = buffers_across_ranks()
    before = flat_params(model)
    loss = steps_of(model, optimizer, precision, batch, 3, env)  # mean over both ranks
    after = flat_params(model)
    all_params = gather(after)
    return {
        "rank": env.rank,
        "device": str(env.device),
        "model": type(model).__name__,
        "norms": sorted({type(m).__name__ for m in norms}),
        "precision": precision.describe(),
        "mean_error": mean_error,
        "var_error": var_error,
        "local_vs_global": float((local_mean - expected_mean).abs().max()),
        "buffers_across_ranks": max(buffers_after_forward, buffers_across_ranks()),
        "loss": loss,
        "params_across_ranks": float((all_params[0] - all_params[1]).abs().max()),
        "params_moved": float((after - before).abs().max()),
    }


def check_ddp_syncbn(ctx: Context) -> None:
    out_dir = ctx.tmp / "ddp"
    out_dir.mkdir()
    args = (2, free_port(), ctx.device.type, str(out_dir), dataclasses.asdict(ctx.sizes))
    error = run_spawned(_ddp_worker, 2, args, timeout=180)
    results = [read_result(out_dir / f"ddp-{rank}.json") for rank in range(2)]
    failed = [r["error"] for r in results if "error" in r]
    if error or failed:
        detail = last_error_line(failed[0]) if failed else error
        ctx.report.fail("ddp-2proc-gloo", detail)
        ctx.report.fail("syncbn-2proc-gloo", f"the 2-process run failed: {detail}")
        return
    r0, r1 = results
    ddp_ok = (
        r0["model"] == "DistributedDataParallel"
        and all(math.isfinite(r["loss"]) for r in results)
        and max(r["params_across_ranks"] for r in results) <= 1e-6
        and r0["params_moved"] > 0
    )
    ctx.report.verdict(
        ddp_ok,
        "ddp-2proc-gloo",
        f"2 spawned ranks on {r0['device']} and {r1['device']} (LOCAL_RANK=0 each), gloo; "
        f"prepare() gave {r0['model']} over {'/'.join(r0['norms'])}, {r0['precision']}; 3 "
        f"train_one_epoch steps, loss {r0['loss']:.4f} (both ranks); parameters moved by up to "
        f"{r0['params_moved']:.2e} and differ across ranks by {r0['params_across_ranks']:.1e}",
    )
    if not ctx.cuda:
        ctx.report.skip(
            "syncbn-2proc-gloo",
            f"SyncBatchNorm runs on CUDA only; on CPU prepare() kept {'/'.join(r0['norms'])} "
            f"per process (running stats differ across ranks by "
            f"{r0['buffers_across_ranks']:.3g}, as expected)",
        )
        return
    tolerance = 1e-4
    syncbn_ok = (
        r0["norms"] == ["SyncBatchNorm"]
        and max(r["mean_error"] for r in results) <= tolerance
        and max(r["var_error"] for r in results) <= tolerance
        and max(r["buffers_across_ranks"] for r in results) <= tolerance
        and min(r["local_vs_global"] for r in results) > 10 * tolerance
    )
    ctx.report.verdict(
        syncbn_ok,
        "syncbn-2proc-gloo",
        f"{'/'.join(r0['norms'])}: train-mode forward on different data per rank; first layer "
        f"running_mean / running_var vs the concatenated batch: max error "
        f"{max(r['mean_error'] for r in results):.1e} / {max(r['var_error'] for r in results):.1e}"
        f" (tolerance {tolerance:.0e}; rank-local stats would be off by "
        f"{min(r['local_vs_global'] for r in results):.2e}); all BN buffers equal across ranks "
        f"within {max(r['buffers_across_ranks'] for r in results):.1e} (after the forward and "
        "after 3 steps)",
    )


# --- apex
def _apex_setup(level: str, device: torch.device, sizes: Sizes):
    cfg = small_config(sizes, device, amp_backend="apex", opt_level=level)
    env = DistEnv(0, 0, 1, device)
    precision = ApexPrecision(level, cfg.fp32_ops)
    torch.manual_seed(cfg.seed)
    model = UNet3d(1, 1, cfg.f_maps, cfg.depth).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = build_scheduler(optimizer, cfg)
    model, optimizer = prepare(model, optimizer, precision, env)  # amp.initialize
    batch = synthetic_batch(cfg, device)
    return cfg, env, precision, model, optimizer, scheduler, batch


def apex_train_and_save(level: str, path: Path, device: torch.device, sizes: Sizes) -> dict:
    cfg, env, precision, model, optimizer, scheduler, batch = _apex_setup(level, device, sizes)
    loss = steps_of(model, optimizer, precision, batch, 3, env)
    state = checkpoint_state(model, optimizer, scheduler, precision, cfg)
    save_checkpoint(path, state)
    return {
        "loss": loss,
        "amp": precision.state_dict()["amp"],
        "describe": precision.describe(),
        "param_dtype": str(next(unwrap(model).parameters()).dtype),
    }


def apex_load_and_compare(level: str, path: Path, device: torch.device, sizes: Sizes) -> dict:
    _, env, precision, model, optimizer, _, batch = _apex_setup(level, device, sizes)
    state = load_checkpoint(path)  # torch.load(weights_only=True)
    unwrap(model).load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    precision.load_state_dict(state["precision"])  # after amp.initialize, as apex requires
    restored = precision.state_dict()["amp"]
    loss = steps_of(model, optimizer, precision, batch, 1, env)
    return {"saved": state["precision"]["amp"], "restored": restored, "loss": loss}


def _apex_worker(_index: int, mode: str, level: str, path: str, out: str, sizes: dict) -> None:
    def body() -> dict:
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        fn = apex_train_and_save if mode == "train" else apex_load_and_compare
        return json.loads(json.dumps(fn(level, Path(path), device, Sizes(**sizes)), default=str))

    write_result(Path(out), body)


def check_apex(ctx: Context) -> None:
    names = ("apex-O1", "apex-O2")
    if not ctx.cuda:
        for name in names:
            ctx.report.skip(name, "apex needs CUDA")
        return
    try:
        importlib.import_module("apex.amp")
    except ImportError as exc:
        for name in names:
            ctx.report.skip(
                name,
                f"apex.amp is not importable ({exc}); expected in the default image: run this "
                "script in the apex image (docker/Dockerfile.apex, apex 25.05) to check apex",
            )
        return
    sizes = dataclasses.asdict(ctx.sizes)
    for name, level in zip(names, ("O1", "O2")):
        path, results = ctx.tmp / f"apex-{level}.pt", {}
        for mode in ("train", "resume"):  # each in a fresh process: amp.initialize once each
            out = ctx.tmp / f"apex-{level}-{mode}.json"
            error = run_spawned(_apex_worker, 1, (mode, level, str(path), str(out), sizes), 120)
            results[mode] = read_result(out) if error is None else {"error": error}
            if "error" in results[mode]:
                break
        failed = [r["error"] for r in results.values() if "error" in r]
        if failed:
            ctx.report.fail(name, last_error_line(failed[0]))
            continue
        train, resume = results["train"], results["resume"]
        ok = (
            math.isfinite(train["loss"])
            and math.isfinite(resume["loss"])
            and resume["restored"] == resume["saved"] == train["amp"]
        )
        ctx.report.verdict(
            ok,
            name,
            f"{train['describe']} via ApexPrecision + prepare() (world size 1), parameters "
            f"{train['param_dtype']}: 3 steps, loss {train['loss']:.4f}; amp state "
            f"{train['amp']} saved with save_checkpoint, loaded (weights_only=True) in a fresh "
            f"process after amp.initialize: {resume['restored']}; next step loss "
            f"{resume['loss']:.4f}",
        )


# --- the trainer end to end
def make_data(ctx: Context) -> Path:
    root = ctx.tmp / "data"
    if not (root / "train_patches").is_dir():
        synth = load_by_path("irongrain_make_synthetic", ROOT / "datasets" / "make_synthetic.py")
        synth.generate(root, 4, 2, ctx.sizes.volume, 0, log=lambda *_: None)
    return root


def trainer_args(ctx: Context, data: Path, run_dir: Path) -> list[str]:
    s = ctx.sizes
    return [
        "--data-root", str(data), "--output-dir", str(run_dir), "--device", ctx.device.type,
        "--patch-size", *map(str, s.train_patch), "--f-maps", "4", "--depth", str(SMALL_DEPTH),
        "--batch-size", "2", "--samples-per-volume", "2", "--num-workers", str(s.num_workers),
        "--milestones", "2", "--log-every", "1", "--seed", "0",
    ]  # fmt: skip


def run_trainer(command: list[str], timeout: float, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        command, cwd=ROOT, env=clean_env(**env), capture_output=True, text=True, timeout=timeout
    )


def check_train_resume(ctx: Context) -> None:
    data = make_data(ctx)
    run_dir = ctx.tmp / "run"
    base = [sys.executable, "-m", "app.train", *trainer_args(ctx, data, run_dir)]
    logs = []
    for extra in (["--epochs", "2", "--resume", "none"], ["--epochs", "3", "--resume", "auto"]):
        done = run_trainer([*base, *extra], timeout=150)
        logs.append(done.stderr)
        if done.returncode != 0:
            ctx.report.fail(
                "train-resume",
                f"python -m app.train {' '.join(extra)} exited {done.returncode}: "
                f"{last_error_line(done.stderr + done.stdout)}",
            )
            return
    rows = read_metrics(run_dir / "metrics.jsonl")
    epochs = [r["epoch"] for r in rows]
    state = load_checkpoint(run_dir / "checkpoints" / "last.pt")
    precision = state["precision"]
    scaler = precision.get("scaler") or {}
    scaler_text = (
        f"GradScaler scale {scaler['scale']}, growth tracker {scaler['_growth_tracker']}"
        if "scale" in scaler
        else "no GradScaler"
    )
    last = rows[-1] if rows else {}
    ok = (
        epochs == [1, 2, 3]
        and all(math.isfinite(r["train_loss"]) for r in rows)
        and "dice" in last
        and "resumed from" in logs[1]
        and state["epoch"] == 3
    )
    ctx.report.verdict(
        ok,
        "train-resume",
        f"python -m app.train --device {ctx.device.type} on 4+2 generated volumes "
        f"{'x'.join(map(str, ctx.sizes.volume))}: --epochs 2, then --epochs 3 --resume auto "
        f"({'resumed' if 'resumed from' in logs[1] else 'did NOT resume'}): metrics.jsonl epochs "
        f"{epochs}, last dice {last.get('dice', float('nan')):.3f}, "
        f"{last.get('samples_per_s', float('nan')):.3g} samples/s; last.pt epoch "
        f"{state['epoch']}, precision {precision['backend']} {precision['opt_level']} "
        f"{precision['dtype']}, {scaler_text}",
    )


def check_launch_two_gpus(ctx: Context) -> None:
    count = torch.cuda.device_count() if ctx.cuda else 0
    if count < 2:
        ctx.report.skip(
            "launch-2gpu-nccl",
            f"needs 2 GPUs, found {count}; the 2-process SyncBN/DDP path is checked by "
            "syncbn-2proc-gloo",
        )
        return
    data = make_data(ctx)
    run_dir = ctx.tmp / "run-2gpu"
    args = [*trainer_args(ctx, data, run_dir), "--epochs", "1", "--resume", "none"]
    done = run_trainer(
        ["bash", "launch.sh", *args], timeout=180, NPROC_PER_NODE="2", PYTHON=sys.executable
    )
    rows = read_metrics(run_dir / "metrics.jsonl")
    ok = done.returncode == 0 and [r.get("world_size") for r in rows] == [2]
    detail = (
        f"NPROC_PER_NODE=2 bash launch.sh --device cuda (NCCL, SyncBN): exit {done.returncode}, "
        f"metrics.jsonl {[(r['epoch'], r.get('world_size')) for r in rows]} (epoch, world size)"
    )
    if done.returncode != 0:
        detail += f": {last_error_line(done.stderr + done.stdout)}"
    ctx.report.verdict(ok, "launch-2gpu-nccl", detail)


CHECKS: list[tuple[str, Callable[[Context], None]]] = [
    ("versions", check_versions),
    ("native", check_native_steps),
    ("scaler-checkpoint", check_scaler_checkpoint),
    ("multiclass-fp16", check_multiclass),
    ("channels-last-3d", check_channels_last),
    ("kernels", check_kernels),
    ("auto-decision", check_auto_decision),
    ("utilisation", check_utilisation),
    ("compile", check_compile),
    ("nccl-init", check_nccl),
    ("ddp-syncbn", check_ddp_syncbn),
    ("apex", check_apex),
    ("train-resume", check_train_resume),
    ("launch-2gpu-nccl", check_launch_two_gpus),
]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="bench/gpu_check.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="checks: " + ", ".join(name for name, _ in CHECKS),
    )
    parser.add_argument(
        "--allow-cpu",
        action="store_true",
        help="without CUDA, run the CPU-capable checks on CPU and SKIP the CUDA-only ones",
    )
    parser.add_argument(
        "--device",
        choices=["auto", "cuda", "cpu"],
        default="auto",
        help="cuda (default when present), or cpu: the CPU mode even on a GPU host",
    )
    parser.add_argument(
        "--only", nargs="+", metavar="NAME", help="run the checks whose names start with NAME"
    )
    args = parser.parse_args(argv)
    report = Reporter()
    cuda = torch.cuda.is_available()
    if args.device == "cuda" or (args.device == "auto" and cuda):
        if not cuda:
            report.fail("cuda", "--device cuda but torch.cuda.is_available() is False")
            return 1
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
    elif args.device == "cpu" or args.allow_cpu:
        device = torch.device("cpu")
    else:
        report.fail(
            "cuda",
            f"CUDA is not available (torch {torch.__version__}, built for CUDA "
            f"{torch.version.cuda}): run on a GPU host or with `docker run --gpus all`, or pass "
            "--allow-cpu to run the CPU-capable checks",
        )
        print(f"gpu_check: elapsed {time.perf_counter() - STARTED:.1f} s")
        return 1
    sizes = GPU_SIZES if device.type == "cuda" else CPU_SIZES
    print(f"gpu_check: device {device}, {'GPU' if device.type == 'cuda' else 'CPU'} sizes")
    with tempfile.TemporaryDirectory(prefix="irongrain-gpu-check-") as tmp:
        ctx = Context(device, sizes, Path(tmp), report)
        for name, check in CHECKS:
            if args.only and not any(name.startswith(prefix) for prefix in args.only):
                continue
            try:
                check(ctx)
            except Exception as exc:
                traceback.print_exc()
                report.fail(name, f"{type(exc).__name__}: {last_error_line(str(exc))}")
    counts = report.counts
    print(
        f"gpu_check: {counts['PASS']} PASS, {counts['FAIL']} FAIL, {counts['SKIP']} SKIP, "
        f"{counts['WARN']} WARN; elapsed {time.perf_counter() - STARTED:.1f} s"
    )
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
