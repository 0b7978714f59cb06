#!/usr/bin/env python3
"""Generate a synthetic IronGrain data set: CT-like volumes of packed ore grains with masks.

Standalone on purpose (numpy, scipy, nibabel, tifffile only): run it as a script,

    python datasets/make_synthetic.py --out datasets/IronGrain/demo \
        --n-train 8 --n-val 3 --shape 32 96 96 --seed 0

or load it by path (``importlib.util.spec_from_file_location``) to use ``make_volume`` and
``best_threshold_dice``. ``datasets/`` is deliberately not a Python package: a package named
``datasets`` would shadow Hugging Face ``datasets``.

Layout written (a label and an instance map have their image's file name)::

    OUT/train_patches/images/grain_000.nii.gz   OUT/train_patches/labels/grain_000.nii.gz
    OUT/val_patches/images/grain_000.nii.gz     OUT/val_patches/labels/grain_000.nii.gz
    OUT/*/instances/grain_000.nii.gz            (one id per grain: the truth of app.analysis.grains)

Arrays are (D, H, W) = (z, y, x) in every format; images are float32 (about -0.15..1.0, not
clipped), labels uint8 in {0, 1}, instances uint16 (0 = matrix, 1..N = grains; uint32 past
65535 grains). The trainer reads images/ and labels/ only. See datasets/README.md for how the
volumes are built.

``--phases N`` (2..5) writes the same images and instance maps with class-map labels
``0..N-1`` instead: 0 is the matrix (gangue) and each grain carries the mineral phase of its
kind (``PHASES``), for ``app.train --num-classes N``. It prints the best multi-threshold floor
(N-1 global cuts of the intensity axis, one interval per class) of the val split.
"""

from __future__ import annotations

import argparse
import gzip
import os
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np
from scipy import ndimage as ndi
from scipy.spatial import cKDTree

DEFAULT_SHAPE = (74, 320, 320)
FORMATS = ("nii.gz", "tif", "npy")
SPLITS = ("train_patches", "val_patches")
KINDS = ("images", "labels", "instances")  # the folders of a split
VOXEL_SIZE_MM = 0.01  # 10 µm isotropic, a typical micro-CT voxel for ore particles
# files this script writes, including its temporaries
NAME_RE = re.compile(r"^\.?grain_\d{3,}\.(nii\.gz|tif|npy)(\.\d+\.tmp)?$")
MIN_SIDE = 8

# --- geometry ------------------------------------------------------------------------------
GRAIN_RADIUS_MEDIAN = 5.5  # voxels; grains are 2.5..12 voxels in (mean) radius
GRAIN_RADIUS_RANGE = (2.5, 12.0)
TARGET_FILL = 0.44  # expected ellipsoid volume in the box / box volume, before facets etc.
SHAPE_NOISE = 0.14  # std (in units of the grain radius) of the boundary roughness
ROUGHNESS_CLIP = 2.5  # in std

# --- intensities (before shading) -----------------------------------------------------------
MATRIX_LEVEL = 0.22
#           kind:  probability, base range,    mottling std (before the blur)
GRAIN_KINDS = {
    "bright": (0.40, (0.58, 0.74), 0.035),  # hematite-like
    "medium": (0.25, (0.42, 0.52), 0.035),  # magnetite-like
    "banded": (0.20, (0.20, 0.28), 0.03),  # dim, strongly banded (layered goethite)
    "rimmed": (0.15, (0.22, 0.30), 0.09),  # dim porous core with a bright alteration rim
}
MOTTLE_SIGMA = 0.9  # voxels
BAND_AMPLITUDE = 0.17
BAND_PERIOD = (4.0, 6.0)  # voxels
RIM_THICKNESS = 1.6  # voxels
RIM_LEVEL = 0.42  # added to the core level
SPECKLE_DENSITY = 2.5e-3  # bright unlabelled inclusions per matrix voxel
SPECKLE_PEAK = (0.35, 0.7)  # added peak intensity after the partial-volume blur
PARTIAL_VOLUME_SIGMA = 0.75  # voxels
NOISE_SIGMA = 0.045


# --phases N: the class of each grain kind (0 = matrix), and the class names, matrix first.
# The kinds' intensity ranges overlap once shading, gain and noise are applied (and banded and
# rimmed grains overlap the matrix), so no set of global thresholds separates the phases.
PHASES = {
    2: (("matrix", "grain"), {"bright": 1, "medium": 1, "banded": 1, "rimmed": 1}),
    3: (("matrix", "oxide", "goethite"), {"bright": 1, "medium": 1, "banded": 2, "rimmed": 2}),
    4: (
        ("matrix", "hematite", "magnetite", "goethite"),
        {"bright": 1, "medium": 2, "banded": 3, "rimmed": 3},
    ),
    5: (
        ("matrix", "hematite", "magnetite", "goethite", "altered"),
        {"bright": 1, "medium": 2, "banded": 3, "rimmed": 4},
    ),
}
# intensity cuts searched by the multi-threshold floor: fewer as the cut tuples multiply
FLOOR_BINS = {2: 256, 3: 128, 4: 48, 5: 24}


