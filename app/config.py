"""One typed configuration: defaults < YAML file (``--config``) < command-line flags.

Every field of :class:`Config` is a flag: ``patch_size`` is ``--patch-size``. A YAML file uses
the field names (``patch_size: [32, 160, 160]``). The resolved configuration is validated once,
here, so that a bad setting fails before any process group, data or model exists, with a message
that names the flag.

Size (over 500 lines): half of it is the settings themselves, one field each with the help that
``--help`` and ``docs/configuration.md`` (``app.config_doc``) print; the rest reads and checks them.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml

from app.labels import LabelScheme, label_scheme, name_problems
from app.model import min_sizes, pool_kernels


class ConfigError(ValueError):
    """A setting is invalid; the message names the flag or file."""


def _opt(default: Any, help: str, group: str, **extra: Any) -> Any:
    meta = {"help": help, "group": group, **extra}
    if isinstance(default, (list, tuple)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class Config:
    # plan
    plan: Literal["none", "auto"] = _opt(
        "none",
        "auto: derive normalisation, norm layer, patch, batch, f_maps, depth, samples per volume, "
        "epochs, milestones and validation cadence from the data and a measured step on this "
        "device (app/plan.py); settings given in --config or as flags are kept",
        "plan",
    )
    plan_budget_s: float = _opt(900.0, "training seconds that --plan auto fills", "plan")

    # data
    data_root: str = _opt(
        "datasets/IronGrain/74x320x320",
        "root with train_patches/ and val_patches/, each holding images/ and labels/",
        "data",
    )
    patch_size: tuple[int, int, int] = _opt((32, 160, 160), "training patch D H W", "data")
    samples_per_volume: int = _opt(4, "random patches drawn from each volume per epoch", "data")
    foreground_fraction: float = _opt(
        0.33, "fraction of patches centred on a foreground voxel", "data"
    )
    normalization: Literal["zscore", "percentile", "dataset"] = _opt(
        "zscore",
        "intensity normalisation: per-volume z-score; per-volume clip to the 0.5-99.5 "
        "percentiles scaled to [0, 1]; or dataset = one clip and z-score fitted on the training "
        "set (kept in the checkpoint), for intensities that mean the same in every volume (CT)",
        "data",
    )
    augment: bool = _opt(True, "augment training patches (see --augment-level)", "data")
    augment_level: Literal["flips", "rot90", "gamma", "spatial", "basic", "full"] = _opt(
        "basic",
        "flips: random flips only; rot90: flips and quarter turns in H-W (square patches, "
        "for voxels square in-plane); gamma: flips and MONAI's gamma change; spatial: flips "
        "and MONAI rotation, scaling and elastic deformation (flips, rot90 and spatial leave "
        "intensities untouched); basic: flips, brightness/contrast, noise, blur; full: basic, "
        "spatial and gamma (app/data/augment.py)",
        "data",
    )
    num_workers: int = _opt(2, "DataLoader worker processes per training process", "data")
    data_access: Literal["memory", "mmap"] = _opt(
        "memory",
        "memory: load every volume; mmap: read training patches from disk (.npy, uncompressed "
        "TIFF; python -m app.convert makes them), for sets larger than memory; statistics and a "
        "coarse foreground index cached in OUTPUT_DIR/data_index/",
        "data",
    )

    # model
    f_maps: int = _opt(32, "feature maps of the first U-Net level (doubled at each level)", "model")
    depth: int = _opt(4, "U-Net levels, counting the bottleneck", "model")
    pool_kernels: list[int] = _opt(
        [],
        "pooling of axes D H W at each of the depth - 1 levels, 1 or 2, flattened (1 2 2 2 2 2 "
        "2 2 2: depth 4, the first level leaves D, for thick slices); none: 2 on every axis. "
        "--plan auto sets it from the voxel spacing",
        "model",
    )
    norm: Literal["batch", "instance", "group", "none"] = _opt(
        "batch",
        "normalisation layer: batch (SyncBatchNorm under DDP on CUDA); instance or group, which "
        "do not depend on the batch; or none (small batches; see README)",
        "model",
    )
    activation: Literal["relu", "leaky_relu"] = _opt(
        "relu",
        "nonlinearity after each norm: relu, or leaky_relu (slope 0.01, as nnU-Net), which keeps "
        "units alive that a ReLU with no norm layer before it can lose for good",
        "model",
    )
    init: Literal["pytorch", "he"] = _opt(
        "pytorch",
        "weight initialisation: pytorch (the layers' defaults), or he (nnU-Net's: Kaiming normal "
        "for leaky ReLU 0.01, zero biases), which keeps the signal's scale through layers that "
        "have no norm after them",
        "model",
    )
    block: Literal["plain", "residual"] = _opt(
        "plain",
        "encoder level: plain (two convolutions) or residual (the same two with a shortcut, as "
        "nnU-Net's residual-encoder U-Net); the decoder is plain either way",
        "model",
    )
    memory_format: Literal["auto", "channels_last", "contiguous"] = _opt(
        "auto",
        "weights and activations in channels_last_3d or contiguous layout; auto = measured on "
        "this machine (see --auto-probe)",
        "model",
    )
    num_classes: int = _opt(
        1,
        "1: binary (sigmoid head, BCE + Dice); K >= 2: labels are class maps 0..K-1 (0 = "
        "background), a K-channel softmax head trained with cross-entropy + Dice over the "
        "foreground classes, scored per class",
        "model",
    )
    class_names: list[str] = _opt(
        [],
        "names of the K classes of --num-classes K >= 2, background first; none: class0 ... "
        "classK-1",
        "model",
    )

    # optimisation
    epochs: int = _opt(100, "epochs to train", "optim")
    batch_size: int = _opt(8, "patches per step, per process", "optim")
    lr: float = _opt(2e-4, "Adam learning rate for one process (see --lr-scaling)", "optim")
    weight_decay: float = _opt(1e-4, "Adam weight decay", "optim")
    decoupled_weight_decay: bool = _opt(
        False,
        "decay the weights directly each step, by lr x --weight-decay (AdamW), instead of adding "
        "the decay to the gradient, where Adam's per-weight scaling cancels most of it",
        "optim",
    )
    grad_clip: float = _opt(
        0.0,
        "clip the gradients' global L2 norm to this before each step (after unscaling), as "
        "nnU-Net does (12); 0: off",
        "optim",
    )
    milestones: list[int] = _opt([25, 50, 75], "MultiStepLR milestones, in epochs", "optim")
    gamma: float = _opt(0.2, "MultiStepLR factor at each milestone", "optim")
    lr_scaling: Literal["none", "linear", "sqrt"] = _opt(
        "none", "scale --lr by world size (linear) or its square root (sqrt)", "optim"
    )
    warmup_epochs: int = _opt(0, "linear learning-rate warmup epochs before MultiStepLR", "optim")
    ema_decay: float = _opt(
        0.0,
        "keep an exponential moving average of the weights with this decay per step (e.g. "
        "0.999); validation, best.pt and app.analysis.predict then use the average; 0 = off",
        "optim",
    )
    bce_weight: float = _opt(
        1.0, "weight of the BCE term of the loss (cross-entropy with --num-classes >= 2)", "optim"
    )
    dice_weight: float = _opt(1.0, "weight of the soft Dice term of the loss", "optim")
    batch_dice: bool = _opt(
        False,
        "compute the soft Dice over each process's whole batch (nnU-Net's batch Dice) instead "
        "of per patch and averaged",
        "optim",
    )

    # mixed precision
    amp_backend: Literal["native", "apex"] = _opt(
        "native", "mixed-precision backend: torch.amp or legacy NVIDIA apex", "precision"
    )
    opt_level: Literal["auto", "O0", "O1", "O2", "O3"] = _opt(
        "auto",
        "O0 fp32, O1 autocast, O2 apex fp16 model, O3 pure half model; auto = fp32 or autocast, "
        "whichever this machine runs fastest among those its hardware computes natively",
        "precision",
    )
    amp_dtype: Literal["auto", "float16", "bfloat16"] = _opt(
        "auto",
        "half dtype of autocast; auto = a dtype this device computes natively (bf16 before "
        "fp16), measured when there are two",
        "precision",
    )
    auto_probe: bool = _opt(
        True,
        "resolve auto settings with a short measured probe of the training step (cached); "
        "--no-auto-probe decides from the hardware's capabilities alone",
        "precision",
    )
    compile: Literal["auto", "on", "off"] = _opt(
        "auto",
        "torch.compile the model for training (validation and checkpoints stay uncompiled); "
        "auto = on when the speed-up measured on this machine repays the compile time within "
        "this run's steps (cached), off for runs too short to repay it",
        "precision",
    )
    fp32_ops: list[str] = _opt(
        ["sigmoid", "softmax"], "torch functions always computed in float32", "precision"
    )

    # evaluation
    val_mode: Literal["whole", "patches"] = _opt(
        "whole",
        "validation on whole volumes with Gaussian-blended overlapping windows, or on a fixed "
        "non-overlapping patch grid that covers each volume",
        "eval",
    )
    val_every: int = _opt(
        0,
        "validate every N epochs; 0 = as often as keeps validation within --val-share of the "
        "training time, measured (the last epoch always validates)",
        "eval",
    )
    val_share: float = _opt(0.1, "share of training time that --val-every 0 allows", "eval")
    sw_overlap: float = _opt(0.5, "sliding-window overlap for --val-mode whole", "eval")
    sw_batch_size: int = _opt(2, "windows per forward pass in sliding-window inference", "eval")
    tta: bool = _opt(
        False,
        "score the final model with the logits averaged over the 8 mirrorings (8x that "
        "inference's time; nnU-Net's final validation): best.pt at the end of training and the "
        "checkpoint of --eval-only, in eval.json; app.analysis.predict then mirrors by default. "
        "Validation during training, which picks best.pt, stays unmirrored",
        "eval",
    )

    # distributed / device
    device: Literal["auto", "cpu", "cuda"] = _opt("auto", "auto picks CUDA when present", "dist")
    dist_backend: Literal["auto", "nccl", "gloo"] = _opt(
        "auto", "auto = nccl on CUDA, gloo on CPU", "dist"
    )
    dist_timeout_s: int = _opt(1800, "timeout of collective operations, in seconds", "dist")
    local_rank: int = _opt(
        -1, "set by the deprecated torch.distributed.launch; torchrun uses LOCAL_RANK", "dist"
    )

    # run
    output_dir: str = _opt("runs/irongrain", "run directory (config, metrics, checkpoints)", "run")
    seed: int = _opt(0, "seed for weights, sampling and augmentation", "run")
    resume: str = _opt(
        "auto",
        "auto: continue from OUTPUT_DIR/checkpoints/last.pt when it exists; none: start fresh "
        "(refuses a run dir that has checkpoints); or a checkpoint path",
        "run",
    )
    eval_only: bool = _opt(False, "evaluate the resumed checkpoint and exit", "run")
    log_every: int = _opt(
        20, "steps between progress-bar loss refreshes (one host sync each)", "run"
    )
    log_images: bool = _opt(True, "write slice images to TensorBoard at each validation", "run")
    checkpoint_every_min: str = _opt(
        "auto",
        "minutes between time-based mid-epoch checkpoints (last.pt, as on SIGTERM); 0: off; "
        "auto: 30 on CUDA, off on CPU",
        "run",
        minutes=True,
    )
    stop_check_every: int = _opt(
        10,
        "steps between the ranks' agreement on a stop signal (SIGTERM/SIGINT) or a due "
        "time-based checkpoint: one all-reduce of two numbers each; a signalled run stops "
        "within this many steps",
        "run",
    )

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir)

    @property
    def labels(self) -> LabelScheme:
        """The label scheme of ``--num-classes`` and ``--class-names`` (``app.labels``)."""
        return label_scheme(self.num_classes, self.class_names)

    @property
    def classes(self) -> list[str]:
        """The class names, background first; ``[]`` for the binary task."""
        return self.labels.names

    def to_dict(self) -> dict[str, Any]:
        """Plain data (lists, not tuples): safe for YAML and for ``torch.load(weights_only)``."""
        return {
            k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()
        }


FIELDS = {f.name: f for f in dataclasses.fields(Config)}
# Settings that were removed, and what to use instead: an old YAML file or flag gets this, not
# "unknown setting".
REMOVED = {
    "auto_cache": "set the IRONGRAIN_CACHE_DIR environment variable to the folder of cached "
    "auto decisions (else $XDG_CACHE_HOME/irongrain, else ~/.cache/irongrain; delete it to "
    "re-measure)",
}
RESOLVED_KEY = "resolved"
_HINTS = typing.get_type_hints(Config)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def minutes_or_auto(value: Any) -> str:
    """A setting in minutes or ``auto``, as text: a number from YAML becomes its text, and -1
    (how ``auto`` was once spelt, in the config.yaml of older runs) becomes ``auto``."""
    text = str(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value
    try:
        return "auto" if float(text) == -1 else text
    except (TypeError, ValueError):
        return text


def checkpoint_minutes(value: str) -> float | None:
    """``--checkpoint-every-min`` as minutes (``None``: auto); ValueError when it is neither."""
    value = minutes_or_auto(value)
    if value == "auto":
        return None
    minutes = float(value)
    if not minutes >= 0:
        raise ValueError(value)
    return minutes


def _coerce(name: str, value: Any, source: str) -> Any:
    """Check and convert one value (from YAML) to the field's type."""
    hint = _HINTS[name]
    if FIELDS[name].metadata.get("minutes"):
        value = minutes_or_auto(value)
    origin = get_origin(hint)
    where = f"{source}: '{name}'"
    if origin is Literal:
        if value not in get_args(hint):
            raise ConfigError(f"{where} must be one of {list(get_args(hint))}, got {value!r}")
        return value
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where} must be a list, got {value!r}")
        item_type = get_args(hint)[0]
        items = [_scalar(item_type, v, where) for v in value]
        return tuple(items) if origin is tuple else items
    return _scalar(hint, value, where)


