"""Predict whole volumes with a trained checkpoint: ``python -m app.predict --help``.

Policies
--------
- Inputs: one volume file, or every volume file directly inside a folder (``.nii.gz``, ``.nii``,
  ``.tif``, ``.tiff``, ``.npy``; hidden files skipped), predicted in name order. Any size: a
  volume smaller than the window is padded with its own minimum and cropped back, a larger one
  is tiled.
- Preprocessing is the trainer's validation path, step for step: NaN/Inf check, per-volume
  normalisation from the checkpoint's config (``normalization``), then
  :func:`app.engine.inference.predict_logits` with the checkpoint's patch size as the window, its
  ``sw_overlap`` and ``sw_batch_size``, Gaussian blending (sigma = 1/8 of the window) and its
  mixed-precision settings; probabilities are a float32 sigmoid (:func:`app.precision.ops.sigmoid`)
  and the mask is ``probability > 0.5``, the threshold of the trainer's Dice. So for a run
  validated with ``--val-mode whole`` (the default), the Dice of these masks is the Dice the
  trainer reported. Every setting can be overridden by a flag.
- Outputs, in ``--output``: ``NAME_probs.EXT`` (float32 probabilities) and/or ``NAME_mask.EXT``
  (uint8 0/1) in the input's format and on its grid: NIfTI keeps the input's affine and header,
  TIFF its voxel size and unit (ImageJ metadata), zarr its scale and translation (an OME-Zarr
  image for an OME-Zarr input); NPY has none.
- A checkpoint trained with ``--num-classes K >= 2``: ``NAME_mask.EXT`` is the label map (uint8
  ``0..K-1``, each voxel the class of highest float32 softmax probability, as the trainer's
  per-class Dice counts it) and the probabilities are one file per class,
  ``NAME_probs_CLASS.EXT`` (float32, summing to 1 over the classes). The post-processing flags
  below are for binary masks and are refused.
- Post-processing of the mask, off by default (it did not measure better on the demo data, see
  the README): ``--min-object-size N`` removes connected objects under N voxels,
  ``--fill-holes`` fills cavities enclosed in 3D (:func:`app.analysis.masks.clean_mask`). The
  probabilities are written as predicted.
- Safety: the checkpoint, the inputs and the output folder (writable, and none of the outputs
  already there unless ``--overwrite``) are checked before anything is predicted. Each file is
  written atomically (temporary file, then rename) and nothing is ever deleted.
- A volume that cannot be read is reported and skipped; the others are still predicted and the
  command then exits with status 2, naming every such file.
- Distributed: under torchrun (``WORLD_SIZE > 1``) every rank predicts its round-robin share of
  the volumes (:func:`app.engine.validation.shard`), so each volume is predicted exactly once; rank
  0 shows the progress bar and prints the summary line.
- Exit status: 0 done; 2 a user error (the message names the file or flag); 1 anything else.

Size (over 500 lines): one command read top to bottom: the checks of the checkpoint, the inputs
and the output folder, each with its own one-line error, then the sharded prediction and its
summary; the pieces are used by this command only.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from app.analysis.cli import HelpFormatter
from app.atomic import probe_writable
from app.config import FIELDS, Config, ConfigError
from app.data.dataset import Normalization, check_finite
from app.data.volume_io import (
    EXTENSIONS,
    VolumeError,
    is_volume_file,
    read_volume,
    split_ext,
    write_volume,
)
from app.distributed import barrier, distributed_session, gather_object, reduce_tensor
from app.engine.checkpoint import CheckpointError, load_checkpoint
from app.engine.ema import inference_weights
from app.engine.inference import predict_logits
from app.engine.validation import shard
from app.labels import BINARY, LabelError, LabelScheme
from app.model import build_model, min_sizes, pool_kernels
from app.precision.amp import Precision, build_precision

log = logging.getLogger("app.predict")
SAVE_KINDS = {"probs": ("probs",), "mask": ("mask",), "both": ("probs", "mask")}


class PredictError(ValueError):
    """A user error of the prediction command; the message names the file or flag."""


class UnreadableVolumes(PredictError):
    """Some volumes were skipped; raised on every rank with the same gathered message."""


USER_ERRORS = (PredictError, CheckpointError, ConfigError, VolumeError)


# ----------------------------------------------------------------------------- the model
def checkpoint_config(state: dict[str, Any], path: Path | str) -> Config:
    """The training :class:`Config` stored in a checkpoint (unknown keys are ignored)."""
    data = state.get("config")
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: checkpoint has no config mapping")
    values = {k: v for k, v in data.items() if k in FIELDS}
    if "patch_size" in values:
        values["patch_size"] = tuple(values["patch_size"])
    try:
        return Config(**values)
    except TypeError as exc:
        raise CheckpointError(f"{path}: unusable config in checkpoint ({exc})") from exc


@dataclass
class Predictor:
    """A model ready for whole-volume inference, with the settings used for every volume."""

    model: nn.Module
    cfg: Config
    precision: Precision
    window: tuple[int, int, int]
    overlap: float
    sw_batch_size: int
    normalization: Normalization
    tta: bool = False

    def preprocess(self, raw: np.ndarray, path: Path | str) -> np.ndarray:
        """The trainer's preprocessing: NaN/Inf check, then its intensity normalisation."""
        check_finite(raw, Path(path))
        return self.normalization(raw)

    def logits(self, image: np.ndarray) -> torch.Tensor:
        """Float32 logits ``(1, 1, D, H, W)`` of a normalised ``(D, H, W)`` image."""
        return predict_logits(
            self.model,
            image,
            self.window,
            self.precision,
            self.overlap,
            self.sw_batch_size,
            "gaussian",
            self.tta,
        )

    def probabilities(self, image: np.ndarray) -> np.ndarray:
        """Float32 ``(D, H, W)`` probabilities of a normalised image (fp32 sigmoid); with
        ``--num-classes K >= 2``, ``(K, D, H, W)`` (fp32 softmax over the classes)."""
        return self.cfg.labels.probabilities(self.logits(image)).cpu().numpy()

    def describe(self) -> str:
        return (
            f"window {' '.join(map(str, self.window))}, overlap {self.overlap}, "
            f"sw batch {self.sw_batch_size}, {self.normalization.describe()}, "
            f"{self.precision.describe()}{', 8x mirror TTA' if self.tta else ''}"
        )


