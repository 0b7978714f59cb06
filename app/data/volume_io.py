"""Reading and writing 3D volumes: NIfTI (nibabel), TIFF stacks (tifffile), ``.npy`` and zarr
(a ``NAME.zarr`` folder: a zarr array, or an OME-Zarr image whose full-resolution level is read).

Arrays are used in the axis order they are stored in and called (D, H, W). A volume read here
can be written back in its own format with its own NIfTI affine and header.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from app.atomic import atomic_path

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
    """What is needed to write a result next to its input in the same format."""

    ext: str
    affine: np.ndarray | None = None
    header: Any = None


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
        elif ext in (".tif", ".tiff"):
            import tifffile

            array = tifffile.imread(str(path))
            meta = VolumeMeta(ext)
        elif ext == ".zarr":
            array = np.asarray(zarr_array(path)[...])
            meta = VolumeMeta(ext)
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


def volume_header(path: Path | str) -> tuple[tuple[int, ...], tuple[float, float, float] | None]:
    """Shape and voxel spacing (the affine's column norms; NIfTI only, else ``None``) of a
    volume, read from its header without loading the voxels."""
    path = Path(path)
    ext = split_ext(path)[1]
    try:
        if ext in (".nii", ".nii.gz"):
            import nibabel as nib

            img = nib.load(str(path))
            spacing = tuple(float(v) for v in np.linalg.norm(img.affine[:3, :3], axis=0))
            return tuple(img.shape), spacing
        if ext in (".tif", ".tiff"):
            import tifffile

            with tifffile.TiffFile(str(path)) as tif:
                return tuple(tif.series[0].shape), None
        if ext == ".zarr":
            return tuple(zarr_array(path).shape), None
        return tuple(np.load(path, mmap_mode="r", allow_pickle=False).shape), None
    except VolumeError:
        raise
    except Exception as exc:  # as in read_volume: every reader fails its own way
        raise VolumeError(
            f"{path}: cannot read {ext} header, corrupt or truncated? ({exc})"
        ) from exc


NIFTI_UNITS = {"mm": "mm", "micron": "um", "meter": "m", "unknown": "mm"}


def voxel_spacing(meta: VolumeMeta, mode: str = "header") -> tuple[tuple[float, ...] | None, str]:
    """Voxel spacing (z, y, x) and its unit from a NIfTI header (mm when it names none), or
    ``(None, "voxel")`` for TIFF/NPY, a header without positive spacings, or ``mode="voxel"``."""
    if mode == "voxel" or meta.header is None:
        return None, "voxel"
    zooms = tuple(float(z) for z in meta.header.get_zooms()[:3])
    if any(not z > 0 for z in zooms):
        return None, "voxel"
    return zooms, NIFTI_UNITS.get(meta.header.get_xyzt_units()[0], "mm")


def write_zarr(path: Path | str, array: np.ndarray) -> None:
    """A zarr array folder, written beside ``path`` and renamed into place (an old one is moved
    aside first and removed after: a folder cannot be renamed over a non-empty one)."""
    import zarr

    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    old = path.with_name(f".{path.name}.{os.getpid()}.old")
    try:
        chunks = tuple(min(c, s) for c, s in zip(ZARR_CHUNKS, array.shape))
        out = zarr.create_array(str(tmp), shape=array.shape, dtype=array.dtype, chunks=chunks)
        out[...] = array
        if path.exists():
            os.replace(path, old)
        os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)


def write_volume(path: Path | str, array: np.ndarray, meta: VolumeMeta) -> None:
    """Write atomically (temporary file in the same folder, then rename) in ``meta``'s format."""
    if meta.ext == ".zarr":
        write_zarr(path, array)
        return
    with atomic_path(path, suffix=meta.ext) as tmp:
        if meta.ext in (".nii", ".nii.gz"):
            import nibabel as nib

            header = meta.header.copy() if meta.header is not None else None
            img = nib.Nifti1Image(array, meta.affine, header)
            img.set_data_dtype(array.dtype)
            nib.save(img, tmp)
        elif meta.ext in (".tif", ".tiff"):
            import tifffile

            tifffile.imwrite(tmp, array)
        else:
            with open(tmp, "wb") as f:
                np.save(f, array)