def _scalar(kind: type, value: Any, where: str) -> Any:
    if kind is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where} must be true or false, got {value!r}")
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind is float and isinstance(value, str):
        try:  # YAML 1.1 reads 2e-4 as a string
            return float(value)
        except ValueError:
            pass
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise ConfigError(f"{where} must be {kind.__name__}, got {value!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m app.train",
        description="Train a 3D U-Net on IronGrain CT volumes (BCE+Dice, SyncBN -> AMP -> DDP).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--config", type=Path, help="YAML file of settings (field names as keys)")
    groups: dict[str, argparse._ArgumentGroup] = {}
    for name, f in FIELDS.items():
        group_name = f.metadata["group"]
        group = groups.setdefault(group_name, parser.add_argument_group(group_name))
        hint = _HINTS[name]
        origin = get_origin(hint)
        flags = [_flag(name)]
        if name == "local_rank":
            flags.append("--local_rank")  # torch.distributed.launch passes the underscore form
        kwargs: dict[str, Any] = {"help": f.metadata["help"], "default": argparse.SUPPRESS}
        if hint is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif origin is Literal:
            kwargs["choices"] = list(get_args(hint))
        elif origin is tuple:
            kwargs.update(
                type=get_args(hint)[0], nargs=len(get_args(hint)), metavar=("D", "H", "W")
            )
        elif origin is list:
            kwargs.update(type=get_args(hint)[0], nargs="*")
        elif f.metadata.get("minutes"):
            kwargs["type"] = minutes_or_auto
        else:
            kwargs["type"] = hint
        # show the real default in --help while keeping SUPPRESS, so that only flags the user
        # typed override the YAML file
        kwargs["help"] += f" (default: {show_default(f)})"
        group.add_argument(*flags, dest=name, **kwargs)
    for name in REMOVED:  # accepted, so that load_config_and_given can say what to do instead
        parser.add_argument(
            _flag(name), dest=f"removed:{name}", nargs="?", default=argparse.SUPPRESS,
            help=argparse.SUPPRESS,
        )  # fmt: skip
    return parser


