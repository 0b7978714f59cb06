"""Reading and writing 3D volumes: NIfTI (nibabel), TIFF stacks (tifffile), ``.npy`` and zarr
(a ``NAME.zarr`` folder: a zarr array, or an OME-Zarr image whose full-resolution level is read).

Arrays are used in the axis order they are stored in and called (D, H, W). Each volume's grid
(:class:`app.data.geometry.Geometry`: spacing, unit, origin, orientation) is read here once, from
what its format says:

- NIfTI: the affine (sform or qform, as nibabel chooses) and the header's length unit (mm when
  it names none);
- TIFF: OME-XML ``PhysicalSize*`` where present, else ImageJ's ``spacing`` and ``unit`` with
  the X/Y resolution tags; no origin or orientation;
- OME-Zarr: the ``scale`` and ``translation`` of the full-resolution dataset (and of the
  multiscale) and the axes' units; a plain zarr array: this app's ``geometry`` attribute;
- ``.npy``: nothing.

A volume read here is written back in its own format with its own grid: NIfTI with its affine
and header, TIFF as an ImageJ stack with its resolution and unit, zarr with its
transformations.
"""

from __future__ import annotations

import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from app.atomic import atomic_path
from app.data.geometry import Geometry, canonical_unit

EXTENSIONS = (".nii.gz", ".nii", ".tif", ".tiff", ".npy", ".zarr")
ZARR_CHUNKS = (64, 64, 64)  # written zarr: cubes, so a training patch reads a few chunks


class VolumeError(ValueError):
    """A volume file is unusable; the message starts with its path."""


def split_ext(path: Path | str) -> tuple[str, str]:
    """``grain_01.nii.gz`` -> (``grain_01``, ``.nii.gz``); the extension is lower-cased."""
    name = Path(path).name
    lower = name.lower()
    for ext in EXTENSIONS:
        if lower.endswith(ext):
            return name[: -len(ext)], ext
    return Path(name).stem, Path(name).suffix.lower()


def is_volume_file(path: Path) -> bool:
    """A volume: a file with a volume extension, or a ``.zarr`` folder; hidden names are not."""
    ext = split_ext(path)[1]
    stored = path.is_dir() if ext == ".zarr" else path.is_file()
    return stored and ext in EXTENSIONS and not path.name.startswith(".")


def zarr_array(path: Path | str):
    """The 3D zarr array of a ``.zarr`` folder: the array itself, or the first (full-resolution)
    dataset of an OME-Zarr image's ``multiscales``."""
    import zarr

    node = zarr.open(str(path), mode="r")
    if isinstance(node, zarr.Array):
        return node
    multiscales = node.attrs.get("multiscales") or node.attrs.get("ome", {}).get("multiscales")
    if not multiscales:
        raise VolumeError(f"{path}: a zarr group without OME-Zarr multiscales; give the array")
    return node[multiscales[0]["datasets"][0]["path"]]


@dataclass
class VolumeMeta:
    """What is needed to write a result next to its input in the same format, on its grid."""

    ext: str
    affine: np.ndarray | None = None
    header: Any = None
    geometry: Geometry | None = None
    ome: bool = False  # a zarr input that was an OME-Zarr image: written back as one

    @property
    def grid(self) -> Geometry:
        """The volume's geometry: as read, else from a NIfTI affine, else unknown."""
        if self.geometry is not None:
            return self.geometry
        if self.affine is not None and self.ext in (".nii", ".nii.gz"):
            return Geometry.from_affine(self.affine, nifti_unit(self.header))
        return Geometry()


def nifti_unit(header: Any) -> str:
    """The NIfTI header's length unit (mm when it names none, as the standard reads it)."""
    if header is None:
        return "mm"
    return canonical_unit(header.get_xyzt_units()[0]) or "mm"


def tiff_geometry(tif: Any) -> Geometry:
    """OME-XML physical sizes, else ImageJ's z spacing and unit with the X/Y resolution tags."""
    series = tif.series[0]
    if tif.is_ome and tif.ome_metadata:
        found = ome_xml_geometry(tif.ome_metadata, series.axes)
        if found is not None:
            return found
    page = tif.pages[0]
    x_res = page.tags.get("XResolution")
    y_res = page.tags.get("YResolution")
    if tif.is_imagej and x_res is not None and y_res is not None:
        meta = tif.imagej_metadata or {}
        z = float(meta.get("spacing", 1.0))
        x, y = (den / num for num, den in (x_res.value, y_res.value))
        unit = canonical_unit(meta.get("unit"))
        if unit is not None and min(x, y, z) > 0:
            return Geometry(spacing=(z, y, x), unit=unit)
    return Geometry()


