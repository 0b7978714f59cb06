"""The U-Net's shape for the data: the patch, the depth, and each level's pooling per axis.

Pure functions of the median volume shape, a voxel budget and the voxel spacing, used by
:mod:`app.plan` (which explains each choice in its plan) and testable on their own.
"""

from __future__ import annotations

import math

MAX_DEPTH = 4
MIN_BOTTOM = 4  # voxels per axis left at the bottom of the U-Net (nnU-Net's minimum edge)
# Voxels whose largest side is more than this many times their smallest are anisotropic: the
# plan then pools each axis by its spacing (nnU-Net: an axis is pooled while its spacing is at
# most twice the smallest, so the thick axis waits until the others have caught up with it).
ANISOTROPY = 2.0


def fit_patch(median: tuple[int, int, int], voxels: float) -> tuple[int, int, int]:
    """The median shape scaled by one factor on every axis to about ``voxels``; an axis that
    would fall below 16 (three poolings) stays at 16 and the others share the rest. Each axis a
    multiple of 8, never larger than the median shape rounded up to 8."""
    limit = [max(16, 8 * math.ceil(s / 8)) for s in median]
    size = [float(v) for v in limit]
    free = [a for a in range(3) if limit[a] > 16]
    while free:
        fixed = math.prod(size[a] for a in range(3) if a not in free)
        factor = min(1.0, (voxels / fixed / math.prod(limit[a] for a in free)) ** (1 / len(free)))
        floored = [a for a in free if limit[a] * factor < 16]
        for a in free:
            size[a] = max(16.0, limit[a] * factor)
        if not floored:
            break
        free = [a for a in free if a not in floored]
    return tuple(max(16, 8 * int(v // 8)) for v in size)


def depth_for(patch: tuple[int, ...]) -> int:
    """U-Net levels: pool while every axis keeps at least :data:`MIN_BOTTOM` voxels."""
    return max(2, min(MAX_DEPTH, 1 + int(math.log2(min(patch) / MIN_BOTTOM))))


def pooling_for(
    patch: tuple[int, int, int], spacing: tuple[float, float, float] | None
) -> list[tuple[int, int, int]]:
    """Per-level pooling of axes D H W for anisotropic voxels, or [] for (nearly) isotropic
    ones (their plan pools every axis at every level, :func:`depth_for`). A level pools each
    axis whose current voxel side is at most :data:`ANISOTROPY` times the smallest and that
    keeps :data:`MIN_BOTTOM` voxels; levels stop at :data:`MAX_DEPTH` or when no axis pools."""
    if spacing is None or max(spacing) <= ANISOTROPY * min(spacing):
        return []
    side, size = list(spacing), list(patch)
    pools: list[tuple[int, int, int]] = []
    while len(pools) < MAX_DEPTH - 1:
        kernel = tuple(
            2 if side[a] <= ANISOTROPY * min(side) and size[a] // 2 >= MIN_BOTTOM else 1
            for a in range(3)
        )
        if kernel == (1, 1, 1):
            break
        pools.append(kernel)  # type: ignore[arg-type]
        side = [s * k for s, k in zip(side, kernel)]
        size = [n // k for n, k in zip(size, kernel)]
    return pools
