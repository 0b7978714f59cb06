"""The label scheme: every question whose answer differs between the binary task and K classes.

``--num-classes 1`` (the default) is the binary task: labels are masks, the head has one channel,
probabilities are the fp32 sigmoid, the loss is BCE + Dice, one row of TP/FP/FN is counted (the
sigmoid > 0.5 mask), and the outputs are ``NAME_probs`` and ``NAME_mask``. ``--num-classes K >= 2``
labels are class maps ``0..K-1``: a K-channel head, the fp32 softmax, CE + Dice, K-1 rows of counts
(each foreground class against the rest, the argmax class), metric keys ``dice/NAME``, and outputs
``NAME_mask`` (the label map) and ``NAME_probs_NAME`` per class.

:func:`label_scheme` picks one of the two classes below once; the rest of the app asks the object
(``cfg.labels``) and never branches on the number of classes itself, as nnU-Net's ``LabelManager``
answers for its label handling. Where two code paths differ by more than a value (a figure, a
report), :meth:`LabelScheme.choose` returns the caller's binary or class-map variant: the one
place that decision is made.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
from torch import nn

from app.data.volume_io import VolumeError
from app.losses import BCEDiceLoss, CEDiceLoss
from app.metrics import class_counts, confusion_counts
from app.precision import ops as fp32_ops

log = logging.getLogger(__name__)
FOREGROUND_SAMPLES = 10_000  # candidate centres kept per volume for foreground oversampling
THRESHOLD = 0.5  # on the fp32 sigmoid, as app.metrics.confusion_counts counts
T = TypeVar("T")


class LabelError(ValueError):
    """A request that does not fit the label scheme; the message says why."""


# ----------------------------------------------------------------------------- label files
def _shown(values: np.ndarray) -> str:
    return ", ".join(f"{v:g}" for v in values[:8]) + (", ..." if values.size > 8 else "")


def binarize_label(array: np.ndarray, path: Path) -> np.ndarray:
    """A binary mask as uint8 ``{0, 1}``, from ``{0, 1}``, ``{0, 255}`` or bool."""
    values = np.unique(array)
    if np.isin(values, (0, 1)).all():
        return array.astype(np.uint8)
    if np.isin(values, (0, 255)).all():
        return (array == 255).astype(np.uint8)
    raise VolumeError(
        f"{path}: labels must be binary ({{0, 1}}, {{0, 255}} or bool); found {values.size} "
        f"values: {_shown(values)}"
    )


def check_class_label(array: np.ndarray, path: Path, num_classes: int) -> np.ndarray:
    """A class map of ``--num-classes K``: integers ``0..K-1``, returned as uint8. A float map
    with a fractional value (an interpolated or probability map) is refused; one whose values
    are all whole numbers (some tools save label maps as float32) is read, with a warning."""
    values = np.unique(array)
    fractional = array.dtype.kind == "f" and not np.array_equal(values, np.round(values))
    if array.dtype.kind not in "biuf" or fractional:
        raise VolumeError(
            f"{path}: labels for --num-classes {num_classes} must be an integer class map "
            f"0..{num_classes - 1}, got dtype {array.dtype} with {values.size} values: "
            f"{_shown(values)}"
        )
    outside = values[(values < 0) | (values >= num_classes)]
    if outside.size:
        raise VolumeError(
            f"{path}: label values outside 0..{num_classes - 1} (--num-classes {num_classes}): "
            f"{_shown(outside)}; all values found: {_shown(values)}"
        )
    if array.dtype.kind == "f":
        log.warning(
            "%s: a %s label map; its values %s are whole numbers, read as classes",
            path,
            array.dtype,
            _shown(values),
        )
    return array.astype(np.uint8)


def class_voxels(label: np.ndarray, num_classes: int, rng: np.random.Generator) -> list:
    """Flat indices of up to ``FOREGROUND_SAMPLES`` voxels of each foreground class: the centres
    that foreground oversampling draws from, class by class."""
    out = []
    for c in range(1, num_classes):
        voxels = np.flatnonzero(label == c)
        if voxels.size > FOREGROUND_SAMPLES:
            voxels = rng.choice(voxels, FOREGROUND_SAMPLES, replace=False)
        out.append(voxels)
    return out


def name_problems(num_classes: int, class_names: Sequence[str]) -> list[tuple[str, str]]:
    """The rules ``--num-classes`` and ``--class-names`` obey, as (field, what is wrong)."""
    problems = []
    if num_classes < 1:
        problems.append(("num_classes", "must be 1 (binary) or the number of classes K"))
    if class_names and not len(class_names) == num_classes >= 2:
        problems.append(
            (
                "class_names",
                f"needs one name per class for --num-classes {num_classes} (2 or more), "
                "background first",
            )
        )
    if len(set(class_names)) != len(class_names) or not all(
        n and "/" not in n for n in class_names
    ):
        problems.append(("class_names", "must be distinct, non-empty names without '/'"))
    return problems


# ----------------------------------------------------------------------------- the schemes
class LabelScheme:
    """What the binary task and the K-class task each answer; see the module docstring."""

    num_classes: int
    names: list[str]  # class names, background first; [] for the binary task
    lazy_labels: bool  # whether --data-access mmap can read its labels
    train_flags: str  # what a train command line adds for this scheme

    @property
    def head_channels(self) -> int:
        return self.num_classes

    @property
    def scored(self) -> list[str]:
        """What a row of counts is of: the mask, or each foreground class."""
        raise NotImplementedError

    def choose(self, binary: T, classes: T) -> T:
        """The caller's variant for this scheme, where two paths differ by more than a value."""
        raise NotImplementedError

    def loss(self, bce_weight: float, dice_weight: float, batch_dice: bool = False) -> nn.Module:
        raise NotImplementedError

    def counts(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """``(F, 3)`` TP/FP/FN, one row per :attr:`scored` entry, float64."""
        raise NotImplementedError

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        """Float32 probabilities of one volume's ``(1, C, D, H, W)`` logits: ``(D, H, W)`` of the
        sigmoid, or ``(K, D, H, W)`` of the softmax."""
        raise NotImplementedError

    def mask_of_probabilities(self, probs):
        """The predicted mask or label map of :meth:`probabilities` (tensor or array)."""
        raise NotImplementedError

    def mask_of_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The prediction of ``(C, D, H, W)`` logits without a nonlinearity: logit > 0 (the
        sigmoid > 0.5) or the argmax class."""
        raise NotImplementedError

    def read_label(
        self, label: np.ndarray, path: Path, rng: np.random.Generator
    ) -> tuple[np.ndarray, np.ndarray, list]:
        """A label file's array, checked: (uint8 label, sampled foreground voxels, the sampled
        voxels of each foreground class or [])."""
        raise NotImplementedError

    def check_split(self, labels: list[np.ndarray], folder: Path) -> None:
        """Warn about what a split's labels cannot teach (a class that occurs in none)."""

    def foreground(self, label: np.ndarray) -> np.ndarray:
        """The foreground of a label: the mask itself, or the union of the classes."""
        raise NotImplementedError

    def synthetic_labels(self, mask: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """A random ``mask`` as labels of this scheme (its foreground spread over the classes)."""
        return mask

    def output_kinds(self, kinds: tuple[str, ...]) -> tuple[str, ...]:
        """The output file suffixes of ``--save`` kinds ``probs`` and ``mask``."""
        raise NotImplementedError

    def output_arrays(
        self, probs: np.ndarray, min_object_size: int = 0, fill_holes: bool = False
    ) -> dict[str, np.ndarray]:
        """Every output of :meth:`output_kinds` for one volume's :meth:`probabilities`."""
        raise NotImplementedError

    def check_mask_cleaning(self, cleaning: bool, source: Any) -> None:
        """Raise :class:`LabelError` when mask clean-up is asked of a scheme without masks."""


class BinaryLabels(LabelScheme):
    num_classes = 1
    names: list[str] = []  # noqa: RUF012  (read only)
    lazy_labels = True
    train_flags = ""

    @property
    def scored(self) -> list[str]:
        return ["foreground"]

    def choose(self, binary: T, classes: T) -> T:
        return binary

    def loss(self, bce_weight: float, dice_weight: float, batch_dice: bool = False) -> nn.Module:
        return BCEDiceLoss(bce_weight, dice_weight, batch_dice=batch_dice)

    def counts(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return confusion_counts(logits, target)[None]

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        return fp32_ops.sigmoid(logits)[0, 0]

    def mask_of_probabilities(self, probs):
        return probs > THRESHOLD

    def mask_of_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return logits[0] > 0

    def read_label(self, label, path, rng):
        label = binarize_label(label, path)
        foreground = np.flatnonzero(label)
        if foreground.size > FOREGROUND_SAMPLES:
            foreground = rng.choice(foreground, FOREGROUND_SAMPLES, replace=False)
        return label, foreground, []

    def foreground(self, label: np.ndarray) -> np.ndarray:
        return label

    def output_kinds(self, kinds: tuple[str, ...]) -> tuple[str, ...]:
        return kinds

    def output_arrays(self, probs, min_object_size=0, fill_holes=False):
        from app.analysis.masks import clean_mask  # scipy and scikit-image, only when predicting

        mask = clean_mask(self.mask_of_probabilities(probs), min_object_size, fill_holes)
        return {"probs": probs.astype(np.float32, copy=False), "mask": mask.astype(np.uint8)}


class ClassLabels(LabelScheme):
    lazy_labels = False  # the lazy reader's foreground index is of binary masks

    def __init__(self, num_classes: int, class_names: Sequence[str] = ()):
        self.num_classes = num_classes
        self.names = list(class_names) or [f"class{k}" for k in range(num_classes)]
        self.train_flags = f" --num-classes {num_classes}"

    @property
    def scored(self) -> list[str]:
        return self.names[1:]

    def choose(self, binary: T, classes: T) -> T:
        return classes

    def loss(self, bce_weight: float, dice_weight: float, batch_dice: bool = False) -> nn.Module:
        return CEDiceLoss(self.num_classes, bce_weight, dice_weight, batch_dice=batch_dice)

    def counts(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return class_counts(logits, target)

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        return fp32_ops.softmax(logits, dim=1)[0]

    def mask_of_probabilities(self, probs):
        return probs.argmax(0)

    def mask_of_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.argmax(0)

    def read_label(self, label, path, rng):
        label = check_class_label(label, path, self.num_classes)
        voxels = class_voxels(label, self.num_classes, rng)
        return label, np.concatenate(voxels), voxels

    def check_split(self, labels: list[np.ndarray], folder: Path) -> None:
        present = set()
        for label in labels:
            present.update(np.unique(label).tolist())
        missing = [c for c in range(1, self.num_classes) if c not in present]
        if missing:
            log.warning(
                "%s: no label holds class(es) %s of --num-classes %d; values found: %s",
                folder,
                missing,
                self.num_classes,
                sorted(present),
            )

    def foreground(self, label: np.ndarray) -> np.ndarray:
        return label > 0

    def synthetic_labels(self, mask: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        return mask * torch.randint(1, self.num_classes, mask.shape, generator=generator)

    def output_kinds(self, kinds: tuple[str, ...]) -> tuple[str, ...]:
        probs = tuple(f"probs_{name}" for name in self.names) if "probs" in kinds else ()
        return probs + tuple(k for k in kinds if k != "probs")

    def output_arrays(self, probs, min_object_size=0, fill_holes=False):
        arrays = {"mask": self.mask_of_probabilities(probs).astype(np.uint8)}
        arrays.update({f"probs_{name}": p for name, p in zip(self.names, probs)})
        return arrays

    def check_mask_cleaning(self, cleaning: bool, source: Any) -> None:
        if cleaning:
            raise LabelError(
                f"--min-object-size and --fill-holes clean binary masks; {source} "
                f"predicts {self.num_classes} classes (--num-classes {self.num_classes})"
            )


def label_scheme(num_classes: int = 1, class_names: Sequence[str] = ()) -> LabelScheme:
    """The scheme of ``--num-classes`` and ``--class-names`` (checked by :func:`name_problems`)."""
    if num_classes < 2:
        return BINARY
    return ClassLabels(num_classes, class_names)


BINARY = BinaryLabels()


def scheme_of_names(classes: Sequence[str] | None) -> LabelScheme:
    """The scheme whose :attr:`LabelScheme.names` are ``classes`` (none: binary)."""
    return label_scheme(len(classes or ()), classes or ())


def build_loss(cfg) -> nn.Module:
    """BCE + Dice for the binary task (``--num-classes 1``), CE + Dice over K classes otherwise;
    ``--bce-weight`` weighs the BCE or the CE term, ``--batch-dice`` takes the Dice over the
    batch."""
    scheme = label_scheme(cfg.num_classes, cfg.class_names)
    return scheme.loss(cfg.bce_weight, cfg.dice_weight, cfg.batch_dice)