def ome_xml_geometry(xml: str, axes: str) -> Geometry | None:
    """The ``Pixels`` physical sizes of an OME-XML header (micrometres unless it names a unit),
    in the order of the array's ``axes`` (for example ``ZYX``)."""
    import xml.etree.ElementTree as ET

    pixels = next((e for e in ET.fromstring(xml).iter() if e.tag.endswith("Pixels")), None)
    if pixels is None or axes[-3:] != "ZYX":
        return None
    sizes, units = [], set()
    for axis in "ZYX":
        size = pixels.get(f"PhysicalSize{axis}")
        if size is None:
            return None
        sizes.append(float(size))
        units.add(canonical_unit(pixels.get(f"PhysicalSize{axis}Unit", "µm")))
    if len(units) != 1 or None in units:
        return None
    return Geometry(spacing=tuple(sizes), unit=units.pop())


def zarr_geometry(path: Path | str) -> tuple[Geometry, bool]:
    """An OME-Zarr image's scale, translation and units (its last three axes), or a plain zarr
    array's ``geometry`` attribute; and whether the folder is an OME-Zarr image."""
    import zarr

    node = zarr.open(str(path), mode="r")
    if isinstance(node, zarr.Array):
        saved = node.attrs.get("geometry")
        if not saved or not saved.get("spacing"):
            return Geometry(), False
        origin = saved.get("origin")
        return Geometry(
            spacing=tuple(float(v) for v in saved["spacing"]),
            unit=canonical_unit(saved.get("unit")) or "voxel",
            origin=tuple(float(v) for v in origin) if origin else None,
        ), False
    multiscales = node.attrs.get("multiscales") or node.attrs.get("ome", {}).get("multiscales")
    multiscale = multiscales[0]
    scale = np.ones(3)
    shift = np.zeros(3)
    # The dataset's transformations first, then the multiscale's (world = ms(ds(index))).
    for transforms in (
        multiscale["datasets"][0].get("coordinateTransformations", []),
        multiscale.get("coordinateTransformations", []),
    ):
        for t in transforms:
            if t.get("type") == "scale":
                factor = np.asarray(t["scale"][-3:], dtype=np.float64)
                scale, shift = scale * factor, shift * factor
            elif t.get("type") == "translation":
                shift = shift + np.asarray(t["translation"][-3:], dtype=np.float64)
    units = {canonical_unit(a.get("unit")) for a in multiscale.get("axes", [])[-3:]}
    unit = units.pop() if len(units) == 1 and None not in units else "voxel"
    return Geometry(
        spacing=tuple(float(v) for v in scale),
        unit=unit,
        origin=tuple(float(v) for v in shift),
    ), True


def read_volume(path: Path | str) -> tuple[np.ndarray, VolumeMeta]:
    """Read a 3D numeric array; any failure becomes a :class:`VolumeError` naming the file."""
    path = Path(path)
    ext = split_ext(path)[1]
    if ext not in EXTENSIONS:
        raise VolumeError(f"{path}: unsupported file type {ext!r}; expected one of {EXTENSIONS}")
    try:
        if ext in (".nii", ".nii.gz"):
            import nibabel as nib

            img = nib.load(str(path))
            array = np.asarray(img.dataobj)
            meta = VolumeMeta(ext, affine=img.affine, header=img.header)
            meta.geometry = meta.grid
        elif ext in (".tif", ".tiff"):
            import tifffile

            with tifffile.TiffFile(str(path)) as tif:
                array = tif.asarray()
                # An ImageJ stack cut short reads back as fewer planes than its header states.
                stated = (tif.imagej_metadata or {}).get("images", 1) if tif.is_imagej else 1
                planes = math.prod(array.shape[:-2])
                if planes < stated:
                    raise VolumeError(
                        f"{path}: cannot read {ext} file, corrupt or truncated? (its ImageJ "
                        f"header says {stated} planes, the file holds {planes})"
                    )
                meta = VolumeMeta(ext, geometry=tiff_geometry(tif))
        elif ext == ".zarr":
            array = np.asarray(zarr_array(path)[...])
            geometry, ome = zarr_geometry(path)
            meta = VolumeMeta(ext, geometry=geometry, ome=ome)
        else:
            array = np.load(path, allow_pickle=False)
            meta = VolumeMeta(ext)
    except VolumeError:
        raise
    except Exception as exc:  # every reader has its own zoo of errors for a bad file
        raise VolumeError(f"{path}: cannot read {ext} file, corrupt or truncated? ({exc})") from exc
    if not isinstance(array, np.ndarray) or array.dtype.kind not in "biuf":
        raise VolumeError(f"{path}: expected a numeric array, got dtype {array.dtype}")
    if array.ndim != 3:
        raise VolumeError(f"{path}: expected a 3D array (D, H, W), got shape {array.shape}")
    return array, meta