class SyntheticVolume(NamedTuple):
    image: np.ndarray  # float32 (D, H, W)
    label: np.ndarray  # uint8 {0, 1}
    instances: np.ndarray  # uint16/uint32: 0 matrix, 1..N grains (ids consecutive)


class ThresholdResult(NamedTuple):
    threshold: float
    dice: float
    above: bool  # True: grain = intensity > threshold; False: grain = intensity <= threshold


# --------------------------------------------------------------------------------------------
# Generation
# --------------------------------------------------------------------------------------------
def _smooth_field(shape: Sequence[int], length: float, rng: np.random.Generator) -> np.ndarray:
    """Zero-mean, unit-std random field with Gaussian correlation length ``length`` voxels.

    Built as a Gaussian-RBF expansion of a coarse white-noise grid, one matrix product per
    axis, so a large smooth field costs a few BLAS calls instead of a wide convolution.
    """
    mats = []
    for n in shape:
        step = max(length / 1.5, 1.0)
        m = int(np.ceil((n + 4 * length) / step)) + 1
        centres = np.arange(m) * step - 2 * length
        x = np.arange(n, dtype=np.float64)
        mats.append(np.exp(-0.5 * ((x[:, None] - centres[None, :]) / length) ** 2))
    mz, my, mx = (m.astype(np.float32) for m in mats)
    coarse = rng.standard_normal((mz.shape[1], my.shape[1], mx.shape[1]), dtype=np.float32)
    field = np.tensordot(mz, coarse, axes=(1, 0))  # (D, cy, cx)
    field = np.matmul(my, field)  # (D, H, cx)
    field = np.matmul(field, mx.T)  # (D, H, W)
    sample = field.ravel()[:: max(field.size // 200_000, 1)]
    field -= sample.mean()
    field *= np.float32(1.0 / (sample.std() + 1e-12))
    return field


def _random_rotations(n: int, rng: np.random.Generator) -> np.ndarray:
    q, r = np.linalg.qr(rng.standard_normal((n, 3, 3)))
    return q * np.sign(np.diagonal(r, axis1=1, axis2=2))[:, None, :]


class _Grains(NamedTuple):
    centres: np.ndarray  # (n, 3) float, voxel coordinates (z, y, x)
    inv: np.ndarray  # (n, 3, 3): maps an offset to the unit-ball frame of the grain
    reach: np.ndarray  # (n, 3) half-extent of the ellipsoid along z, y, x in voxels
    radius: np.ndarray  # (n,) geometric-mean radius in voxels
    planes: np.ndarray  # (n, k, 3) unit normals of the cut facets (unit-ball frame)
    heights: np.ndarray  # (n, k) facet distances from the centre (unit-ball frame)


def _place_grains(shape: Sequence[int], rng: np.random.Generator) -> _Grains:
    """Random sequential packing of ellipsoids, big ones first, with limited overlap."""
    shape_arr = np.asarray(shape, dtype=np.float64)
    lo, hi = GRAIN_RADIUS_RANGE
    # draw sizes until their summed volume reaches the target fill of the (slightly enlarged)
    # box that centres are drawn from, then place them big first, each at the first of a
    # batch of random positions that does not overlap an earlier grain too much
    radius = np.empty(0)
    while True:
        more = GRAIN_RADIUS_MEDIAN * np.exp(0.4 * rng.standard_normal(256))
        radius = np.concatenate([radius, np.clip(more, lo, hi)])
        # expected volume inside the box of a grain centred in [-r/2, n + r/2] on each axis
        inside = 4 / 3 * np.pi * radius**3 * np.prod(shape_arr / (shape_arr + radius[:, None]), 1)
        vol = np.cumsum(inside)
        if vol[-1] >= TARGET_FILL * np.prod(shape_arr):
            radius = radius[: int(np.searchsorted(vol, TARGET_FILL * np.prod(shape_arr))) + 1]
            break
    radius = np.sort(radius)[::-1]
    n_cand, tries, batch = radius.size, 16, 128
    acc_c = np.empty((n_cand, 3))
    acc_r = np.empty(n_cand)
    k = 0
    for b0 in range(0, n_cand, batch):
        rb = radius[b0 : b0 + batch]
        # centres may lie up to r/2 outside the box so that grains are cut by its faces
        pos = rng.uniform(0, 1, (rb.size, tries, 3)) * (shape_arr + rb[:, None, None])
        pos -= rb[:, None, None] / 2
        # conflicts with grains of earlier batches: their K nearest centres (radii >= rb, so
        # a conflict is nearly always among them; a missed one only means a little overlap)
        if k:
            kk = min(8, k)
            dist, nn = cKDTree(acc_c[:k]).query(pos.reshape(-1, 3), k=kk)
            dist, nn = dist.reshape(rb.size, tries, kk), nn.reshape(rb.size, tries, kk)
            free = np.all(dist >= 0.8 * (acc_r[nn] + rb[:, None, None]), axis=2)
        else:
            free = np.ones((rb.size, tries), dtype=bool)
        k0 = k
        for i in range(rb.size):
            cand = pos[i][free[i]]
            if k > k0 and cand.size:  # conflicts within this batch
                d2 = ((cand[:, None] - acc_c[None, k0:k]) ** 2).sum(axis=2)
                cand = cand[np.all(d2 >= (0.8 * (acc_r[k0:k] + rb[i])) ** 2, axis=1)]
            if cand.size:
                acc_c[k], acc_r[k] = cand[0], rb[i]
                k += 1
    centres, r = acc_c[:k], acc_r[:k]

    n = k
    # semi-axes: elongated and flattened grains, same volume as the sphere of radius r
    ratios = np.stack([np.ones(n), rng.uniform(0.6, 1.0, n), rng.uniform(0.45, 1.0, n)], axis=1)
    ratios /= np.cbrt(ratios.prod(axis=1))[:, None]
    axes = r[:, None] * ratios
    rot = _random_rotations(n, rng)
    inv = rot.transpose(0, 2, 1) / axes[:, :, None]  # diag(1/axes) @ R^T
    # crushed-ore look: each grain is clipped by a few random flat facets
    k = 5
    planes = rng.standard_normal((n, k, 3))
    planes /= np.linalg.norm(planes, axis=2, keepdims=True)
    heights = rng.uniform(0.62, 1.05, (n, k))
    reach = np.sqrt(((rot * axes[:, None, :]) ** 2).sum(axis=2))  # |R diag(axes)| row norms
    return _Grains(centres, inv, reach, r, planes, heights)


def _render_grains(
    shape: Sequence[int],
    grains: _Grains,
    roughness: np.ndarray,
    sides: Sequence[float] = (1.0, 1.0, 1.0),
) -> tuple[np.ndarray, np.ndarray]:
    """Per voxel: id of the grain owning it (-1: matrix) and its normalised radius (<1 inside).

    Loops over grains (hundreds to a few thousand), each a vectorised bounding-box update;
    where grains overlap the voxel goes to the grain it is relatively deeper in, so touching
    grains meet at a curved contact instead of interpenetrating. ``sides``: each axis's voxel
    side in units of the smallest (grains are placed in those physical units, so on a grid of
    thick slices a round grain spans fewer slices).
    """
    best = np.full(shape, np.inf, dtype=np.float32)
    owner = np.full(shape, -1, dtype=np.int32)
    pad = 1.0 + SHAPE_NOISE * ROUGHNESS_CLIP
    side = np.asarray(sides, dtype=np.float64)
    scale = [np.float32(v) for v in sides]
    for g in range(grains.centres.shape[0]):
        c = grains.centres[g]
        ext = grains.reach[g] * pad + 1
        lo = np.maximum(np.floor((c - ext) / side).astype(int), 0)
        hi = np.minimum(np.ceil((c + ext) / side).astype(int) + 1, shape)
        if np.any(hi <= lo):
            continue
        z = np.arange(lo[0], hi[0], dtype=np.float32)[:, None, None] * scale[0] - c[0]
        y = np.arange(lo[1], hi[1], dtype=np.float32)[None, :, None] * scale[1] - c[1]
        x = np.arange(lo[2], hi[2], dtype=np.float32)[None, None, :] * scale[2] - c[2]
        m = grains.inv[g].astype(np.float32)
        u = [m[i, 0] * z + m[i, 1] * y + m[i, 2] * x for i in range(3)]
        rho = np.sqrt(u[0] ** 2 + u[1] ** 2 + u[2] ** 2)
        for p, h in zip(grains.planes[g], grains.heights[g], strict=True):
            rho = np.maximum(rho, (p[0] * u[0] + p[1] * u[1] + p[2] * u[2]) / h)
        sl = tuple(slice(a, b) for a, b in zip(lo, hi, strict=True))
        rho = rho - roughness[sl]
        cur = best[sl]
        win = rho < cur
        cur[win] = rho[win]
        owner[sl][win] = g
    return owner, best


def make_volume(
    shape: Sequence[int] = DEFAULT_SHAPE, rng: np.random.Generator | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """One CT-like volume of packed ore grains and its grain mask.

    Returns ``(image, label)``: image float32 (D, H, W), label uint8 (D, H, W) in {0, 1}.
    """
    volume = make_grain_volume(shape, rng)
    return volume.image, volume.label


def instance_map(owner: np.ndarray) -> np.ndarray:
    """Grain owner ids (-1: matrix) -> consecutive ids 1..N in the smallest fitting uint."""
    ids, inverse = np.unique(owner, return_inverse=True)
    inverse = inverse.reshape(owner.shape)
    if ids[0] >= 0:  # no matrix voxel at all
        inverse += 1
    dtype = np.uint16 if ids.size <= np.iinfo(np.uint16).max else np.uint32
    return inverse.astype(dtype)


def make_grain_volume(
    shape: Sequence[int] = DEFAULT_SHAPE,
    rng: np.random.Generator | None = None,
    phases: int | None = None,
    spacing: Sequence[float] | None = None,
) -> SyntheticVolume:
    """:func:`make_volume` with the instance map of the grains it drew (no extra random draws,
    so the image and label are those of ``make_volume`` with the same generator state).
    ``phases``: the label is the class map of ``PHASES[phases]`` instead (same image).
    ``spacing``: the voxel size (z, y, x); grains keep their physical size, so an axis with
    thicker voxels cuts them into fewer of them (None: isotropic)."""
    if phases is not None and phases not in PHASES:
        raise ValueError(f"phases must be one of {sorted(PHASES)}, got {phases}")
    shape = tuple(int(s) for s in shape)
    if len(shape) != 3 or min(shape) < 1:
        raise ValueError(f"shape must be three positive ints (D, H, W), got {shape}")
    rng = np.random.default_rng() if rng is None else rng
    f32 = np.float32

    # ---- geometry: packed, faceted, rough ellipsoids -------------------------------------
    roughness = ndi.gaussian_filter(rng.standard_normal(shape, dtype=f32), 1.6, truncate=3.0)
    sample = roughness.ravel()[:: max(roughness.size // 200_000, 1)]
    roughness *= f32(SHAPE_NOISE / (sample.std() + 1e-12))
    np.clip(roughness, -SHAPE_NOISE * ROUGHNESS_CLIP, SHAPE_NOISE * ROUGHNESS_CLIP, out=roughness)
    sides = (1.0, 1.0, 1.0) if spacing is None else tuple(v / min(spacing) for v in spacing)
    grains = _place_grains(tuple(n * v for n, v in zip(shape, sides)), rng)
    owner, rho = _render_grains(shape, grains, roughness, sides)
    label = rho < 1.0
    owner[~label] = -1
    instances = instance_map(owner)
    n = grains.centres.shape[0]

    # ---- per-grain material ------------------------------------------------------------------
    kinds = list(GRAIN_KINDS)
    probs = np.array([GRAIN_KINDS[k][0] for k in kinds])
    kind = rng.choice(len(kinds), size=n, p=probs / probs.sum())
    base = np.empty(n + 1, dtype=f32)  # index n (= owner -1) is the matrix
    mottle = np.empty(n + 1, dtype=f32)
    for i, k in enumerate(kinds):
        sel = kind == i
        _, (b0, b1), amp = GRAIN_KINDS[k]
        base[:n][sel] = rng.uniform(b0, b1, sel.sum())
        mottle[:n][sel] = amp * rng.uniform(0.7, 1.3, sel.sum())
    base[n] = MATRIX_LEVEL
    mottle[n] = 0.0
    band_amp = np.zeros(n + 1, dtype=f32)
    band_amp[:n][kind == kinds.index("banded")] = BAND_AMPLITUDE
    rim_amp = np.zeros(n + 1, dtype=f32)
    rim_amp[:n][kind == kinds.index("rimmed")] = RIM_LEVEL
    # banding: a plane wave with a random direction and period per grain
    wave = rng.standard_normal((n + 1, 3))
    wave /= np.linalg.norm(wave, axis=1, keepdims=True)
    wave *= (2 * np.pi / rng.uniform(*BAND_PERIOD, n + 1))[:, None]
    phase = rng.uniform(0, 2 * np.pi, n + 1)

    oid = np.where(owner < 0, n, owner)
    img = base[oid]
    # mottled interiors (grains only); the matrix gets a faint, smoother texture
    mottling = ndi.gaussian_filter(rng.standard_normal(shape, dtype=f32), MOTTLE_SIGMA)
    # white noise smoothed by a 3D Gaussian has std (4 pi s^2)^-3/4: rescale to unit std
    img += mottle[oid] * mottling * f32((4 * np.pi * MOTTLE_SIGMA**2) ** 0.75)
    img += f32(0.025) * _smooth_field(shape, 3.0, rng) * (oid == n)
    # banded grains
    banded = band_amp[oid] > 0
    if banded.any():
        zz, yy, xx = (a.astype(f32) for a in np.nonzero(banded))
        gid = oid[banded]
        w = wave[gid].astype(f32)
        arg = w[:, 0] * zz + w[:, 1] * yy + w[:, 2] * xx + phase[gid].astype(f32)
        img[banded] += band_amp[gid] * np.sin(arg)
    # bright rims: depth below the surface ~ (1 - rho) * radius
    rimmed = (rim_amp[oid] > 0) & label
    if rimmed.any():
        gid = oid[rimmed]
        depth = (1.0 - rho[rimmed]) * grains.radius[gid].astype(f32)
        img[rimmed] += rim_amp[gid] * (depth < RIM_THICKNESS)
    # small bright inclusions in the matrix (not grains, not labelled): impulses before blur
    matrix_idx = np.flatnonzero(~label)
    n_speck = rng.binomial(matrix_idx.size, SPECKLE_DENSITY) if matrix_idx.size else 0
    if n_speck:
        pos = rng.choice(matrix_idx, size=n_speck, replace=False)
        # an impulse of height A blurred by a 3D Gaussian peaks at A / (2 pi s^2)^1.5
        height = (2 * np.pi * PARTIAL_VOLUME_SIGMA**2) ** 1.5 * rng.uniform(*SPECKLE_PEAK, n_speck)
        img.ravel()[pos] += height.astype(f32)

    # ---- acquisition: partial volume blur, shading, noise ----------------------------------
    img = ndi.gaussian_filter(img, PARTIAL_VOLUME_SIGMA, truncate=3.0)
    _, h, w = shape
    # smooth gain and offset fields (beam hardening, detector drift), length scale 14 voxels
    gain = 1.0 + 0.22 * _smooth_field(shape, 14.0, rng)
    offset = 0.09 * _smooth_field(shape, 14.0, rng)
    # a linear ramp across the volume in a random direction, 0.22 from end to end
    direc = rng.standard_normal(3)
    direc /= np.linalg.norm(direc)
    zr, yr, xr = (np.linspace(-0.5, 0.5, n_, dtype=f32) for n_ in shape)
    offset += f32(0.22 * direc[0]) * zr[:, None, None]
    offset += f32(0.22 * direc[1]) * yr[None, :, None]
    offset += f32(0.22 * direc[2]) * xr[None, None, :]
    # cupping: the centre of each slice reads darker than its rim
    yy = (np.arange(h, dtype=f32) - (h - 1) / 2) / (max(h, w) / 2)
    xx = (np.arange(w, dtype=f32) - (w - 1) / 2) / (max(h, w) / 2)
    cup = 1.0 - 0.18 * (1.0 - (yy[:, None] ** 2 + xx[None, :] ** 2) / 2)
    img = img * gain * cup[None] + offset
    img += NOISE_SIGMA * rng.standard_normal(shape, dtype=f32)
    if phases is not None:  # from the kinds already drawn: the image does not change
        phase_of_kind = PHASES[phases][1]
        grain_phase = np.array([phase_of_kind[kinds[k]] for k in kind] + [0], dtype=np.uint8)
        label = grain_phase[oid] * label
    return SyntheticVolume(img.astype(f32), label.astype(np.uint8), instances)


# --------------------------------------------------------------------------------------------
# Global-threshold baseline
# --------------------------------------------------------------------------------------------
def threshold_search(
    images: np.ndarray | Sequence[np.ndarray],
    labels: np.ndarray | Sequence[np.ndarray],
    n_quantiles: int = 256,
) -> ThresholdResult:
    """Best single global threshold over one volume or pooled over several.

    Candidate thresholds are ``n_quantiles`` quantiles of the intensities; both polarities
    (grain above / grain below the threshold) are tried; the best Dice wins.
    """
    if isinstance(images, np.ndarray):
        images, labels = [images], [labels]
    images = [np.asarray(a, dtype=np.float32).ravel() for a in images]
    labels = [np.asarray(b).ravel() != 0 for b in labels]
    if len(images) != len(labels) or any(
        a.size != b.size for a, b in zip(images, labels, strict=True)
    ):
        raise ValueError("images and labels must pair up with equal sizes")
    rng = np.random.default_rng(0)
    sample = np.concatenate(
        [a if a.size <= 500_000 else rng.choice(a, 500_000, replace=False) for a in images]
    )
    thr = np.unique(np.quantile(sample, (np.arange(n_quantiles) + 0.5) / n_quantiles))
    nb = thr.size + 1
    all_hist = np.zeros(nb, dtype=np.int64)
    fg_hist = np.zeros(nb, dtype=np.int64)
    for a, b in zip(images, labels, strict=True):
        bins = np.searchsorted(thr, a, side="left")  # thr[bins-1] < v <= thr[bins]
        all_hist += np.bincount(bins, minlength=nb)
        fg_hist += np.bincount(bins[b], minlength=nb)
    n_all, n_fg = all_hist.sum(), fg_hist.sum()
    # voxels strictly above thr[k] are those in bins k+1 ..
    pred_above = n_all - np.cumsum(all_hist)[:-1]
    tp_above = n_fg - np.cumsum(fg_hist)[:-1]
    denom = pred_above + n_fg
    dice_above = np.where(denom > 0, 2 * tp_above / np.maximum(denom, 1), 1.0)
    pred_below, tp_below = n_all - pred_above, n_fg - tp_above
    denom = pred_below + n_fg
    dice_below = np.where(denom > 0, 2 * tp_below / np.maximum(denom, 1), 1.0)
    ia, ib = int(np.argmax(dice_above)), int(np.argmax(dice_below))
    if dice_above[ia] >= dice_below[ib]:
        return ThresholdResult(float(thr[ia]), float(dice_above[ia]), True)
    return ThresholdResult(float(thr[ib]), float(dice_below[ib]), False)


def best_threshold_dice(
    image: np.ndarray | Sequence[np.ndarray],
    label: np.ndarray | Sequence[np.ndarray],
    n_quantiles: int = 256,
) -> tuple[float, float]:
    """``(threshold, dice)`` of the best single global threshold (see ``threshold_search``)."""
    res = threshold_search(image, label, n_quantiles)
    return res.threshold, res.dice


class MultiThresholdResult(NamedTuple):
    cuts: tuple[float, ...]  # N-1 increasing intensities
    order: tuple[int, ...]  # the class of each of the N intervals, darkest first
    dice: tuple[float, ...]  # Dice of each foreground class 1..N-1
    mean_dice: float  # their mean, which the search maximises


def multi_threshold_search(
    images: Sequence[np.ndarray], labels: Sequence[np.ndarray], classes: int
) -> MultiThresholdResult:
    """The best multi-threshold rule for class maps ``0..classes-1``: ``classes - 1`` global cuts
    (among ``FLOOR_BINS[classes]`` intensity quantiles) split the intensity axis into intervals,
    each interval is given one class (every assignment is tried), and the rule with the highest
    mean Dice over the foreground classes, pooled over all voxels, wins."""
    import itertools

    images = [np.asarray(a, dtype=np.float32).ravel() for a in images]
    labels = [np.asarray(b).ravel() for b in labels]
    bins = FLOOR_BINS.get(classes, 24)
    rng = np.random.default_rng(0)
    sample = np.concatenate(
        [a if a.size <= 500_000 else rng.choice(a, 500_000, replace=False) for a in images]
    )
    thr = np.unique(np.quantile(sample, np.arange(1, bins) / bins))
    nb = thr.size + 1
    hist = np.zeros((classes, nb), dtype=np.int64)  # voxels of each class in each bin
    for a, b in zip(images, labels, strict=True):
        slot = np.searchsorted(thr, a, side="left")
        hist += np.bincount(b.astype(np.int64) * nb + slot, minlength=classes * nb).reshape(
            classes, nb
        )
    cum = np.concatenate([np.zeros((classes, 1), np.int64), np.cumsum(hist, 1)], 1)
    cuts = np.array(list(itertools.combinations(range(1, nb), classes - 1)), dtype=np.int64)
    edges = np.concatenate(
        [np.zeros((len(cuts), 1), np.int64), cuts, np.full((len(cuts), 1), nb)], 1
    )
    # (rules, intervals, classes): voxels of each class in each interval of each rule
    counts = (cum[:, edges[:, 1:]] - cum[:, edges[:, :-1]]).transpose(1, 2, 0)
    predicted = counts.sum(2)  # (rules, intervals)
    truth = hist.sum(1)  # (classes,)
    best = (-1.0, None, None, None)
    for order in itertools.permutations(range(classes)):
        interval_of = np.argsort(order)  # the interval each class is given
        dice = []
        for c in range(1, classes):
            k = interval_of[c]
            tp, pred = counts[:, k, c], predicted[:, k]
            denom = pred + truth[c]
            dice.append(np.where(denom > 0, 2 * tp / np.maximum(denom, 1), 1.0))
        dice = np.stack(dice, 1)
        mean = dice.mean(1)
        i = int(np.argmax(mean))
        if mean[i] > best[0]:
            best = (float(mean[i]), order, i, dice[i])
    mean, order, i, dice = best
    return MultiThresholdResult(
        tuple(float(thr[c - 1]) for c in cuts[i]), tuple(order), tuple(map(float, dice)), mean
    )


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------
def _encode(arr: np.ndarray, fmt: str, path: Path, spacing: Sequence[float]) -> None:
    """``spacing`` (z, y, x, mm) goes where the format keeps it: the NIfTI affine, an ImageJ
    TIFF's resolution, spacing and unit (for the dtypes ImageJ stores); ``.npy`` keeps none."""
    if fmt == "npy":
        with open(path, "wb") as fh:
            np.save(fh, arr)
    elif fmt == "tif":
        import tifffile

        z, y, x = spacing
        if arr.dtype in (np.uint8, np.uint16, np.float32):
            tifffile.imwrite(
                path,
                arr,
                imagej=True,
                resolution=(1.0 / x, 1.0 / y),
                metadata={"axes": "ZYX", "spacing": z, "unit": "mm"},
            )
        else:
            tifffile.imwrite(path, arr, photometric="minisblack", metadata={"axes": "ZYX"})
    elif fmt == "nii.gz":
        import nibabel as nib

        affine = np.diag([*spacing, 1.0])
        img = nib.Nifti1Image(arr, affine)
        img.header.set_data_dtype(arr.dtype)
        img.header.set_xyzt_units("mm")
        img.header.set_qform(affine, code=1)
        img.header.set_sform(affine, code=1)
        path.write_bytes(gzip.compress(img.to_bytes(), compresslevel=1))
    else:  # pragma: no cover - argparse restricts choices
        raise ValueError(f"unknown format {fmt!r}")


def write_array(
    arr: np.ndarray,
    path: str | os.PathLike,
    fmt: str,
    spacing: Sequence[float] = (VOXEL_SIZE_MM,) * 3,
) -> None:
    """Write ``arr`` (D, H, W) with its voxel ``spacing`` (mm) to ``path`` in ``fmt``: to a
    temporary name, then rename."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        _encode(arr, fmt, tmp, spacing)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def _volume_rng(seed: int, split: int, index: int) -> np.random.Generator:
    # independent stream per (seed, split, index): val volumes do not depend on --n-train
    return np.random.default_rng(np.random.SeedSequence([seed, split, index]))


def generate(
    out: str | os.PathLike,
    n_train: int,
    n_val: int,
    shape: Sequence[int] = DEFAULT_SHAPE,
    seed: int = 0,
    fmt: str = "nii.gz",
    overwrite: bool = False,
    log=print,
    phases: int | None = None,
    spacing: Sequence[float] | None = None,
) -> ThresholdResult | MultiThresholdResult:
    """Write both splits under ``out``; returns the val split's global-threshold baseline (with
    ``phases``: the class-map labels and the val split's multi-threshold floor)."""
    out = Path(out)
    if phases is not None and phases not in PHASES:
        raise ValueError(f"phases must be one of {sorted(PHASES)}, got {phases}")
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if n_train < 1 or n_val < 1:
        raise ValueError(f"need at least one volume per split, got {n_train=} {n_val=}")
    counts = {"train_patches": n_train, "val_patches": n_val}
    dirs = [out / s / sub for s in SPLITS for sub in KINDS]
    stale = []
    for d in dirs:
        if d.is_dir():
            keep = {f"grain_{i:03d}.{fmt}" for i in range(counts[d.parent.name])}
            # hidden files (.DS_Store ...) are ignored by the trainer too, except our temporaries
            stale += [
                p
                for p in sorted(d.iterdir())
                if p.name not in keep and (not p.name.startswith(".") or NAME_RE.match(p.name))
            ]
    if stale and not overwrite:
        raise FileExistsError(
            f"{len(stale)} file(s) already in {out} that this run would not write "
            f"(e.g. {stale[0]}); they would be mixed into the data set. Use an empty --out, "
            "or pass --overwrite to delete the generator's own grain_*.{nii.gz,tif,npy} files"
        )
    if stale:
        foreign = [p for p in stale if not (p.is_file() and NAME_RE.match(p.name))]
        if foreign:
            raise FileExistsError(
                f"{len(foreign)} file(s) in {out} not made by this generator "
                f"(e.g. {foreign[0]}); refusing to delete them, use an empty --out"
            )
        for p in stale:
            p.unlink()
    for d in dirs:
        d.mkdir(parents=True, exist_ok=True)

    result = None
    for split_id, split in enumerate(SPLITS):
        t0 = time.perf_counter()
        fg = 0.0
        images, labels = [], []
        for i in range(counts[split]):
            image, label, instances = make_grain_volume(
                shape, _volume_rng(seed, split_id, i), phases, spacing
            )
            name = f"grain_{i:03d}.{fmt}"
            for kind, array in zip(KINDS, (image, label, instances), strict=True):
                write_array(array, out / split / kind / name, fmt, spacing or (VOXEL_SIZE_MM,) * 3)
            fg += float(np.count_nonzero(label)) / label.size
            if split == "val_patches":
                images.append(image)
                labels.append(label)
        dt = time.perf_counter() - t0
        n = counts[split]
        log(
            f"{split}: {n} image/label pairs, shape {'x'.join(map(str, shape))}, {fmt}, "
            f"grain fraction {100 * fg / n:.1f}%, {dt:.1f} s -> {out / split}"
        )
        if split == "val_patches" and phases is not None:
            result = multi_threshold_search(images, labels, phases)
            names = PHASES[phases][0]
            parts = [names[result.order[0]]]
            for cut, c in zip(result.cuts, result.order[1:], strict=True):
                parts += [f"{cut:.3f}", names[c]]
            rule = " < ".join(parts)
            per_class = ", ".join(
                f"{name} {d:.3f}" for name, d in zip(names[1:], result.dice, strict=True)
            )
            log(
                f"best multi-threshold floor on val: mean foreground Dice "
                f"{result.mean_dice:.3f} ({per_class}); rule: {rule} "
                f"(classes for app.train: --num-classes {phases} --class-names {' '.join(names)})"
            )
        elif split == "val_patches":
            result = threshold_search(images, labels)
            per_vol = [threshold_search(a, b).dice for a, b in zip(images, labels, strict=True)]
            log(
                f"best global threshold Dice on val: {result.dice:.3f} "
                f"(threshold {result.threshold:.3f}, grain = "
                f"{'above' if result.above else 'below'}; "
                f"best per-volume thresholds: mean Dice {np.mean(per_vol):.3f})"
            )
    assert result is not None
    return result


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------
def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Write a synthetic IronGrain data set (CT-like ore grain volumes + masks).",
    )
    p.add_argument("--out", required=True, help="data root to write train_patches/ val_patches/")
    p.add_argument("--n-train", type=int, default=8, help="training volumes (default 8)")
    p.add_argument("--n-val", type=int, default=3, help="validation volumes (default 3)")
    p.add_argument(
        "--shape",
        type=int,
        nargs=3,
        metavar=("D", "H", "W"),
        default=list(DEFAULT_SHAPE),
        help="volume shape, z y x (default 74 320 320)",
    )
    p.add_argument(
        "--spacing",
        type=float,
        nargs=3,
        metavar=("Z", "Y", "X"),
        default=None,
        help=f"voxel size in mm, z y x (default {VOXEL_SIZE_MM} on every axis), written in the "
        "NIfTI affine and the TIFF (ImageJ) metadata; grains keep their physical size, so "
        "3 1 1 scans them in slices three times as thick",
    )
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--format", choices=FORMATS, default="nii.gz", help="file format")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="delete earlier grain_* files in OUT that this run would not rewrite",
    )
    p.add_argument(
        "--phases",
        type=int,
        choices=sorted(PHASES),
        help="label each grain with its mineral phase: class maps 0..N-1 (0 = matrix) for "
        "app.train --num-classes N; default: binary grain masks",
    )
    p.add_argument(
        "--report-threshold",
        action="store_true",
        help="accepted for compatibility; the val threshold baseline is always reported",
    )
    args = p.parse_args(argv)
    if any(s < MIN_SIDE for s in args.shape):
        p.error(f"--shape: every side must be at least {MIN_SIDE} voxels, got {args.shape}")
    if args.n_train < 1:
        p.error(f"--n-train must be at least 1, got {args.n_train}")
    if args.n_val < 1:
        p.error(f"--n-val must be at least 1, got {args.n_val}")
    if args.seed < 0:
        p.error(f"--seed must be non-negative, got {args.seed}")
    if args.spacing is not None and not all(v > 0 for v in args.spacing):
        p.error(f"--spacing: every voxel side must be positive, got {args.spacing}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    try:
        generate(
            args.out,
            args.n_train,
            args.n_val,
            tuple(args.shape),
            args.seed,
            args.format,
            overwrite=args.overwrite,
            phases=args.phases,
            spacing=args.spacing,
        )
    except (FileExistsError, OSError) as exc:
        print(f"make_synthetic.py: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
