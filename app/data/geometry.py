"""The physical grid of a volume: voxel spacing, origin and orientation, per array axis.

A CT volume is a grid of physical voxels. ``app.data.volume_io`` reads the grid from each format's
metadata into a :class:`Geometry` (what a format does not say stays ``None``), hands it on with
the voxels and writes it back with a result. Here: what a geometry is, and whether an image and
its label lie on the same grid.

Axis order is the array's, (D, H, W) as stored: ``spacing[0]`` is the spacing along axis 0,
whatever the format calls that axis.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# Agreement tolerances. Formats store the grid with rounding: NIfTI as float32 (a relative error
# near 1e-7), TIFF resolution as a rational of integers, ImageJ's z spacing as decimal text. A
# label resampled onto the wrong grid or exported from another scan is off by far more: a
# spacing by a few percent at least, an origin by a voxel, an orientation by a flipped axis.
SPACING_RTOL = 1e-3  # relative, per axis
ORIGIN_VOXELS = 0.01  # per axis, as a fraction of that axis's spacing
DIRECTION_ATOL = 1e-3  # direction cosines: about 0.06 degrees

# The spellings formats use for a length unit, and the one this app writes.
UNITS = {
    "mm": "mm",
    "millimeter": "mm",
    "millimetre": "mm",
    "um": "um",
    "µm": "um",
    "μm": "um",
    "\\u00b5m": "um",
    "micron": "um",
    "microns": "um",
    "micrometer": "um",
    "micrometre": "um",
    "nm": "nm",
    "nanometer": "nm",
    "cm": "cm",
    "centimeter": "cm",
    "m": "m",
    "meter": "m",
    "inch": "inch",
}


def canonical_unit(unit: str | None) -> str | None:
    """A unit as this app writes it (``mm``, ``um``, ...), or None for none or an unknown one."""
    if unit is None:
        return None
    return UNITS.get(str(unit).strip().lower())


@dataclass(frozen=True)
class Geometry:
    """Spacing, origin and direction of a volume's axes; ``None`` where the file says nothing.

    ``direction[i]`` is the unit vector (in the file's world frame) of array axis ``i``.
    ``unit`` is ``"voxel"`` when the file names no length unit: its spacing is then relative,
    not a length.
    """

    spacing: tuple[float, float, float] | None = None
    unit: str = "voxel"
    origin: tuple[float, float, float] | None = None
    direction: tuple[tuple[float, float, float], ...] | None = None

    @property
    def is_physical(self) -> bool:
        return self.spacing is not None and self.unit != "voxel"

    @classmethod
    def from_affine(cls, affine: np.ndarray, unit: str = "mm") -> Geometry:
        """A NIfTI-style 4x4 voxel-to-world affine: the columns of its 3x3 part are the array
        axes (their norms the spacing, their directions the orientation), its last column the
        origin."""
        linear = np.asarray(affine, dtype=np.float64)[:3, :3]
        spacing = np.linalg.norm(linear, axis=0)
        if not np.all(spacing > 0):
            return cls()
        direction = (linear / spacing).T
        return cls(
            spacing=tuple(float(s) for s in spacing),
            unit=unit,
            origin=tuple(float(o) for o in np.asarray(affine, dtype=np.float64)[:3, 3]),
            direction=tuple(tuple(float(c) for c in row) for row in direction),
        )

    def describe(self) -> str:
        if self.spacing is None:
            return "no voxel size"
        sides = " x ".join(f"{s:.6g}" for s in self.spacing)
        return f"{sides} {self.unit if self.unit != 'voxel' else '(no unit)'}"

    def to_dict(self) -> dict:
        return {
            "spacing": list(self.spacing) if self.spacing else None,
            "unit": self.unit,
            "origin": list(self.origin) if self.origin else None,
        }


def mismatches(image: Geometry, label: Geometry) -> list[str]:
    """How a label's grid differs from its image's, one phrase each; empty when they agree.

    Only what both files state is compared: a label with no geometry (``.npy``) takes its
    image's. Spacings in different units are converted first.
    """
    found = []
    if image.spacing is not None and label.spacing is not None:
        scale = unit_ratio(label.unit, image.unit)
        label_spacing = [s * scale for s in label.spacing] if scale else label.spacing
        if scale is None and {image.unit, label.unit} != {"voxel"}:
            found.append(f"spacing unit {image.unit} vs {label.unit}")
        elif not all(
            math.isclose(a, b, rel_tol=SPACING_RTOL) for a, b in zip(image.spacing, label_spacing)
        ):
            found.append(f"spacing {fmt(image.spacing)} vs {fmt(label_spacing)} {image.unit}")
    if image.origin is not None and label.origin is not None:
        steps = image.spacing or (1.0, 1.0, 1.0)
        if any(
            abs(a - b) > ORIGIN_VOXELS * s for a, b, s in zip(image.origin, label.origin, steps)
        ):
            found.append(f"origin {fmt(image.origin)} vs {fmt(label.origin)}")
    if (
        image.direction is not None
        and label.direction is not None
        and not np.allclose(image.direction, label.direction, atol=DIRECTION_ATOL, rtol=0)
    ):
        found.append(f"orientation {fmt_dir(image.direction)} vs {fmt_dir(label.direction)}")
    return found


LENGTHS_IN_UM = {"nm": 1e-3, "um": 1.0, "mm": 1e3, "cm": 1e4, "m": 1e6, "inch": 25.4e3}


def unit_ratio(source: str, target: str) -> float | None:
    """Factor that turns a length in ``source`` into ``target``; None when either is no length
    unit (``voxel``) and they differ."""
    if source == target:
        return 1.0
    if source in LENGTHS_IN_UM and target in LENGTHS_IN_UM:
        return LENGTHS_IN_UM[source] / LENGTHS_IN_UM[target]
    return None


def spacing_spread(geometries: list[Geometry]) -> tuple[float, float, str] | None:
    """(smallest, largest) voxel volume-equivalent side over volumes that state a physical
    spacing, with its unit, when they differ by more than a factor of 2: training volumes that
    far apart in voxel size show the network the same structure at different scales."""
    physical = [g for g in geometries if g.is_physical]
    if len(physical) < 2:
        return None
    unit = physical[0].unit
    sides = []
    for g in physical:
        scale = unit_ratio(g.unit, unit) or 1.0
        sides.append(float(np.prod([s * scale for s in g.spacing])) ** (1 / 3))
    low, high = min(sides), max(sides)
    return (low, high, unit) if high > 2 * low else None


def fmt(values) -> str:
    return "(" + ", ".join(f"{v:.6g}" for v in values) + ")"


def fmt_dir(direction) -> str:
    return "[" + ", ".join(fmt(row) for row in direction) + "]"