def volume_geometry(path: Path | str) -> tuple[tuple[int, ...], Geometry]:
    """Shape and geometry of a volume, read from its header without loading the voxels."""
    path = Path(path)
    ext = split_ext(path)[1]
    try:
        if ext in (".nii", ".nii.gz"):
            import nibabel as nib

            img = nib.load(str(path))
            return tuple(img.shape), VolumeMeta(ext, img.affine, img.header).grid
        if ext in (".tif", ".tiff"):
            import tifffile

            with tifffile.TiffFile(str(path)) as tif:
                return tuple(tif.series[0].shape), tiff_geometry(tif)
        if ext == ".zarr":
            return tuple(zarr_array(path).shape), zarr_geometry(path)[0]
        return tuple(np.load(path, mmap_mode="r", allow_pickle=False).shape), Geometry()
    except VolumeError:
        raise
    except Exception as exc:  # as in read_volume: every reader fails its own way
        raise VolumeError(
            f"{path}: cannot read {ext} header, corrupt or truncated? ({exc})"
        ) from exc


def volume_header(path: Path | str) -> tuple[tuple[int, ...], tuple[float, float, float] | None]:
    """Shape and voxel spacing (``None`` where the file states none) of a volume."""
    shape, geometry = volume_geometry(path)
    return shape, geometry.spacing


def voxel_spacing(meta: VolumeMeta, mode: str = "header") -> tuple[tuple[float, ...] | None, str]:
    """Voxel spacing (z, y, x) and its unit from whatever the volume's format states (NIfTI,
    TIFF, zarr), or ``(None, "voxel")`` for a volume that states none, one whose spacing has no
    length unit, or ``mode="voxel"``."""
    grid = meta.grid
    if mode == "voxel" or not grid.is_physical:
        return None, "voxel"
    return grid.spacing, grid.unit


OME_UNITS = {"nm": "nanometer", "um": "micrometer", "mm": "millimeter", "cm": "centimeter"}


def write_zarr(path: Path | str, array: np.ndarray, meta: VolumeMeta | None = None) -> None:
    """A zarr array folder, or an OME-Zarr image for an OME-Zarr input, with the volume's
    geometry; written beside ``path`` and renamed into place (an old one is moved aside first
    and removed after: a folder cannot be renamed over a non-empty one)."""
    import zarr

    path = Path(path)
    grid = meta.grid if meta is not None else Geometry()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    old = path.with_name(f".{path.name}.{os.getpid()}.old")
    try:
        chunks = tuple(min(c, s) for c, s in zip(ZARR_CHUNKS, array.shape))
        if meta is not None and meta.ome:
            group = zarr.open_group(str(tmp), mode="w")
            out = group.create_array("0", shape=array.shape, dtype=array.dtype, chunks=chunks)
            group.attrs["ome"] = ome_attributes(grid)
        else:
            out = zarr.create_array(str(tmp), shape=array.shape, dtype=array.dtype, chunks=chunks)
            if grid.spacing is not None:
                out.attrs["geometry"] = grid.to_dict()
        out[...] = array
        if path.exists():
            os.replace(path, old)
        os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)


def ome_attributes(grid: Geometry) -> dict:
    """OME-Zarr 0.5 image metadata of one full-resolution level on ``grid``."""
    unit = OME_UNITS.get(grid.unit)
    axes = [{"name": n, "type": "space", **({"unit": unit} if unit else {})} for n in "zyx"]
    transforms = [{"type": "scale", "scale": list(grid.spacing or (1.0, 1.0, 1.0))}]
    if grid.origin is not None:
        transforms.append({"type": "translation", "translation": list(grid.origin)})
    dataset = {"path": "0", "coordinateTransformations": transforms}
    return {"version": "0.5", "multiscales": [{"axes": axes, "datasets": [dataset]}]}


def write_tiff(path: Path | str, array: np.ndarray, grid: Geometry) -> None:
    """A TIFF stack; with a physical spacing, an ImageJ hyperstack carrying it (X/Y resolution
    tags, ``spacing`` and ``unit``), which ImageJ/Fiji and tifffile read back. ImageJ stores
    no origin or orientation."""
    import tifffile

    imagej_types = (np.uint8, np.uint16, np.float32)
    if grid.is_physical and array.dtype in imagej_types:
        z, y, x = grid.spacing
        tifffile.imwrite(
            path,
            array,
            imagej=True,
            resolution=(1.0 / x, 1.0 / y),
            metadata={"spacing": z, "unit": grid.unit, "axes": "ZYX"},
        )
    else:
        tifffile.imwrite(path, array)


def write_volume(path: Path | str, array: np.ndarray, meta: VolumeMeta) -> None:
    """Write atomically (temporary file in the same folder, then rename) in ``meta``'s format,
    on ``meta``'s grid."""
    if meta.ext == ".zarr":
        write_zarr(path, array, meta)
        return
    with atomic_path(path, suffix=meta.ext) as tmp:
        if meta.ext in (".nii", ".nii.gz"):
            import nibabel as nib

            header = meta.header.copy() if meta.header is not None else None
            img = nib.Nifti1Image(array, meta.affine, header)
            img.set_data_dtype(array.dtype)
            nib.save(img, tmp)
        elif meta.ext in (".tif", ".tiff"):
            write_tiff(tmp, array, meta.grid)
        else:
            with open(tmp, "wb") as f:
                np.save(f, array)