def check_window(window, cfg: Config, flag: str = "--window") -> tuple[int, int, int]:
    window = tuple(int(s) for s in window)
    need = min_sizes(pool_kernels(cfg.depth, cfg.pool_kernels))
    if len(window) != 3 or any(s < n for s, n in zip(window, need)):
        raise PredictError(
            f"{flag} {' '.join(map(str, window))}: needs three sizes D H W of at "
            f"least {' '.join(map(str, need))} voxels (the model has {cfg.depth} levels)"
        )
    return window  # type: ignore[return-value]


def inference_config(cfg: Config, device: torch.device, **overrides: Any) -> Config:
    """``cfg`` with the flags the user gave. A checkpoint trained with apex, predicted on a
    device without CUDA, falls back to native autocast (O2 becomes O1) unless apex was asked for.
    """
    given = {k: v for k, v in overrides.items() if v is not None}
    cfg = dataclasses.replace(cfg, **given)
    if cfg.amp_backend == "apex" and "amp_backend" not in given and device.type != "cuda":
        level = "O1" if cfg.opt_level == "O2" else cfg.opt_level
        log.info(
            "checkpoint trained with apex %s; on %s predicting with native %s",
            cfg.opt_level,
            device,
            level,
        )
        cfg = dataclasses.replace(cfg, amp_backend="native", opt_level=level, amp_dtype="auto")
    return cfg