def removed_settings() -> list[tuple[str, str]]:
    """(name, what to do instead) of every removed setting."""
    return list(REMOVED.items())


def removed_error(name: str, where: str) -> ConfigError:
    return ConfigError(f"{where}: {name!r} was removed; {REMOVED[name]}")


def show_default(f: dataclasses.Field) -> str:
    """A field's default as ``--help`` shows it."""
    value = f.default_factory() if f.default is dataclasses.MISSING else f.default
    if isinstance(value, (list, tuple)):
        return " ".join(map(str, value))
    return str(value)


def read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"--config {path}: cannot read ({exc.strerror})") from exc
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"--config {path}: not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(
            f"--config {path}: expected a mapping of settings, got {type(data).__name__}"
        )
    data.pop(RESOLVED_KEY, None)  # what a run's auto settings resolved to: a record, not input
    for name in sorted(set(data) & set(REMOVED)):
        if data.pop(name) not in ("", None):  # an old run's config.yaml holds the empty default
            raise removed_error(name, f"--config {path}")
    unknown = sorted(set(data) - set(FIELDS))
    if unknown:
        raise ConfigError(
            f"--config {path}: unknown setting(s) {unknown}; see --help for the names"
        )
    return {k: _coerce(k, v, f"--config {path}") for k, v in data.items()}


