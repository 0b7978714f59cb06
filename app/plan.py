"""A training plan from a fingerprint of the data and of the device.

    python -m app.plan --data-root DIR [--budget-s 900] [--nproc 2] [--out plan.yaml]
    python -m app.train --plan auto --data-root DIR [--plan-budget-s 900] ...

The data fingerprint (:class:`DataFingerprint`) holds the volume shapes, voxel spacing,
intensity statistics, foreground fraction and, for each intensity normalisation, the Dice of the
best intensity band on the training set: a normalisation that spreads one tissue over different
intensities in different volumes shows up there at once. The device fingerprint
(:class:`DeviceFingerprint`) holds the device type, its memory, the processes per node and a
measured training step at a reference patch.

:func:`make_plan` is a pure function of the two and the time budget, so that its choices can be
tested on fingerprints written by hand. Each choice carries a one-line reason. The plan is a YAML
file for ``--config`` (reasons as comments); ``--plan auto`` applies it inside the trainer to the
settings the user did not give.

Size (over 500 lines): the two fingerprints, the rules (each with the measurement behind it), the
refits to the measured step and epoch, and the command; splitting the rules from the reasons they
quote would make each harder to check against the other.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from app.analysis.floor import best_band
from app.config import Config, ConfigError, validate
from app.data.dataset import (
    SPLITS,
    DataError,
    Normalization,
    intensity_sample,
    load_split,
    pair_files,
)
from app.data.volume_io import VolumeError, volume_header
from app.labels import label_scheme, name_problems
from app.unet_shape import (
    ANISOTROPY,
    MIN_BOTTOM,
    depth_for,
    fit_patch,
    pooling_for,
)

log = logging.getLogger("app.plan")

REFERENCE_PATCH = (16, 64, 64)  # the patch the device's step is measured at
# A CPU step of about this long keeps ~2,700 steps per process in a 5-minute budget. On MNI152
# (README) more steps beat larger patches: 0.1 s (16x64x48) reached val Dice 0.954, 0.2 s
# (16x96x80) 0.940.
CPU_STEP_TARGET_S = 0.1
# A CPU faster than that spends its speed on more steps, not on larger patches: on MNI152 in
# 300 s, on one Intel AMX CPU (README), 16x72x56 patches at 166 samples per volume reached val
# Dice 0.963, 16x96x80 (a 0.1 s step there) at 89 only 0.954.
CPU_MAX_PATCH_VOXELS = 70_000  # 16x72x56 on MNI152 slabs, as measured
CPU_BATCH, CUDA_BATCH = 2, 8
CPU_F_MAPS, CUDA_F_MAPS = 8, 32
CPU_LR = 3e-3
CPU_GRAD_CLIP = 2.0  # the gradients' global norm, docs/results.md, "What the plan rests on"
CUDA_PATCH_VOXELS = 32 * 160 * 160  # the original recipe's patch, per 80 GB-class GPU at batch 8
COMMON_FOREGROUND = 0.05  # a foreground share of the training voxels that needs no oversampling
SMALL_BATCH = 4  # below this many patches per process, BatchNorm statistics are noisy
EPOCH_TARGET_S = {"cpu": 10.0, "cuda": 60.0}  # an epoch long enough to amortise its overheads
AUGMENT_MIN_CPU_S = 1800  # shorter CPU budgets train without intensity augmentation
# The level for data on one intensity scale (docs/results.md, MNI152): flips with uniform
# patches, flips and a mild gamma when a third of the patches are centred on rare foreground.
ONE_SCALE_AUGMENT = {"uniform": "flips", "oversampled": "gamma"}
MIN_EPOCHS = 20  # epochs a budget is cut into at least, so that the milestones mean something
VAL_SHARE = 0.1  # validation may take this share of the training time
MILESTONE_FRACTIONS = (0.6, 0.85)
CPU_GAMMA = 0.5  # MultiStepLR's factor in CPU plans, docs/results.md "What the plan rests on"
# 0.5 against 0.2 in 900 s on the Intel Xeon, seeds 0-3 and the closed mask (docs/results.md)
GAMMA_EVIDENCE = (
    "grey matter 0.9666 against 0.9662 and white matter 0.9792 against 0.9794 in the mean of "
    "four seeds, the closed mask 0.9768 against 0.9755; over the learned floor in 8 of 9 runs "
    "against 7 of 9"
)
NORMALISATION_MARGIN = 0.01  # band Dice a normalisation must gain over the per-volume z-score
# Leaky ReLU against ReLU with no norm layer, docs/results.md "What the plan rests on" (Intel Xeon)
LEAKY_EVIDENCE = (
    "grey matter best val Dice 0.9644 and 0.9659 against 0.9630 and 0.9652, white matter "
    "0.9784 and 0.9764 against 0.9780 and 0.9763, the settled level higher in all four; a "
    "closed tissue mask 0.9727 against 0.9655"
)
ENCODER_BLOCK = "residual"  # above the MNI152 floor sooner than plain, higher at 900 s (README)
# A training epoch's time per step over the probe's (data loading, worker start-up, progress),
# 2 processes on 2 cores, on the MNI152 runs of README "Quality on real data": 1.43 on an AMD
# EPYC Zen 4; 1.42-1.52 on an Intel Xeon with AMX (a 1.3 planned 10 s epochs that took 11-12 s).
STEP_OVERHEAD = 1.45
STEP_TOLERANCE = (0.8, 1.25)  # measured / planned step ratio that leaves the schedule as it is
# STEP_OVERHEAD is not every machine's: 1.2 on another Zen 4, whose 10 s epochs took 7.5-8.8 s
# and left 10-25% of the budget unused. So the trainer times a real epoch, the first warm one
# (the first also pays for cuDNN's algorithm search), and refits the epochs left to the budget.
REFIT_EPOCH = 2
EPOCH_TOLERANCE = (0.95, 1.05)  # measured / budgeted epoch ratio that leaves the epochs as they are


@dataclass
class DataFingerprint:
    train_shapes: list[tuple[int, int, int]]
    val_shapes: list[tuple[int, int, int]]
    spacing: tuple[float, float, float] | None  # median voxel size (mm) when the files say it
    intensity: dict[str, float]  # raw training intensities: p0.5, p50, p99.5, mean, std
    foreground_fraction: float
    band_dice: dict[str, float]  # normalisation -> train Dice of its best band

    @property
    def median_shape(self) -> tuple[int, int, int]:
        return tuple(int(v) for v in np.median(np.array(self.train_shapes), axis=0))

    @property
    def val_voxels(self) -> int:
        return int(sum(math.prod(s) for s in self.val_shapes))


@dataclass
class DeviceFingerprint:
    device_type: str  # "cpu" or "cuda"
    memory_gb: float
    processes: int  # training processes per node (they share its CPU cores)
    step_s: float  # one training step at REFERENCE_PATCH, CPU_BATCH or CUDA_BATCH and base f_maps
    name: str = ""


@dataclass
class Plan:
    values: dict[str, Any] = field(default_factory=dict)
    reasons: dict[str, str] = field(default_factory=dict)
    step_s: float = 0.0  # the step time the schedule assumes, at the planned patch
    # The user's values of the settings they gave: a rule that builds on a given setting (the
    # milestones on --epochs, the augmentation on --foreground-fraction) builds on theirs.
    given: dict[str, Any] = field(default_factory=dict)

    def fit_to_step(self, measured_s: float, given: frozenset[str]) -> float | None:
        """Rescale ``samples_per_volume`` when the trainer's own probe measured a step far from
        the one planned (it may pick another precision at the planned patch), so that the
        epochs still fill the budget; returns the ratio applied, or ``None``."""
        measured_s *= STEP_OVERHEAD  # the probe times bare steps, as the plan's reference was
        ratio = measured_s / self.step_s if self.step_s > 0 else 1.0
        if "samples_per_volume" in given or STEP_TOLERANCE[0] <= ratio <= STEP_TOLERANCE[1]:
            return None
        per_volume = max(1, round(self.values["samples_per_volume"] / ratio))
        self.choose(
            "samples_per_volume",
            per_volume,
            f"{self.reasons['samples_per_volume']}; scaled by 1/{ratio:.2f}: the trainer's "
            f"probe measured {measured_s / STEP_OVERHEAD:.2f} s/step",
        )
        self.step_s = measured_s
        return ratio

    def fit_to_epoch(
        self, epoch_s: float, epochs_done: int, budget_s: float, given: frozenset[str]
    ) -> float | None:
        """Rescale ``samples_per_volume`` so that the epochs left fill what is left of
        ``budget_s``, the earlier epochs counted as long as ``epoch_s``, the training time of
        the last one; returns the ratio applied, or ``None``. A given ``epochs`` or
        ``samples_per_volume`` is the user's schedule, not the budget's, and stays."""
        epochs_left = self.values["epochs"] - epochs_done
        if given & {"epochs", "samples_per_volume"} or epochs_left < 1 or epoch_s <= 0:
            return None
        budgeted_s = (budget_s - epochs_done * epoch_s) / epochs_left
        ratio = epoch_s / budgeted_s if budgeted_s > 0 else math.inf
        old = self.values["samples_per_volume"]
        per_volume = max(1, round(old / ratio))
        if EPOCH_TOLERANCE[0] <= ratio <= EPOCH_TOLERANCE[1] or per_volume == old:
            return None
        self.choose(
            "samples_per_volume",
            per_volume,
            f"{self.reasons['samples_per_volume']}; refitted after epoch {epochs_done}, which "
            f"trained in {epoch_s:.1f} s: {old} -> {per_volume}, so that {epochs_left} epochs "
            f"of about {max(budgeted_s, 0.0):.1f} s fill the {budget_s:g} s",
        )
        return ratio

    def choose(self, name: str, value: Any, reason: str) -> Any:
        """Record ``value`` for ``name`` with its reason, or the user's value where they gave
        it; returns the value the later rules build on."""
        if name in self.given and self.given[name] != value:
            value, reason = self.given[name], f"given; the plan's own: {value!r}, {reason}"
        self.values[name], self.reasons[name] = value, reason
        return value

    def to_yaml(self, header: str = "") -> str:
        import yaml

        lines = [f"# {line}" for line in header.splitlines()]
        for name, value in self.values.items():
            lines.append(f"# {self.reasons[name]}")
            lines.append(yaml.safe_dump({name: value}, default_flow_style=True).strip()[1:-1])
        return "\n".join(lines) + "\n"

    def describe(self) -> str:
        return "\n".join(f"  {k}: {v}  ({self.reasons[k]})" for k, v in self.values.items())


# ----------------------------------------------------------------------------- the rules
def make_plan(
    data: DataFingerprint,
    device: DeviceFingerprint,
    budget_s: float,
    given: dict[str, Any] | None = None,
) -> Plan:
    """The plan for ``data`` on ``device`` in ``budget_s`` of training; ``given`` holds the
    settings the user set, which the plan keeps and builds its other choices on."""
    plan = Plan(given=dict(given or {}))
    cpu = device.device_type == "cpu"

    zscore = data.band_dice.get("zscore", 0.0)
    best = max(data.band_dice, key=data.band_dice.get, default="zscore")
    if data.band_dice.get(best, 0.0) < zscore + NORMALISATION_MARGIN:
        best = "zscore"
    scores = ", ".join(f"{k} {v:.3f}" for k, v in data.band_dice.items())
    plan.choose("normalization", best, f"train Dice of the best intensity band: {scores}")
    share = data.foreground_fraction
    if share >= COMMON_FOREGROUND:
        plan.choose(
            "foreground_fraction",
            0.0,
            f"foreground is {share:.0%} of the training voxels: patches drawn uniformly see the "
            "classes in the proportions that validation and inference see (MNI152 in 300 s, "
            "mean val Dice after half the epochs: grey matter 0.9587 against 0.9543 with a third "
            "of the patches on foreground, white matter 0.9727 against 0.9696)",
        )
    else:
        plan.choose(
            "foreground_fraction",
            Config().foreground_fraction,
            f"foreground is only {share:.1%} of the training voxels: a third of the patches "
            "centred on it, as nnU-Net oversamples",
        )

    batch = plan.choose(
        "batch_size",
        CPU_BATCH if cpu else CUDA_BATCH,
        f"{CPU_BATCH if cpu else CUDA_BATCH} patches per process on {device.device_type.upper()}"
        + (": more only lengthens each step on a few cores" if cpu else ", the original recipe"),
    )
    plan.choose(
        "norm",
        "none" if batch < SMALL_BATCH else "batch",
        f"batch {batch} < {SMALL_BATCH}: BatchNorm statistics of so few patches are noisy, and a "
        "per-patch norm (instance, group) rescales each patch by its own tissue mix; no norm "
        "measured best on MNI152 (README)"
        if batch < SMALL_BATCH
        else f"batch {batch}: BatchNorm, which SyncBatchNorm converts under DDP",
    )
    if plan.values["norm"] == "none":
        plan.choose(
            "activation",
            "leaky_relu",
            "no norm layer re-centres the inputs, so a ReLU whose inputs all turn negative stays "
            "dead (MNI152: 32-61% of the channels never fired on the training slabs); leaky "
            f"ReLU 0.01 (nnU-Net's) keeps them learning (300 s, 2 seeds, run in the same hour: "
            f"{LEAKY_EVIDENCE})",
        )
    else:
        plan.choose(
            "activation",
            Config().activation,
            "a norm layer before it keeps the units alive: the original recipe's ReLU",
        )
    plan.choose(
        "lr",
        CPU_LR if cpu else Config().lr,
        "Adam at the rate configs/demo.yaml measured for small CPU batches"
        if cpu
        else "Adam at the original recipe's rate",
    )
    if cpu:
        plan.choose(
            "grad_clip",
            CPU_GRAD_CLIP,
            "Adam at 3e-3 with no norm layer spikes and can collapse; clipping the gradients' "
            "global norm at 2 touches only the tail (MNI152: the norm is 0.2-2.0 from the 10th "
            "to the 90th percentile) and keeps the rate (900 s, 2 seeds: grey matter best val Dice "
            "0.9672 and 0.9662 against 0.9659 and 0.9643; white matter 0.9805 and 0.9770 "
            "against 0.9791 and 0.9776; no collapse on a closed tissue mask)",
        )
    plan.choose(
        "f_maps",
        CPU_F_MAPS if cpu else CUDA_F_MAPS,
        "the CPU width the step was measured at (a step grows ~4x per doubling)"
        if cpu
        else "the original recipe's width, the step was measured at",
    )

    ref_voxels = math.prod(REFERENCE_PATCH)
    if cpu:
        voxels = ref_voxels * CPU_STEP_TARGET_S / device.step_s
        why = (
            f"a {device.step_s:.2f} s step at {'x'.join(map(str, REFERENCE_PATCH))} measured "
            f"here: about {voxels:,.0f} voxels per patch for a {CPU_STEP_TARGET_S} s step"
        )
        if voxels > CPU_MAX_PATCH_VOXELS:
            voxels = CPU_MAX_PATCH_VOXELS
            why += f", capped at {voxels:,} (more steps beat larger patches on CPU, README)"
    else:
        voxels = CUDA_PATCH_VOXELS * min(1.0, device.memory_gb / 80.0)
        why = f"{device.memory_gb:.0f} GB of GPU memory: up to {voxels:,.0f} voxels per patch"
    patch = fit_patch(data.median_shape, voxels)
    patch = tuple(
        plan.choose(
            "patch_size",
            list(patch),
            f"{why}, shaped like the median volume {'x'.join(map(str, data.median_shape))}",
        )
    )
    pools = pooling_for(patch, data.spacing)
    depth = len(pools) + 1 if pools else depth_for(patch)
    if pools:
        sides = "x".join(f"{s:.3g}" for s in data.spacing)
        plan.choose(
            "depth",
            depth,
            f"anisotropic voxels ({sides}): {depth - 1} poolings, each of the axes whose voxel "
            f"side is at most {ANISOTROPY:g}x the smallest so far, leaving at least "
            f"{MIN_BOTTOM} voxels (as nnU-Net)",
        )
        plan.choose(
            "pool_kernels",
            [k for kernel in pools for k in kernel],
            "per level D H W: " + ", ".join("x".join(map(str, k)) for k in pools),
        )
    else:
        plan.choose(
            "depth",
            depth,
            f"{depth - 1} poolings leave at least {MIN_BOTTOM} voxels of {min(patch)} (as "
            "nnU-Net; 2 voxels deep also hit a bf16 kernel bug, app.precision.kernel_check)",
        )
    plan.choose(
        "block",
        ENCODER_BLOCK,
        "residual encoder levels (as nnU-Net's ResEnc): on MNI152 slabs above the band floor "
        "sooner than plain ones (121 s against 221 s), and 0.0025 higher after 15 min (README)",
    )

    # The step scales about linearly with the patch's voxels (convolutions dominate).
    step_s = device.step_s * math.prod(patch) / ref_voxels * STEP_OVERHEAD
    samples = batch * device.processes
    n_train = len(data.train_shapes)
    target = min(EPOCH_TARGET_S[device.device_type], budget_s / MIN_EPOCHS)
    per_volume = max(1, round(target / step_s * samples / n_train))
    per_volume = plan.choose(
        "samples_per_volume",
        per_volume,
        f"{n_train} training volumes: an epoch of about "
        f"{per_volume * n_train / samples * step_s:.1f} s at {step_s:.2f} s/step",
    )
    epoch_s = per_volume * n_train / samples * step_s
    plan.step_s = step_s
    if plan.values["normalization"] == "dataset":
        # One intensity scale: the band is the cue and means the same in every volume, so the
        # brightness/contrast/noise/blur of basic would blur it; mirrored anatomy is what the
        # model lacks. A mild gamma (moving the band's edges) helped only while a third of the
        # patches were centred on foreground; with uniform patches it lost to flips alone on
        # grey matter (2 seeds) and gained nothing on white matter.
        plan.choose(
            "augment",
            True,
            "one intensity scale (dataset normalisation): flips, since the model overfits its "
            "training anatomy (MNI152: val Dice 0.961 with, 0.954 without in 300 s), and no "
            "brightness/contrast/noise/blur, which move voxels across the band (0.945)",
        )
        if plan.values["foreground_fraction"] == 0:
            plan.choose(
                "augment_level",
                ONE_SCALE_AUGMENT["uniform"],
                "uniform patches: flips alone, the intensities as they are (MNI152 in 900 s, "
                "2 seeds: grey matter best val Dice 0.9659 and 0.9643 against 0.9613 and 0.9615 "
                "with a mild gamma; white matter 0.9791 and 0.9776 against 0.9786, one seed)",
            )
        else:
            plan.choose(
                "augment_level",
                ONE_SCALE_AUGMENT["oversampled"],
                "a third of the patches on foreground: flips and a mild gamma (p 0.3, 0.7-1.5), "
                "which moves the band's edges as they move along z in MNI152 (EMA val Dice in "
                "900 s: 0.9618 against 0.9589 with flips alone)",
            )
    elif cpu and budget_s < AUGMENT_MIN_CPU_S:
        plan.choose(
            "augment",
            False,
            f"{budget_s:g} s on a CPU: flips, brightness/contrast, noise and blur cost more "
            "than they taught in 5 minutes (MNI152 in 300 s: val Dice 0.945 with, 0.954 "
            "without)",
        )
    else:
        plan.choose("augment", True, "flips, brightness/contrast, noise and blur")
        plan.choose("augment_level", "basic", "the default level")
    epochs = plan.choose(
        "epochs",
        max(1, int(budget_s / epoch_s)),
        f"{budget_s:g} s of training at {epoch_s:.1f} s per epoch",
    )
    milestones = sorted({max(1, round(f * epochs)) for f in MILESTONE_FRACTIONS})
    plan.choose(
        "milestones",
        milestones,
        f"MultiStepLR at {', '.join(f'{f:.0%}' for f in MILESTONE_FRACTIONS)} of the epochs",
    )
    if cpu:
        plan.choose(
            "gamma",
            CPU_GAMMA,
            "the rate halves at each milestone: level with a 0.2 factor and over the learned floor "
            f"more often (MNI152, 900 s, best val Dice {GAMMA_EVIDENCE})",
        )
    # Whole-volume inference: a forward pass only (~1/3 of a step per voxel), windows with 50%
    # overlap in-plane (~4x the voxels).
    val_s = data.val_voxels * 4 / (samples * math.prod(patch)) * step_s / 3
    every = max(1, math.ceil(val_s / (VAL_SHARE * epoch_s)))
    plan.choose(
        "val_every",
        every,
        f"validation estimated at {val_s:.1f} s: at most {VAL_SHARE:.0%} of training time "
        "(the last epoch is always validated)",
    )
    plan.choose(
        "tta",
        True,
        "best.pt scored with the 8 mirrorings at the end (as nnU-Net's final validation; one "
        "validation at 8x its cost): on MNI152 it added 0.0000-0.0022 to best.pt's val Dice, "
        "0.0008 on average, in each of 25 runs (300 and 900 s, grey and white matter)",
    )
    plan.given = {k: v for k, v in plan.given.items() if k in plan.values}  # the checkpoint's
    return plan


# ----------------------------------------------------------------------------- fingerprints
def data_fingerprint(root: Path | str, num_classes: int = 1) -> DataFingerprint:
    """Read the training split (raw), and the validation split's shapes from the headers; with
    ``num_classes`` >= 2 the figures are of the union of the foreground classes."""
    root = Path(root)
    train = load_split(root, "train", "raw", num_classes=num_classes)
    images = [vol.image for vol in train]
    labels = [label_scheme(num_classes).foreground(vol.label) for vol in train]
    headers = [volume_header(vol.image_path) for vol in train]
    spacings = [spacing for _, spacing in headers if spacing is not None]
    val_shapes = [volume_header(image)[0] for _, image, _ in pair_files(root / SPLITS["val"])]
    sample = intensity_sample(images)
    low, mid, high = np.percentile(sample, (0.5, 50, 99.5))
    band_dice = {}
    for mode in ("zscore", "percentile", "dataset"):
        normalize = Normalization.fit(mode, images)
        band_dice[mode] = best_band([normalize(im) for im in images], labels).train_dice
    return DataFingerprint(
        train_shapes=[tuple(im.shape) for im in images],
        val_shapes=val_shapes,
        spacing=tuple(float(v) for v in np.median(spacings, axis=0)) if spacings else None,
        intensity={
            "p0.5": float(low),
            "p50": float(mid),
            "p99.5": float(high),
            "mean": float(sample.mean()),
            "std": float(sample.std()),
        },
        foreground_fraction=float(sum(lb.sum() for lb in labels) / sum(lb.size for lb in labels)),
        band_dice=band_dice,
    )


def device_fingerprint(device: torch.device, processes: int) -> DeviceFingerprint:
    """The device, its memory and the training step at :data:`REFERENCE_PATCH`, timed by the
    precision and memory-format probe (``app.precision.auto``) in its fastest setting, as training
    will run it. No collective: under ``--plan auto`` only rank 0 plans."""
    import os

    from app.distributed import DistEnv
    from app.precision import auto as autotune
    from app.precision.hardware import detect

    cpu = device.type == "cpu"
    if cpu:
        memory_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    else:
        memory_gb = torch.cuda.get_device_properties(device).total_memory / 2**30
    batch = CPU_BATCH if cpu else CUDA_BATCH
    cfg = Config(
        patch_size=REFERENCE_PATCH,
        batch_size=batch,
        f_maps=CPU_F_MAPS if cpu else CUDA_F_MAPS,
        depth=depth_for(REFERENCE_PATCH),
        norm="none" if batch < SMALL_BATCH else "batch",
        block=ENCODER_BLOCK,
        device=device.type,
    )
    caps = detect(device)
    cands, _ = autotune.candidates(cfg, caps)
    threads = torch.get_num_threads()
    if cpu and processes > 1:  # measure as each of the processes will run: its share of cores
        torch.set_num_threads(max(1, threads // processes))
    try:
        timings = autotune.probe(cfg, DistEnv(0, 0, 1, device), cands)
    finally:
        torch.set_num_threads(threads)
    picked = autotune.pick(cands, timings)
    if picked is None:
        raise DataError(f"could not time a training step on {caps.describe()}: {timings}")
    step_s = timings[picked[0].label]["ms"] / 1000.0
    name = f"{caps.describe()}, timed as {picked[0].label}"
    return DeviceFingerprint(device.type, memory_gb, processes, step_s, name)


# ----------------------------------------------------------------------------- the trainer
def apply_plan(cfg: Config, given: set[str], plan: Plan) -> Config:
    """``cfg`` with the plan's values for every setting not in ``given``."""
    import dataclasses

    values = {k: v for k, v in plan.values.items() if k not in given}
    if "depth" in given and len(values.get("pool_kernels", [])) != 3 * (cfg.depth - 1):
        values.pop("pool_kernels", None)  # the plan's pooling is for its own depth
    if "patch_size" in values:
        values["patch_size"] = tuple(values["patch_size"])
    planned = dataclasses.replace(cfg, **values)
    validate(planned)
    return planned