def build_predictor(
    state: dict[str, Any],
    cfg: Config,
    device: torch.device,
    path: Path | str,
    window: tuple[int, int, int] | None = None,
    overlap: float | None = None,
    sw_batch_size: int | None = None,
    tta: bool = False,
) -> Predictor:
    """UNet3d with the checkpoint's weights on ``device``, in eval mode, under ``cfg``'s
    precision; ``None`` settings come from the checkpoint's config."""
    window = check_window(window or cfg.patch_size, cfg)
    overlap = cfg.sw_overlap if overlap is None else overlap
    if not 0.0 <= overlap < 1.0:
        raise PredictError(f"--overlap must be within [0, 1), got {overlap}")
    sw_batch_size = cfg.sw_batch_size if sw_batch_size is None else sw_batch_size
    if sw_batch_size < 1:
        raise PredictError(f"--sw-batch-size must be at least 1, got {sw_batch_size}")
    model = build_model(cfg, device)
    try:
        model.load_state_dict(inference_weights(state))
    except (RuntimeError, TypeError, AttributeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(
            f"{path}: weights do not fit UNet3d(f_maps={cfg.f_maps}, depth={cfg.depth}, "
            f"block={cfg.block}, pool_kernels={cfg.pool_kernels}) of its own config ({first})"
        ) from exc
    precision = build_precision(cfg, device)
    model = model.eval()
    initialized = precision.initialize(model, None)  # O3: half model; apex: patched functions
    model = initialized[0] if isinstance(initialized, tuple) else initialized
    try:
        normalization = Normalization.saved_in(state) or Normalization(cfg.normalization)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{path}: unusable normalization in checkpoint ({exc})") from exc
    return Predictor(model, cfg, precision, window, overlap, sw_batch_size, normalization, tta)


def load_predictor(
    checkpoint: Path | str, device: torch.device | str = "cpu", **settings: Any
) -> Predictor:
    """Checkpoint file -> :class:`Predictor` (used by ``app.analysis.report`` and tests)."""
    device = torch.device(device)
    state = load_checkpoint(checkpoint)
    cfg = inference_config(checkpoint_config(state, checkpoint), device)
    return build_predictor(state, cfg, device, checkpoint, **settings)


# ----------------------------------------------------------------------------- the files
@dataclass(frozen=True)
class Job:
    name: str
    source: Path
    outputs: dict[str, Path]  # kind ("probs" / "mask") -> path


def list_inputs(source: Path) -> list[Path]:
    if is_volume_file(source):  # a file, or one .zarr folder
        return [source]
    if source.is_dir():
        files = sorted(p for p in source.iterdir() if is_volume_file(p))
        if not files:
            raise PredictError(
                f"--input {source}: no volumes ({', '.join(EXTENSIONS)}) in this folder"
            )
        return files
    if source.is_file():
        if split_ext(source)[1] not in EXTENSIONS:
            raise PredictError(
                f"--input {source}: not a volume file; expected one of {', '.join(EXTENSIONS)}"
            )
        return [source]
    raise PredictError(f"--input {source}: no such file or folder")


def output_kinds(save: str, labels: LabelScheme) -> tuple[str, ...]:
    """The outputs of ``--save``: with K >= 2 classes, one probability map per class."""
    return labels.output_kinds(SAVE_KINDS[save])


def plan(inputs: list[Path], output: Path, save: str, labels: LabelScheme = BINARY) -> list[Job]:
    jobs, seen = [], {}
    for path in inputs:
        name, ext = split_ext(path)
        if name in seen:
            raise PredictError(
                f"--input: {path} and {seen[name]} have the same name {name!r}; "
                "their outputs and evaluation would be ambiguous"
            )
        seen[name] = path
        kinds = output_kinds(save, labels)
        jobs.append(Job(name, path, {k: output / f"{name}_{k}{ext}" for k in kinds}))
    return jobs


def check_output(output: Path, source: Path, jobs: list[Job], overwrite: bool) -> None:
    """Writable folder, not the input folder, and no output already there (unless overwrite)."""
    if source.is_dir() and output.resolve() == source.resolve():
        raise PredictError(f"--output {output}: is the input folder; choose another folder")
    try:
        probe_writable(output)
    except OSError as exc:
        raise PredictError(
            f"--output {output}: cannot write there ({exc.strerror or exc})"
        ) from exc
    if not overwrite:
        existing = [str(p) for job in jobs for p in job.outputs.values() if p.exists()]
        if existing:
            shown = "\n  ".join(existing[:10]) + ("\n  ..." if len(existing) > 10 else "")
            raise PredictError(
                f"--output {output}: {len(existing)} output file(s) already exist; "
                f"pass --overwrite to replace them, or choose another folder:\n  "
                f"{shown}"
            )


def write_outputs(
    job: Job,
    probs: np.ndarray,
    meta,
    overwrite: bool,
    min_object_size: int = 0,
    fill_holes=False,
    labels: LabelScheme = BINARY,
) -> None:
    # K >= 2: (K, D, H, W) softmax -> the label map, and each class's probabilities
    arrays = labels.output_arrays(probs, min_object_size, fill_holes)
    for kind, path in job.outputs.items():
        if not overwrite and path.exists():  # appeared since the check: never replace it
            raise PredictError(f"{path}: appeared while predicting; not replaced (use --overwrite)")
        write_volume(path, arrays[kind], meta)


# ----------------------------------------------------------------------------- the command
DESCRIPTION = """\
Segment whole volumes with a trained checkpoint, exactly as the trainer validates:
its normalisation, Gaussian-blended sliding windows of its patch size, its mixed
precision, probability > 0.5. Writes NAME_probs.EXT (float32) and/or NAME_mask.EXT
(uint8 0/1) in the input's format and on its grid (NIfTI affine and header, TIFF
voxel size and unit, zarr scale and translation).

A --num-classes K >= 2 checkpoint writes NAME_mask.EXT as a label map (uint8 0..K-1,
the class of highest softmax probability) and NAME_probs_CLASS.EXT per class.

Checks the checkpoint, the inputs and the output folder before predicting; never
replaces an existing output unless --overwrite. Under torchrun the volumes are
shared between the processes, each predicted exactly once. Exit status 2 on a user
error, including unreadable volumes (the others are still predicted)."""

EXAMPLES = """examples:
  python -m app.predict --checkpoint runs/demo/checkpoints/best.pt \\
      --input datasets/IronGrain/demo/val_patches/images --output runs/demo/predictions
  torchrun --standalone --nproc-per-node 4 -m app.predict --checkpoint best.pt \\
      --input /data/scans --output /data/masks --save mask
  python -m app.evaluate --pred runs/demo/predictions \\
      --labels datasets/IronGrain/demo/val_patches/labels --out runs/demo/predictions/eval.json
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m app.predict",
        description=DESCRIPTION,
        formatter_class=HelpFormatter,
        epilog=EXAMPLES,
    )
    parser.add_argument(
        "--checkpoint",
        type=Path,
        metavar="PATH",
        required=True,
        help="checkpoint of app.train (e.g. RUN/checkpoints/best.pt)",
    )
    parser.add_argument(
        "--input",
        type=Path,
        metavar="PATH",
        required=True,
        help=f"a volume file, or a folder of them ({', '.join(EXTENSIONS)})",
    )
    parser.add_argument(
        "--output", type=Path, required=True, metavar="DIR", help="folder for the predictions"
    )
    parser.add_argument(
        "--window",
        type=int,
        nargs=3,
        metavar=("D", "H", "W"),
        help="sliding-window size (default: the checkpoint's patch size)",
    )
    parser.add_argument(
        "--overlap",
        type=float,
        metavar="F",
        help="window overlap in [0, 1) (default: the checkpoint's sw_overlap, 0.5 unless changed)",
    )
    parser.add_argument(
        "--sw-batch-size",
        type=int,
        metavar="N",
        help="windows per forward pass (default: the checkpoint's sw_batch_size)",
    )
    parser.add_argument(
        "--tta",
        action=argparse.BooleanOptionalAction,
        help="average over the 8 mirrorings (8x slower; default: the checkpoint's tta, on for "
        "a run trained with --tta, whose eval.json scored best.pt so)",
    )
    parser.add_argument(
        "--save",
        choices=list(SAVE_KINDS),
        default="both",
        help="probabilities, binary mask (probability > 0.5) or both; for a --num-classes K "
        "checkpoint: one probability map per class, the label map 0..K-1 (argmax) or both",
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace outputs that already exist (atomically)"
    )
    parser.add_argument(
        "--min-object-size",
        type=int,
        default=0,
        metavar="N",
        help="remove connected objects under N voxels from the mask (0: keep all)",
    )
    parser.add_argument(
        "--fill-holes",
        action="store_true",
        help="fill cavities enclosed in 3D in the mask",
    )
    parser.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="auto picks CUDA when present",
    )
    parser.add_argument(
        "--amp-backend",
        choices=["native", "apex"],
        help="mixed-precision backend (default: the checkpoint's; apex falls "
        "back to native without CUDA)",
    )
    parser.add_argument(
        "--opt-level",
        choices=["O0", "O1", "O2", "O3"],
        help="O0 fp32, O1 autocast, O2 apex fp16 model, O3 pure half model "
        "(default: the checkpoint's)",
    )
    parser.add_argument(
        "--amp-dtype",
        choices=["auto", "float16", "bfloat16"],
        help="half dtype for native AMP (default: the checkpoint's; auto = "
        "float16 on CUDA, bfloat16 on CPU)",
    )
    parser.add_argument(
        "--local-rank",
        "--local_rank",
        dest="local_rank",
        type=int,
        default=-1,
        help=argparse.SUPPRESS,
    )  # the deprecated torch.distributed.launch
    return parser


def predict(args: argparse.Namespace) -> dict[str, Any]:
    """Check everything, then predict this rank's share; returns the gathered summary."""
    if args.min_object_size < 0:
        raise PredictError(f"--min-object-size must be 0 or more, got {args.min_object_size}")
    state = load_checkpoint(args.checkpoint)
    trained = checkpoint_config(state, args.checkpoint)
    try:
        cleaning = bool(args.min_object_size or args.fill_holes)
        trained.labels.check_mask_cleaning(cleaning, args.checkpoint)
    except LabelError as exc:
        raise PredictError(str(exc)) from exc
    if args.window is not None:
        check_window(args.window, trained)
    jobs = plan(list_inputs(args.input), args.output, args.save, trained.labels)
    check_output(args.output, args.input, jobs, args.overwrite)

    cfg = dataclasses.replace(trained, device=args.device, local_rank=args.local_rank)
    with distributed_session(cfg) as env:
        cfg = inference_config(
            cfg,
            env.device,
            amp_backend=args.amp_backend,
            opt_level=args.opt_level,
            amp_dtype=args.amp_dtype,
        )
        predictor = build_predictor(
            state,
            cfg,
            env.device,
            args.checkpoint,
            args.window,
            args.overlap,
            args.sw_batch_size,
            cfg.tta if args.tta is None else args.tta,
        )
        if env.is_primary:
            log.info(
                "%d volume(s) from %s on %d process(es), %s: %s",
                len(jobs),
                args.input,
                env.world_size,
                env.device,
                predictor.describe(),
            )
        barrier()  # every rank has checked the outputs before any rank writes one

        started = time.perf_counter()
        done, failed = [], []
        voxels = torch.zeros(1, dtype=torch.float64, device=env.device)
        for index in tqdm(
            shard(jobs, env),
            desc="predict",
            unit="volume",
            dynamic_ncols=True,
            disable=not env.is_primary,
        ):
            job = jobs[index]
            try:
                raw, meta = read_volume(job.source)
                image = predictor.preprocess(raw, job.source)
            except VolumeError as exc:
                log.error("%s", exc)
                failed.append(str(exc))
                continue
            write_outputs(
                job,
                predictor.probabilities(image),
                meta,
                args.overwrite,
                args.min_object_size,
                args.fill_holes,
                cfg.labels,
            )
            done.append(job.name)
            voxels += raw.size
        reduce_tensor(voxels)
        per_rank = gather_object(done)
        failures = [f for rank in gather_object(failed) for f in rank]
        elapsed = time.perf_counter() - started
        summary = {
            "volumes": len(jobs),
            "predicted": sum(len(r) for r in per_rank),
            "per_rank": [len(r) for r in per_rank],
            "failed": failures,
            "voxels": int(voxels.item()),
            "seconds": elapsed,
        }
        if env.is_primary:
            ranks = ", ".join(f"rank {r}: {n}" for r, n in enumerate(summary["per_rank"]))
            print(
                f"predicted {summary['predicted']} of {len(jobs)} volume(s) on "
                f"{env.world_size} process(es) ({ranks}) in {elapsed:.1f} s "
                f"({summary['voxels'] / max(elapsed, 1e-9) / 1e6:.2f} Mvoxel/s) -> "
                f"{args.output}",
                flush=True,
            )
        if failures:
            raise UnreadableVolumes(
                f"{len(failures)} volume(s) could not be read and were not "
                "predicted:\n" + "\n".join(failures)
            )
    return summary


def main(argv: list[str] | None = None) -> int:
    rank = int(os.environ.get("RANK", "0") or 0)
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        force=True,
        format=f"%(asctime)s %(levelname)s [rank {rank}] %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    args = build_parser().parse_args(argv)
    try:
        predict(args)
    except USER_ERRORS as exc:
        if rank == 0 or not isinstance(exc, UnreadableVolumes):  # the same list on every rank
            print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