def load_config(argv: list[str] | None = None) -> Config:
    """Defaults < YAML < flags, then validated. Exits with a usage message on a bad flag."""
    return load_config_and_given(argv)[0]


def load_config_and_given(argv: list[str] | None = None) -> tuple[Config, frozenset[str]]:
    """:func:`load_config`, and the names of the settings given in the YAML file or as flags
    (what ``--plan auto`` must not change)."""
    parser = build_parser()
    args = vars(parser.parse_args(argv))
    config_path = args.pop("config", None)
    for key in [k for k in args if k.startswith("removed:")]:
        name = key.split(":", 1)[1]
        raise removed_error(name, _flag(name))
    values = read_yaml(config_path) if config_path else {}
    values.update(args)
    if isinstance(values.get("patch_size"), list):
        values["patch_size"] = tuple(values["patch_size"])
    cfg = Config(**values)
    validate(cfg)
    return cfg, frozenset(values)


def validate(cfg: Config) -> None:
    def need(ok: bool, name: str, what: str) -> None:
        if not ok:
            raise ConfigError(f"{_flag(name)} {what}, got {getattr(cfg, name)!r}")

    need(
        len(cfg.patch_size) == 3 and all(s > 0 for s in cfg.patch_size),
        "patch_size",
        "needs three positive sizes D H W",
    )
    for name in (
        "samples_per_volume",
        "f_maps",
        "epochs",
        "batch_size",
        "log_every",
        "sw_batch_size",
        "dist_timeout_s",
        "stop_check_every",
    ):
        need(getattr(cfg, name) >= 1, name, "must be at least 1")
    need(cfg.depth >= 2, "depth", "must be at least 2")
    for name, problem in name_problems(cfg.num_classes, cfg.class_names):
        need(False, name, problem)
    try:
        smallest = min_sizes(pool_kernels(cfg.depth, cfg.pool_kernels))
    except ValueError as exc:
        need(False, "pool_kernels", str(exc))
    need(
        all(s >= m for s, m in zip(cfg.patch_size, smallest)),
        "patch_size",
        f"must be at least {' '.join(map(str, smallest))} (D H W) for --depth {cfg.depth}"
        + (
            f" and --pool-kernels {' '.join(map(str, cfg.pool_kernels))}"
            if cfg.pool_kernels
            else ""
        ),
    )
    need(
        not cfg.augment or cfg.augment_level != "rot90" or cfg.patch_size[1] == cfg.patch_size[2],
        "patch_size",
        "must have H == W for --augment-level rot90 (quarter turns in H-W)",
    )
    need(cfg.num_workers >= 0, "num_workers", "must be 0 or more")
    need(0.0 <= cfg.foreground_fraction <= 1.0, "foreground_fraction", "must be within [0, 1]")
    need(cfg.lr > 0, "lr", "must be positive")
    need(cfg.weight_decay >= 0, "weight_decay", "must be 0 or more")
    need(cfg.grad_clip >= 0, "grad_clip", "must be 0 (off) or more")
    need(0 < cfg.gamma <= 1, "gamma", "must be within (0, 1]")
    need(
        list(cfg.milestones) == sorted(set(cfg.milestones)) and all(m > 0 for m in cfg.milestones),
        "milestones",
        "must be increasing positive epochs",
    )
    need(cfg.warmup_epochs >= 0, "warmup_epochs", "must be 0 or more")
    need(0.0 <= cfg.ema_decay < 1.0, "ema_decay", "must be within [0, 1) (0 = off)")
    need(
        cfg.bce_weight >= 0 and cfg.dice_weight >= 0 and cfg.bce_weight + cfg.dice_weight > 0,
        "bce_weight",
        "and --dice-weight must be non-negative and not both zero",
    )
    need(0.0 <= cfg.sw_overlap < 1.0, "sw_overlap", "must be within [0, 1)")
    need(cfg.plan_budget_s > 0, "plan_budget_s", "must be positive")
    need(cfg.val_every >= 0, "val_every", "must be 0 (auto) or more")
    need(
        cfg.plan != "auto" or cfg.data_access == "memory",
        "data_access",
        "mmap cannot be combined with --plan auto (the plan reads every volume whole)",
    )
    need(
        cfg.labels.lazy_labels or cfg.data_access == "memory",
        "data_access",
        "mmap reads binary labels only; use --data-access memory with --num-classes "
        f"{cfg.num_classes}",
    )
    need(
        cfg.compile != "on" or cfg.amp_backend == "native",
        "compile",
        "needs --amp-backend native (apex patches the model's functions, which torch.compile "
        "cannot trace)",
    )
    try:
        checkpoint_minutes(cfg.checkpoint_every_min)
    except ValueError:
        need(False, "checkpoint_every_min", "must be minutes (> 0), 0 (off) or auto")
    need(0 < cfg.val_share <= 1, "val_share", "must be within (0, 1]")
    need(
        cfg.resume in ("auto", "none") or Path(cfg.resume).suffix == ".pt",
        "resume",
        "must be auto, none or a .pt checkpoint path",
    )


def save_config(cfg: Config, path: Path, resolved: dict[str, Any] | None = None) -> None:
    """The settings as given, then (``resolved:``) what their ``auto`` values resolved to on this
    machine; the file can be passed back as ``--config``, which ignores the ``resolved:`` record.
    """
    from app.atomic import atomic_write_bytes

    data = cfg.to_dict()
    if resolved:
        data[RESOLVED_KEY] = resolved
    atomic_write_bytes(path, yaml.safe_dump(data, sort_keys=False).encode())
