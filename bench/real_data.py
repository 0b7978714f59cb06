"""Quality on real data: the MNI152 2009 T1 template as a segmentation task, and a training run
timed against its classical floor. A benchmark, not a test.

    python bench/real_data.py write --out datasets/MNI152/t1-gm [--tissue gm|wm]
    python bench/real_data.py floor --data datasets/MNI152/t1-gm
    python bench/real_data.py train --data datasets/MNI152/t1-gm --budget-s 300 [trainer flags]
    python bench/real_data.py plot --run RUN_DIR --data datasets/MNI152/t1-gm --plot curve.png
    python bench/real_data.py summary RUN_DIR [RUN_DIR ...] --floor 0.9654

``write`` takes nilearn's packaged template (``load_mni152_template(resolution=1)``: the
skull-stripped ICBM152 2009a symmetric T1 at 1 mm, 197x233x189, scaled to [0, 1]; no download)
and its grey-matter probability map (``load_mni152_gm_template``, same grid). The task: label =
GM probability > 0.5. ``--tissue wm`` writes the white-matter task instead
(``load_mni152_wm_template``): a second real task, of another kind (one threshold on T1 is
already a strong floor there, where grey matter needs a band). ``--tissue gm-mask`` and
``wm-mask`` label nilearn's tissue masks (``load_mni152_gm_mask``: probability > 0.2, closed
by 2 iterations of binary closing): a label that is not a function of the voxel's own intensity,
where a band is a weak floor and filters at a few voxels' scale a strong one. The volume is
reoriented to (D, H, W) = (superior, anterior, right), so the trainer's patch depth runs along z,
and cropped to the bounding box of the brain (the template is zero outside it). The inferior
half of z trains and the superior half validates, each cut into ``--slabs`` slabs along z, one
file per slab:

    OUT/train_patches/{images,labels}/mni152_z000_019.nii.gz ...  (inferior half)
    OUT/val_patches/{images,labels}/mni152_z077_096.nii.gz ...    (superior half)

Each slab keeps its position in the affine. ``write`` (and ``floor``) then print the classical
floor (``app.analysis.floor``: best threshold and best band picked on train, scored on val, and
Otsu) on the images as the trainer normalises them (per volume, ``zscore`` by default, and
``percentile``) and on the raw intensities.

``train`` runs the trainer (``python -m app.train``, or ``launch.sh`` with ``--nproc N``) with
the given trainer flags and a large ``--epochs`` unless one (or ``--plan``) is given, reads its
``metrics.jsonl`` as it grows, and stops the process group once the cumulative training time
(``train_time_s``; ``epoch_time_s``, which includes validation, where a record lacks it) reaches
``--budget-s`` (checked at each epoch's record, so the last epoch may overrun it). It prints one
row per epoch (cumulative training seconds, epoch, val Dice, the floor) and when the model's Dice
first beat the floor; ``--plot PATH`` draws Dice against training seconds. The floor is the val
Dice of the better band rule: on the images as the trainer normalises them, or on the raw
intensities (a classical rule is free to use those). The trainer's output goes to
``RUN_DIR/real_data_trainer.log``. Works on any data root, not only the MNI152 task. ``plot``
draws a run's curve again from its ``metrics.jsonl`` (up to ``--budget-s``). The plot has two
panels: the whole run, and the same around the band floor, where the margin can be read.
``--feature-floor`` (``train`` and ``plot``) adds the learned classical floor of
``app.analysis.learned_floor`` (trees on multi-scale filters; fitted after the run, so that it
does not share the cores with the trainer): printed, and drawn beside the band. ``train`` writes
it to the run's ``learned_floor.json``, which ``plot`` (without ``--feature-floor``) and
``summary`` then read instead of fitting it again.

``summary`` sets runs side by side, one row each, since a 300 s run's best is mostly where its
noise lands and an arm is judged over several seeds: the best val Dice and when, the settled
level (the mean val Dice over the second half of the epochs), the mean of the last 10
validations, the patches trained, ``eval.json`` (``best.pt`` mirrored) and the run's score
(mirrored where there is one) against the learned floor: ``--floor``, or each run's
``learned_floor.json`` (``python -m app.learned_floor --run``). Under the rows: their means, and
how many runs came within ``--within`` (0.003) of the floor.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from app.analysis.floor import Floors, floors_from_volumes  # noqa: E402
from app.data.dataset import SPLITS, load_train_val  # noqa: E402
from app.data.volume_io import VolumeMeta, is_volume_file, write_volume  # noqa: E402

NAME_PREFIX = "mni152_z"
PROBABILITY_THRESHOLD = 0.5  # label = tissue probability above this
# label source per --tissue: a probability map (label = probability > 0.5), or nilearn's binary
# tissue mask (its defaults: probability > 0.2, then a binary closing of 2 iterations)
TISSUES = {
    "gm": "load_mni152_gm_template",
    "wm": "load_mni152_wm_template",
    "gm-mask": "load_mni152_gm_mask",
    "wm-mask": "load_mni152_wm_mask",
}
AXES = ("S", "A", "R")  # array axes after reorientation: (D, H, W) = (z, y, x)
DEFAULT_EPOCHS = 100_000  # "until stopped": the budget ends the run
STOP_GRACE_S = 20  # after SIGTERM, before SIGKILL


# --------------------------------------------------------------------------------------------
# write
# --------------------------------------------------------------------------------------------
def load_template(stride: int = 1, tissue: str = "gm"):
    """(T1 image, ``tissue`` probability image) on one grid, reoriented to ``AXES``, cropped to the
    brain's bounding box, and subsampled by ``stride`` (for tests; 1 = the full 1 mm grid);
    then the crop box and the stored shape and orientation."""
    import nibabel as nib
    from nilearn import datasets

    t1 = datasets.load_mni152_template(resolution=1)
    tissue_map = getattr(datasets, TISSUES[tissue])(resolution=1)
    stored = f"{'x'.join(map(str, t1.shape))} stored as {','.join(nib.aff2axcodes(t1.affine))}"
    if t1.shape != tissue_map.shape or not np.allclose(t1.affine, tissue_map.affine):
        from nilearn.image import resample_to_img

        tissue_map = resample_to_img(
            tissue_map, t1, interpolation="continuous", force_resample=True
        )
    # find z from the affine rather than assuming the stored order
    transform = nib.orientations.ornt_transform(
        nib.orientations.io_orientation(t1.affine), nib.orientations.axcodes2ornt(AXES)
    )
    t1, tissue_map = t1.as_reoriented(transform), tissue_map.as_reoriented(transform)
    # the skull-stripped template is exactly 0 outside the brain: crop that margin away
    inside = np.argwhere(np.asarray(t1.dataobj) > 0)
    lo, hi = inside.min(0), inside.max(0) + 1
    box = tuple(slice(int(a), int(b), stride) for a, b in zip(lo, hi))
    return t1.slicer[box], tissue_map.slicer[box], (lo, hi), stored


def slab_bounds(start: int, stop: int, slabs: int) -> list[tuple[int, int]]:
    edges = np.linspace(start, stop, slabs + 1).round().astype(int)
    return [(int(a), int(b)) for a, b in itertools.pairwise(edges) if b > a]


def clear_output(out: Path, overwrite: bool) -> None:
    """Refuse to mix with volumes already there, unless ``--overwrite`` (ours only go)."""
    folders = [out / SPLITS[s] / kind for s in ("train", "val") for kind in ("images", "labels")]
    existing = [p for f in folders if f.is_dir() for p in sorted(f.iterdir()) if is_volume_file(p)]
    ours = [p for p in existing if p.name.startswith(NAME_PREFIX)]
    others = [p for p in existing if not p.name.startswith(NAME_PREFIX)]
    if others:
        raise SystemExit(f"error: {others[0]} (and {len(others) - 1} more) would mix with the task")
    if ours and not overwrite:
        raise SystemExit(f"error: {out} already holds a task ({ours[0].name}, ...); --overwrite")
    for path in ours:
        path.unlink()
    for folder in folders:
        folder.mkdir(parents=True, exist_ok=True)


def write_task(out: Path, slabs: int, stride: int, overwrite: bool, tissue: str = "gm") -> dict:
    """Write the slabs; returns what was written, for the report."""
    t1, tissue_map, (lo, hi), stored = load_template(stride, tissue)
    clear_output(out, overwrite)
    depth = t1.shape[0]
    half = depth // 2
    written: dict[str, list] = {"train": [], "val": []}
    # z grows superior (AXES[0] == "S"): the low half is inferior
    for split, (start, stop) in (("train", (0, half)), ("val", (half, depth))):
        for z0, z1 in slab_bounds(start, stop, slabs):
            image = t1.slicer[z0:z1]
            probability = np.asarray(tissue_map.slicer[z0:z1].dataobj)
            label = (probability > PROBABILITY_THRESHOLD).astype(np.uint8)
            data = np.asarray(image.dataobj, dtype=np.float32)
            meta = VolumeMeta(".nii.gz", affine=image.affine)
            name = f"{NAME_PREFIX}{z0:03d}_{z1:03d}.nii.gz"
            write_volume(out / SPLITS[split] / "images" / name, data, meta)
            write_volume(out / SPLITS[split] / "labels" / name, label, meta)
            written[split].append((name, data.shape, float(label.mean())))
    return {
        "stored": stored,
        "cropped_shape": t1.shape,
        "crop_lo": lo.tolist(),
        "crop_hi": hi.tolist(),
        "voxel_mm": [float(z) for z in t1.header.get_zooms()[:3]],
        "written": written,
    }


# --------------------------------------------------------------------------------------------
# floor
# --------------------------------------------------------------------------------------------
def data_floors(root: Path, normalization: str) -> Floors:
    """The floor of the task as the trainer sees it (``raw``: the files' own intensities)."""
    return floors_from_volumes(*load_train_val(root, normalization)[:2])


def print_floors(
    root: Path, modes: Sequence[str] = ("zscore", "percentile", "dataset", "raw")
) -> dict:
    print("classical floor: rule picked on train (global Dice), scored on val (global Dice)")
    found = {}
    for mode in modes:
        started = time.perf_counter()
        floors = data_floors(root, mode)
        found[mode] = floors.to_dict()
        print(f"  images {mode} ({time.perf_counter() - started:.1f} s):")
        for line in floors.describe().splitlines():
            print(f"    {line}")
    return found


# --------------------------------------------------------------------------------------------
# train
# --------------------------------------------------------------------------------------------
def machine_header() -> str:
    import torch

    from app.precision.hardware import cpu_info

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"
    return (
        f"machine: {cpu_info()[0]}, {os.cpu_count()} logical CPUs, {gpu}; "
        f"torch {torch.__version__}, Python {sys.version.split()[0]}"
    )


def has_flag(args: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def read_records(path: Path) -> list[dict]:
    """Complete lines only: the trainer may be halfway through writing the last one."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    lines = text.split("\n")[:-1]  # whatever follows the last newline is still being written
    return [json.loads(line) for line in lines if line.strip()]


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the trainer's process group (torchrun, ranks, DataLoader workers), then
    SIGKILL whatever is left after ``STOP_GRACE_S``."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def trainer_command(nproc: int, trainer_args: list[str]) -> tuple[list[str], dict[str, str]]:
    env = dict(os.environ, NO_ALBUMENTATIONS_UPDATE="1", PYTHONUNBUFFERED="1")
    if nproc == 1:
        return [sys.executable, "-m", "app.train", *trainer_args], env
    env.update(NPROC_PER_NODE=str(nproc), PYTHON=sys.executable)
    return ["bash", str(ROOT / "launch.sh"), *trainer_args], env


def plot_curve(
    path: Path,
    rows: list[tuple],
    floors: Floors,
    mode: str,
    budget_s: float,
    title: str,
    feature_floor: float | None = None,
    mirrored: tuple[float, float] | None = None,
) -> None:
    """``mirrored``: (training seconds, Dice) of best.pt scored with mirroring, a star."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [(t, d) for t, _, d in rows if d is not None]
    # left: the whole run; right: the same around the band floor, where the margin is read
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), dpi=120)
    band = floors.band.val_dice
    best = max((d for _, d in points), default=band)
    top = max(best, band, feature_floor or 0.0, mirrored[1] if mirrored else 0.0)
    for ax, low in zip(axes, (0.0, band - 0.03)):
        if points:
            ax.plot(*zip(*points), marker="o", ms=3, label="model, val Dice (global)")
        ax.axhline(band, color="tab:red", ls="--", label=f"band floor ({mode} images) {band:.3f}")
        ax.axhline(
            floors.threshold.val_dice,
            color="tab:gray",
            ls=":",
            label=f"threshold floor ({mode} images) {floors.threshold.val_dice:.3f}",
        )
        if mirrored:
            ax.plot(
                *mirrored,
                marker="*",
                ms=10,
                ls="none",
                color="tab:purple",
                label=f"best.pt with the 8 mirrorings {mirrored[1]:.4f}",
            )
        if feature_floor is not None:
            ax.axhline(
                feature_floor,
                color="tab:green",
                ls="-.",
                label=f"feature floor (trees on filters, {mode} images) {feature_floor:.3f}",
            )
        ax.axvline(budget_s, color="k", lw=0.8, alpha=0.4)
        ax.set_xlabel("cumulative training time (s)")
        ax.set_ylabel("validation Dice")
        ax.set_ylim(low, 1.0 if low == 0.0 else min(1.0, top + 0.01))
        ax.grid(alpha=0.3)
    axes[0].legend(loc="lower right", fontsize=8)
    axes[1].set_title(f"around the band floor (best {best:.4f})", fontsize=8)
    fig.suptitle(textwrap.fill(title, 140), fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


@dataclass
class Progress:
    """The run so far, one metrics.jsonl record at a time."""

    floor: float
    rows: list[tuple[float, int, float | None]] = field(default_factory=list)  # (s, epoch, dice)
    train_s: float = 0.0
    first_beat: tuple[float, int, float] | None = None
    counts_validation: bool = False  # a record without train_time_s: epoch_time_s was used

    def add(self, record: dict) -> str:
        """Account one epoch; returns its table row."""
        if "train_time_s" in record:
            self.train_s += record["train_time_s"]
        else:
            self.train_s += record["epoch_time_s"]
            self.counts_validation = True
        dice = record.get("dice")  # absent on epochs that --val-every skips
        self.rows.append((self.train_s, record["epoch"], dice))
        if dice is not None and dice > self.floor and self.first_beat is None:
            self.first_beat = (self.train_s, record["epoch"], dice)
        shown = "-" if dice is None else f"{dice:.4f}"
        margin = "" if dice is None else f"{dice - self.floor:+.4f}"
        mark = "" if "train_time_s" in record else "  (epoch_time_s)"
        epoch = record["epoch"]
        return f"{self.train_s:9.1f} {epoch:6d} {shown:>9} {self.floor:7.4f} {margin:>8}{mark}"


def watch(
    proc: subprocess.Popen,
    metrics: Path,
    progress: Progress,
    budget_s: float,
    wall_limit_s: float,
    poll_s: float,
) -> str:
    """Follow ``metrics`` until the training budget is spent, the trainer exits or the wall
    limit passes; returns which. The trainer is left running (the caller stops it)."""
    started = time.monotonic()
    while True:
        exited = proc.poll() is not None  # before reading: its last record is then in the file
        for record in read_records(metrics)[len(progress.rows) :]:
            print(progress.add(record), flush=True)
            if progress.train_s >= budget_s:
                return f"budget of {budget_s:g} s of training reached"
        if exited:
            return f"trainer exited with code {proc.returncode}"
        if time.monotonic() - started > wall_limit_s:
            return f"wall limit of {wall_limit_s:g} s reached"
        time.sleep(poll_s)


def mirrored_report(run_dir: Path) -> dict | None:
    """The run's ``eval.json`` when it holds a mirrored score (``"tta": true``), else ``None``."""
    try:
        report = json.loads((run_dir / "eval.json").read_text())
    except (OSError, ValueError):
        return None
    return report if isinstance(report, dict) and report.get("tta") else None


def mirrored_score(run_dir: Path, nproc: int, trainer_args: list[str]) -> dict | None:
    """``--tta`` (the plan sets it): ``best.pt`` scored with the 8 mirrorings, from the
    ``eval.json`` that the trainer writes when it ends by itself; for a run that the budget
    stopped first, from the trainer's own ``--eval-only`` of ``best.pt``. ``None`` without."""
    import yaml

    best = run_dir / "checkpoints" / "best.pt"
    if mirrored_report(run_dir) is None:
        try:
            tta = yaml.safe_load((run_dir / "config.yaml").read_text()).get("tta", False)
        except (OSError, AttributeError, yaml.YAMLError):
            tta = False
        if not tta or not best.is_file():
            return None
        # the last --resume wins: best.pt instead of the run's "none"
        command, env = trainer_command(nproc, [*trainer_args, "--eval-only", "--resume", str(best)])
        with open(run_dir / "real_data_eval.log", "wb") as log:
            subprocess.run(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    return mirrored_report(run_dir)


@dataclass
class RunSummary:
    """One run's figures for ``summary``, from its metrics.jsonl and eval.json."""

    name: str
    epochs: int
    train_s: float
    patches: float
    best: float
    best_s: float
    settled: float  # mean val Dice over the second half of the epochs
    last10: float
    mirrored: float | None
    floor: float | None

    @property
    def score(self) -> float:
        """What the run reports: best.pt mirrored where it was, else the best validation."""
        return self.best if self.mirrored is None else self.mirrored


def summarize_run(run_dir: Path, budget_s: float, floor: float | None) -> RunSummary:
    """``run_dir``'s figures up to ``budget_s`` of training; ``floor``, else its
    learned_floor.json, else none. Raises ValueError naming the run when it has no validation."""
    from app.analysis.report import learned_floor_dice

    records = read_records(run_dir / "metrics.jsonl")
    progress = Progress(0.0)
    patches = 0.0
    for record in (r for r in records if "epoch" in r):
        if progress.train_s >= budget_s:
            break
        progress.add(record)
        patches += record.get("samples_per_s", 0.0) * record.get("train_time_s", 0.0)
    validated = [(s, epoch, dice) for s, epoch, dice in progress.rows if dice is not None]
    if not validated:
        raise ValueError(f"{run_dir / 'metrics.jsonl'}: no validation recorded")
    best_s, _, best = max(validated, key=lambda row: row[2])
    last_epoch = progress.rows[-1][1]
    second_half = [dice for _, epoch, dice in validated if epoch > last_epoch / 2]
    scored = mirrored_report(run_dir)
    return RunSummary(
        name=run_dir.name,
        epochs=last_epoch,
        train_s=progress.train_s,
        patches=patches,
        best=best,
        best_s=best_s,
        settled=float(np.mean(second_half or [validated[-1][2]])),
        last10=float(np.mean([dice for _, _, dice in validated[-10:]])),
        mirrored=scored["dice"] if scored else None,
        floor=floor if floor is not None else learned_floor_dice(run_dir),
    )


def summary(args: argparse.Namespace) -> int:
    runs = [Path(run) for run in args.runs]
    missing = [str(run) for run in runs if not (run / "metrics.jsonl").is_file()]
    if missing:
        print(
            f"error: no metrics.jsonl in {', '.join(missing)}: summary takes trainers' run dirs",
            file=sys.stderr,
        )
        return 2
    try:
        rows = [summarize_run(run, args.budget_s, args.floor) for run in runs]
    except ValueError as exc:  # also report.ReportError (an unreadable learned_floor.json)
        print(f"error: {exc}", file=sys.stderr)
        return 2
    width = max(len("mean"), *(len(row.name) for row in rows))
    print(
        f"{'run':<{width}} {'epochs':>6} {'train s':>7} {'patches':>7} {'best':>7} {'at s':>6} "
        f"{'settled':>7} {'last 10':>7} {'eval.json':>9} {'floor':>7} {'gap':>8}"
    )

    def figure(value: float | None, spec: str = ".4f") -> str:
        return "-" if value is None else format(value, spec)

    for row in rows:
        gap = None if row.floor is None else row.score - row.floor
        print(
            f"{row.name:<{width}} {row.epochs:>6d} {row.train_s:>7.0f} {row.patches / 1000:>6.1f}k "
            f"{row.best:>7.4f} {row.best_s:>6.0f} {row.settled:>7.4f} {row.last10:>7.4f} "
            f"{figure(row.mirrored):>9} {figure(row.floor):>7} {figure(gap, '+.4f'):>8}"
        )
    mirrored = [row.mirrored for row in rows if row.mirrored is not None]
    print(
        f"{'mean':<{width}} {'':>6} {'':>7} {'':>7} {np.mean([r.best for r in rows]):>7.4f} "
        f"{'':>6} {np.mean([r.settled for r in rows]):>7.4f} "
        f"{np.mean([r.last10 for r in rows]):>7.4f} "
        f"{figure(float(np.mean(mirrored)) if len(mirrored) == len(rows) else None):>9}"
    )
    judged = [row for row in rows if row.floor is not None]
    if judged:
        near = sum(row.score >= row.floor - args.within for row in judged)
        above = sum(row.score > row.floor for row in judged)
        print(
            f"within {args.within} of the learned floor: {near} of {len(judged)} runs; "
            f"above it: {above} (score: eval.json where there is one, else the best)"
        )
    return 0


def run_normalization(run_dir: Path, default: str) -> str:
    """The normalisation the trainer used, from its config.yaml (``--plan auto`` may set it)."""
    import yaml

    try:
        return yaml.safe_load((run_dir / "config.yaml").read_text())["normalization"]
    except (OSError, KeyError, TypeError, yaml.YAMLError):
        return default


def floors_to_beat(data: Path, normalization: str) -> tuple[dict[str, Floors], str]:
    """The floors on the trainer's normalised images and on the raw ones, and which of the two
    holds the floor to beat: a classical rule may use the raw intensities, so it is the better
    band (per-volume z-scores of slabs with different brain fractions do not share one band;
    raw intensities do)."""
    candidates = {mode: data_floors(data, mode) for mode in (normalization, "raw")}
    return candidates, max(candidates, key=lambda mode: candidates[mode].band.val_dice)


def feature_floor_dice(data: Path, normalization: str, run_dir: Path | None = None) -> float:
    """The learned classical floor of ``app.analysis.learned_floor`` (about a minute on
    MNI152); with ``run_dir``, also written to its ``learned_floor.json``, as ``python -m
    app.learned_floor --run`` writes it, so that ``plot`` and ``summary`` need not fit it again."""
    from app.analysis.learned_floor import SAMPLES_PER_VOLUME, Settings, fit_and_record

    settings = Settings(
        data_root=data,
        normalization=normalization,
        seed=0,
        leave_one_out=False,
        samples_per_volume=SAMPLES_PER_VOLUME,
        run_dir=run_dir,
    )
    found, _, record, _ = fit_and_record(settings)
    print(
        f"feature floor (app.learned_floor, {normalization} images, "
        f"{record['seconds']['total']:.0f} s): val Dice {found.val_dice:.4f}"
    )
    return found.val_dice


def replot(args: argparse.Namespace) -> int:
    """The plot of a run that ``train`` watched (or any run dir), again, up to ``--budget-s``;
    the learned floor from the run's ``learned_floor.json``, or fitted with ``--feature-floor``."""
    from app.analysis.report import learned_floor_dice

    metrics = Path(args.run) / "metrics.jsonl"
    if not metrics.is_file():
        print(f"error: {metrics} does not exist: --run takes a trainer's run dir", file=sys.stderr)
        return 2
    normalization = run_normalization(Path(args.run), "zscore")
    candidates, floor_mode = floors_to_beat(Path(args.data), normalization)
    progress = Progress(candidates[floor_mode].band.val_dice)
    for record in read_records(metrics):
        if progress.train_s >= args.budget_s:
            break
        progress.add(record)
    title = args.title or f"{args.data} ({normalization}): {args.run}"
    budget_s = args.budget_s if math.isfinite(args.budget_s) else progress.train_s
    floors = candidates[floor_mode]
    if args.feature_floor:
        learned = feature_floor_dice(Path(args.data), floor_mode)
    else:  # the one train --feature-floor or app.learned_floor --run wrote, if any
        try:
            learned = learned_floor_dice(Path(args.run))
        except ValueError as exc:  # report.ReportError: an unreadable learned_floor.json
            print(f"error: {exc}", file=sys.stderr)
            return 2
    scored = mirrored_report(Path(args.run))
    mirrored = (progress.train_s, scored["dice"]) if scored else None
    plot_curve(
        Path(args.plot), progress.rows, floors, floor_mode, budget_s, title, learned, mirrored
    )
    print(f"plot: {args.plot} ({len(progress.rows)} epochs, {progress.train_s:.1f} s of training)")
    return 0


def train(args: argparse.Namespace, trainer_args: list[str]) -> int:
    from app.config import ConfigError, load_config

    run_dir = Path(args.output_dir or f"runs/real_data/{time.strftime('%Y%m%d-%H%M%S')}")
    user_args = " ".join(trainer_args) or "(trainer defaults)"
    trainer_args = [*trainer_args, "--data-root", str(args.data), "--output-dir", str(run_dir)]
    if not has_flag(trainer_args, "--epochs") and not has_flag(trainer_args, "--plan"):
        trainer_args += ["--epochs", str(DEFAULT_EPOCHS)]  # --plan auto fills its budget itself
    if not has_flag(trainer_args, "--resume"):
        trainer_args += ["--resume", "none"]  # a benchmark starts from scratch
    try:
        cfg = load_config(trainer_args)  # the trainer's own parsing: bad flags fail here
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    candidates, floor_mode = floors_to_beat(Path(args.data), cfg.normalization)
    floors = candidates[floor_mode]
    progress = Progress(floors.band.val_dice)
    wall_limit = args.wall_limit_s or 4 * args.budget_s + 600
    command, env = trainer_command(args.nproc, trainer_args)

    nproc = f"NPROC_PER_NODE={args.nproc} " if args.nproc > 1 else ""
    print(f"real_data train: {machine_header()}")
    planned = " unless --plan auto changes it" if cfg.plan == "auto" else ""
    print(f"data {args.data} ({cfg.normalization}{planned}), run dir {run_dir}")
    print(f"trainer: {nproc}{' '.join(command)}")
    print(
        f"budget {args.budget_s:g} s of training time (train_time_s; validation not counted), "
        f"wall limit {wall_limit:g} s"
    )
    print("classical floor, picked on train, scored on val (the floor column: the best band):")
    for mode, found in candidates.items():
        for rule in (found.threshold, found.band, found.otsu):
            mark = "  <- the floor" if rule is floors.band else ""
            print(f"  {mode:<10} {rule.describe()}{mark}")
    print(f"{'train s':>9} {'epoch':>6} {'val dice':>9} {'floor':>7} {'margin':>8}")

    run_dir.mkdir(parents=True, exist_ok=True)
    log_path = run_dir / "real_data_trainer.log"
    started = time.monotonic()
    with open(log_path, "wb") as log:
        # its own session, so one signal reaches torchrun, every rank and their workers
        proc = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            reason = watch(
                proc, run_dir / "metrics.jsonl", progress, args.budget_s, wall_limit, args.poll_s
            )
        finally:
            stop_group(proc)
    failed = reason.startswith("trainer exited") and proc.returncode != 0

    print(f"stopped: {reason}, {time.monotonic() - started:.0f} s wall; trainer log {log_path}")
    if progress.counts_validation:
        print(
            "note: some records had no train_time_s; their epoch_time_s (with validation) counted"
        )
    if failed:
        print("last lines of the trainer log:")
        print("\n".join(log_path.read_text(errors="replace").splitlines()[-15:]))
    validated = [r for r in progress.rows if r[2] is not None]
    if validated:
        s, epoch, dice = max(validated, key=lambda r: r[2])
        print(
            f"best val Dice {dice:.4f} at {s:.1f} s (epoch {epoch}); "
            f"band floor {progress.floor:.4f}"
        )
    if progress.first_beat:
        s, epoch, dice = progress.first_beat
        print(
            f"first beat the band floor at {s:.1f} s of training (epoch {epoch}, Dice {dice:.4f})"
        )
    else:
        print(
            f"did not beat the band floor ({progress.floor:.4f}) in {progress.train_s:.1f} s "
            "of training"
        )
    mirrored = mirrored_score(run_dir, args.nproc, trainer_args) if validated else None
    if mirrored:
        print(
            f"best.pt (epoch {mirrored['epoch']}) with the 8 mirrorings (--tta): val Dice "
            f"{mirrored['dice']:.4f}"
        )
    learned = None
    if args.feature_floor:  # after the run: it would share the cores with the trainer
        learned = feature_floor_dice(Path(args.data), floor_mode, run_dir)
        if validated:
            best = max(r[2] for r in validated)
            print(f"the model's best against the feature floor: {best - learned:+.4f}")
            if mirrored:
                print(f"mirrored, against the feature floor: {mirrored['dice'] - learned:+.4f}")
    if args.plot:
        title = f"{args.data} ({run_normalization(run_dir, cfg.normalization)}): {user_args}"
        plot_curve(
            Path(args.plot),
            progress.rows,
            floors,
            floor_mode,
            args.budget_s,
            title,
            learned,
            mirrored and (progress.train_s, mirrored["dice"]),
        )
        print(f"plot: {args.plot}")
    return 1 if failed else 0


# --------------------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    sub = parser.add_subparsers(dest="mode", required=True)
    w = sub.add_parser("write", help="write the MNI152 T1 / grey-matter task, print its floor")
    w.add_argument(
        "--tissue",
        choices=sorted(TISSUES),
        default="gm",
        help="label: grey (gm, default) or white matter (wm) probability > 0.5, or nilearn's "
        "closed tissue mask (gm-mask, wm-mask)",
    )
    w.add_argument("--out", type=Path, required=True, help="data root to write")
    w.add_argument("--slabs", type=int, default=4, help="slabs per half (default 4)")
    w.add_argument("--stride", type=int, default=1, help="keep every Nth voxel (tests)")
    w.add_argument("--overwrite", action="store_true", help="replace a task written before")
    f = sub.add_parser("floor", help="print the classical floor of a data root")
    f.add_argument("--data", type=Path, required=True)
    t = sub.add_parser(
        "train",
        allow_abbrev=False,
        help="train until a budget of training seconds, against the floor; other flags go to "
        "the trainer",
    )
    t.add_argument("--data", type=Path, required=True, help="data root (--data-root)")
    t.add_argument("--budget-s", type=float, default=300.0, help="training seconds (default 300)")
    t.add_argument("--output-dir", help="run dir (default runs/real_data/TIMESTAMP)")
    t.add_argument("--nproc", type=int, default=1, help="processes; above 1 runs launch.sh")
    t.add_argument("--plot", help="PNG of val Dice against training seconds, with the floor")
    t.add_argument("--poll-s", type=float, default=1.0, help="metrics.jsonl polling interval")
    t.add_argument("--wall-limit-s", type=float, help="stop anyway (default 4 x budget + 600)")

    r = sub.add_parser("plot", help="plot a run's val Dice against the floor again")
    r.add_argument("--run", required=True, help="the trainer's run dir (--output-dir)")
    r.add_argument("--data", type=Path, required=True, help="its data root")
    r.add_argument("--plot", required=True, help="PNG to write")
    r.add_argument("--budget-s", type=float, default=math.inf, help="plot up to this far")
    r.add_argument("--title", help="the plot's title (default: data and run dir)")
    m = sub.add_parser("summary", help="runs side by side: best, settled level, against a floor")
    m.add_argument("runs", nargs="+", help="the trainers' run dirs")
    m.add_argument(
        "--floor", type=float, help="the learned floor (default: each run's learned_floor.json)"
    )
    m.add_argument("--within", type=float, default=0.003, help="margin to count (default 0.003)")
    m.add_argument("--budget-s", type=float, default=math.inf, help="count up to this far")
    for mode_parser in (t, r):
        mode_parser.add_argument(
            "--feature-floor",
            action="store_true",
            help="also fit the learned floor of app.learned_floor (about a minute on "
            "MNI152; after training), print it and draw it (train: into the run's "
            "learned_floor.json too; plot draws that one without this flag)",
        )
    args, rest = parser.parse_known_args(argv)
    if rest and args.mode != "train":
        parser.error(f"unrecognized arguments: {' '.join(rest)}")

    if args.mode == "write":
        if args.slabs < 1 or args.stride < 1:
            parser.error("--slabs and --stride must be at least 1")
        info = write_task(args.out, args.slabs, args.stride, args.overwrite, args.tissue)
        lo, hi = info["crop_lo"], info["crop_hi"]
        print(
            f"ICBM152 2009a symmetric T1 template (nilearn, packaged, 1 mm, {info['stored']}),"
            f" as (D, H, W) = {AXES}, cropped to the brain: z {lo[0]}:{hi[0]}, y {lo[1]}:{hi[1]},"
            f" x {lo[2]}:{hi[2]} -> {tuple(info['cropped_shape'])}, voxel {info['voxel_mm']} mm"
        )
        for split, where in (("train", "inferior half"), ("val", "superior half")):
            for name, shape, fg in info["written"][split]:
                print(
                    f"  {SPLITS[split]}/{name}: {shape}, {args.tissue.upper()} {fg:.1%} ({where})"
                )
        print_floors(args.out)
        return 0
    if args.mode == "floor":
        print_floors(args.data)
        return 0
    if args.mode == "plot":
        return replot(args)
    if args.mode == "summary":
        return summary(args)
    if args.nproc < 1 or args.budget_s <= 0:
        parser.error("--nproc must be at least 1 and --budget-s positive")
    return train(args, rest)


if __name__ == "__main__":
    sys.exit(main())