def plan_for(cfg: Config, given: frozenset[str], device: torch.device, processes: int) -> Plan:
    """The plan for ``cfg``'s data on ``device``, built on the settings in ``given``."""
    data = data_fingerprint(cfg.data_root, cfg.num_classes)
    fixed = {name: value for name, value in cfg.to_dict().items() if name in given}
    return make_plan(data, device_fingerprint(device, processes), cfg.plan_budget_s, fixed)


def main(argv: list[str] | None = None) -> int:
    from app.atomic import atomic_write_bytes
    from app.distributed import resolve_device
    from app.precision.hardware import machine_line

    parser = argparse.ArgumentParser(prog="python -m app.plan", description=__doc__.split("\n")[0])
    parser.add_argument("--data-root", required=True, type=Path)
    parser.add_argument("--budget-s", type=float, default=900.0, help="training seconds to fill")
    parser.add_argument("--nproc", type=int, default=1, help="training processes per node")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument(
        "--num-classes",
        type=int,
        default=1,
        help="labels are class maps 0..K-1 (K >= 2); the figures are of their union foreground",
    )
    parser.add_argument("--out", type=Path, help="write the plan here (default: print it)")
    args = parser.parse_args(argv)
    if args.budget_s <= 0 or args.nproc < 1 or name_problems(args.num_classes, ()):
        print(
            "error: --budget-s must be positive, and --nproc and --num-classes at least 1",
            file=sys.stderr,
        )
        return 2
    try:
        device = resolve_device(args.device, 0)
        data = data_fingerprint(args.data_root, args.num_classes)
        hardware = device_fingerprint(device, args.nproc)
    except (ConfigError, DataError, VolumeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    plan = make_plan(data, hardware, args.budget_s)
    header = (
        f"plan for {args.data_root}, {args.budget_s:g} s of training, {args.nproc} process(es)\n"
        f"{machine_line(device)}\n"
        f"data: {len(data.train_shapes)} train volumes, median {data.median_shape}, "
        f"foreground {data.foreground_fraction:.1%}, spacing {data.spacing}\n"
        f"device: {hardware.step_s:.3f} s/step at {'x'.join(map(str, REFERENCE_PATCH))} "
        f"({hardware.name})\n"
        f"use: python -m app.train --config THIS_FILE --data-root {args.data_root}"
        + label_scheme(args.num_classes).train_flags
    )
    text = plan.to_yaml(header)
    if args.out:
        atomic_write_bytes(args.out, text.encode())
        print(f"wrote {args.out}")
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
