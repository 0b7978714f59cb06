"""Training volumes larger than memory (``--data-access mmap``): patches read from disk on demand.

A volume is a :class:`MappedArray`: the file, the dtype, the shape and the byte offset of its
voxels (a C-order ``.npy``, or an uncompressed contiguous TIFF). Each read maps the file, copies
the patch and unmaps it, so a process holds only the patches in flight (a mapping kept open
would count every page ever read as resident). A zarr or OME-Zarr volume (:class:`ZarrRegion`)
and a compressed or tiled TIFF (:class:`TiffRegion`, through tifffile's zarr interface) need no
mapping: only the chunks, strips or tiles a patch touches are read and decoded. Compressed NIfTI
cannot be read by regions: ``python -m app.convert`` turns it into ``.npy`` once.

Per volume, one streaming pass (slab by slab, bounded memory) finds what the in-memory path
learns from the whole array: the exact mean and std, percentiles from a strided sample, NaN/Inf,
whether the label is binary, and a coarse foreground index (foreground voxels per block of
:data:`BLOCK` voxels). A foreground-centred patch picks a block in proportion to its count, then
a foreground voxel inside it: uniform over the foreground, as the in-memory path draws, with one
small read. Rank 0 writes the results to ``RUN_DIR/data_index/``, keyed by each file's size and
modification time, and every rank reads them from there.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from app.atomic import atomic_write, atomic_write_bytes, os_cause
from app.data.dataset import (
    SPLITS,
    DataError,
    Normalization,
    Volume,
    check_same_grid,
    load_split,
    pair_files,
)
from app.data.volume_io import VolumeError, split_ext, volume_geometry, zarr_array
from app.labels import FOREGROUND_SAMPLES

BLOCK = (8, 16, 16)  # voxels per cell of the coarse foreground index
SLAB_BYTES = 64 << 20  # a streaming pass reads this much at a time
SAMPLE_VOXELS = 1_000_000  # strided sample for the percentiles


class _Regions:
    """What the index pass and the patches need of a 3D array on disk besides its reads."""

    dtype: str
    shape: tuple[int, int, int]

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def slabs(self):
        """(start, stop) along the first axis, about :data:`SLAB_BYTES` each."""
        plane = max(1, self.size // self.shape[0] * np.dtype(self.dtype).itemsize)
        step = max(1, SLAB_BYTES // plane)
        for start in range(0, self.shape[0], step):
            yield start, min(start + step, self.shape[0])


@dataclass(frozen=True)
class MappedArray(_Regions):
    """A 3D array in a file, read a region at a time; picklable for DataLoader workers."""

    path: str
    dtype: str
    shape: tuple[int, int, int]
    offset: int

    def __getitem__(self, window: tuple[slice, ...]) -> np.ndarray:
        try:
            mapped = np.memmap(self.path, self.dtype, "r", self.offset, self.shape)
        except OSError as exc:  # the data root went away or lost its permissions mid-run
            raise DataError(f"{self.path}: cannot read: {os_cause(exc)}") from exc
        try:
            return np.array(mapped[window])
        finally:
            del mapped  # unmapped: the pages read leave this process's resident set


@dataclass(frozen=True)
class ZarrRegion(_Regions):
    """A zarr array (or an OME-Zarr image's full resolution) read a region at a time; opened
    per read, so it pickles as a path for DataLoader workers."""

    path: str
    dtype: str
    shape: tuple[int, int, int]

    def __getitem__(self, window: tuple[slice, ...]) -> np.ndarray:
        try:
            return np.asarray(zarr_array(self.path)[window])
        except OSError as exc:  # the data root went away or lost its permissions mid-run
            raise DataError(f"{self.path}: cannot read: {os_cause(exc)}") from exc


@dataclass(frozen=True)
class TiffRegion(_Regions):
    """A compressed or tiled TIFF read a region at a time through tifffile's zarr interface,
    which decodes only the strips or tiles a patch touches."""

    path: str
    dtype: str
    shape: tuple[int, int, int]

    def __getitem__(self, window: tuple[slice, ...]) -> np.ndarray:
        import tifffile
        import zarr

        try:
            store = tifffile.imread(self.path, aszarr=True)
        except OSError as exc:  # the data root went away or lost its permissions mid-run
            raise DataError(f"{self.path}: cannot read: {os_cause(exc)}") from exc
        try:
            return np.asarray(zarr.open(store, mode="r")[window])
        finally:
            store.close()


Regions = MappedArray | ZarrRegion | TiffRegion


def open_mapped(path: Path) -> Regions:
    """The voxels of ``path`` read by regions: a :class:`MappedArray` (C-order ``.npy``,
    uncompressed TIFF), a :class:`TiffRegion` (compressed or tiled TIFF) or a
    :class:`ZarrRegion`; a clear error for what cannot be read so."""
    ext = split_ext(path)[1]
    convert = "convert it once with python -m app.convert (see README)"
    if ext == ".zarr":
        return open_zarr(path)
    try:
        if ext == ".npy":
            header = np.load(path, mmap_mode="r", allow_pickle=False)
            shape, dtype, offset = header.shape, header.dtype, header.offset
            fortran = header.ndim > 1 and not header.flags.c_contiguous
            del header
            if fortran:
                raise VolumeError(
                    f"{path}: a Fortran-order .npy cannot be read by patches; {convert}"
                )
        elif ext in (".tif", ".tiff"):
            import tifffile

            with tifffile.TiffFile(str(path)) as tif:
                series = tif.series[0]
                shape, dtype, offset = series.shape, series.dtype, series.dataoffset
        else:
            raise VolumeError(f"{path}: {ext} cannot be memory-mapped; {convert}")
    except VolumeError:
        raise
    except Exception as exc:  # every reader fails its own way on a bad file
        raise VolumeError(
            f"{path}: cannot read {ext} header, corrupt or truncated? ({exc})"
        ) from exc
    dtype = np.dtype(dtype)
    if len(shape) != 3 or dtype.kind not in "biuf":
        raise VolumeError(f"{path}: expected a 3D numeric array, got {dtype} {tuple(shape)}")
    if offset is None:  # a compressed or tiled TIFF: decoded by strips or tiles instead
        return TiffRegion(str(path), dtype.str, tuple(int(s) for s in shape))
    mapped = MappedArray(str(path), dtype.str, tuple(int(s) for s in shape), int(offset))
    expected = mapped.offset + mapped.size * dtype.itemsize
    if Path(path).stat().st_size < expected:
        raise VolumeError(f"{path}: truncated ({Path(path).stat().st_size} of {expected} bytes)")
    return mapped


@dataclass(frozen=True)
class VolumeIndex:
    """What one streaming pass over an image and its label found."""

    mean: float
    std: float
    low: float  # 0.5th percentile (of a strided sample)
    high: float  # 99.5th
    minimum: float
    foreground: int  # voxels
    counts_file: str  # the coarse foreground index, an .npy of BLOCK cells

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def open_zarr(path: Path) -> ZarrRegion:
    try:
        array = zarr_array(path)
    except VolumeError:
        raise
    except Exception as exc:  # zarr's own errors for a folder that is not a zarr store
        raise VolumeError(f"{path}: cannot read .zarr, not a zarr array? ({exc})") from exc
    dtype = np.dtype(array.dtype)
    if array.ndim != 3 or dtype.kind not in "biuf":
        raise VolumeError(f"{path}: expected a 3D numeric array, got {dtype} {array.shape}")
    return ZarrRegion(str(path), dtype.str, tuple(int(s) for s in array.shape))


def file_key(path: str) -> list:
    """What tells an index that its volume changed: size and modification time (of every file
    of a zarr folder)."""
    if Path(path).is_dir():
        files = [p.stat() for p in Path(path).rglob("*") if p.is_file()]
        size = sum(f.st_size for f in files)
        return [path, size, max((f.st_mtime_ns for f in files), default=0)]
    stat = Path(path).stat()
    return [path, stat.st_size, stat.st_mtime_ns]


def index_volume(image: Regions, label: Regions, folder: Path, name: str) -> VolumeIndex:
    """Stream ``image`` and ``label`` once; raise VolumeError naming the file for NaN/Inf or a
    label that is not binary. The foreground counts go to ``folder/NAME.counts.npy``."""
    (image_shape, image_grid), (label_shape, label_grid) = (
        volume_geometry(image.path),
        volume_geometry(label.path),
    )
    check_same_grid(
        Path(image.path), image_shape, image_grid, Path(label.path), label_shape, label_grid
    )
    cells = tuple(math.ceil(s / b) for s, b in zip(image.shape, BLOCK))
    counts = np.zeros(cells, np.uint32)
    total, total_sq, minimum, bad, values = 0.0, 0.0, math.inf, 0, set()
    stride = max(1, round((image.size / SAMPLE_VOXELS) ** (1 / 3)))
    samples = []
    for start, stop in image.slabs():
        part = image[start:stop].astype(np.float64)
        bad += int(np.count_nonzero(~np.isfinite(part)))
        total += float(part.sum())
        total_sq += float(np.square(part).sum())
        minimum = min(minimum, float(part.min()))
        first = (-start) % stride
        samples.append(part[first::stride, ::stride, ::stride].ravel())
        mask = label[start:stop]
        values.update(np.unique(mask).tolist())
        if len(values) > 2:
            break
        fg = mask != 0
        padded = np.zeros((fg.shape[0], cells[1] * BLOCK[1], cells[2] * BLOCK[2]), bool)
        padded[:, : fg.shape[1], : fg.shape[2]] = fg
        per_plane = padded.reshape(fg.shape[0], cells[1], BLOCK[1], cells[2], BLOCK[2]).sum((2, 4))
        np.add.at(counts, (start + np.arange(fg.shape[0])) // BLOCK[0], per_plane)
    if bad:
        raise VolumeError(f"{image.path}: {bad} NaN/Inf voxel(s); clean the volume first")
    if not (values <= {0, 1} or values <= {0, 255} or values <= {False, True}):
        shown = ", ".join(f"{v:g}" for v in sorted(values)[:8])
        raise VolumeError(
            f"{label.path}: labels must be binary ({{0, 1}}, {{0, 255}} or bool); found {shown}"
        )
    mean = total / image.size
    std = math.sqrt(max(total_sq / image.size - mean * mean, 0.0))
    low, high = np.percentile(np.concatenate(samples), (0.5, 99.5))
    counts_file = folder / f"{name}.counts.npy"
    atomic_write(counts_file, lambda f: np.save(f, counts))
    return VolumeIndex(
        mean, std, float(low), float(high), minimum, int(counts.sum()), str(counts_file)
    )


def build_index(pairs: list[tuple[str, Path, Path]], folder: Path) -> list[str]:
    """Index every (name, image, label) not already indexed under ``folder`` (by file size and
    modification time); returns the problems, one line each, all at once."""
    folder.mkdir(parents=True, exist_ok=True)
    problems = []
    for name, image_path, label_path in pairs:
        entry = folder / f"{name}.json"
        key = [file_key(str(image_path)), file_key(str(label_path))]
        if entry.is_file() and json.loads(entry.read_text()).get("key") == key:
            continue
        try:
            image, label = open_mapped(image_path), open_mapped(label_path)
            found = index_volume(image, label, folder, name)
        except VolumeError as exc:
            problems.append(str(exc))
            continue
        atomic_write_bytes(entry, json.dumps({"key": key, **found.to_dict()}).encode())
    return problems


def read_index(folder: Path, name: str) -> VolumeIndex:
    saved = json.loads((folder / f"{name}.json").read_text())
    saved.pop("key")
    return VolumeIndex(**saved)


@dataclass(frozen=True)
class PatchScale:
    """``(clip(x, low, high) - shift) / scale``: a volume's normalisation, applied per patch."""

    low: float = -math.inf
    high: float = math.inf
    shift: float = 0.0
    scale: float = 1.0

    @classmethod
    def of(cls, normalization: Normalization, index: VolumeIndex) -> PatchScale:
        """The same scaling as :class:`app.data.dataset.Normalization` on the whole volume (with the
        percentiles of a strided sample)."""
        mode = normalization.mode
        if mode == "zscore":
            return cls(shift=index.mean, scale=max(index.std, 1e-8))
        if mode == "percentile":
            return cls(index.low, index.high, index.low, max(index.high - index.low, 1e-8))
        if mode == "dataset":
            n = normalization
            return cls(n.low, n.high, n.mean, max(n.std, 1e-8))
        return cls()

    def __call__(self, image: np.ndarray) -> np.ndarray:
        image = image.astype(np.float32, copy=False)
        return ((np.clip(image, self.low, self.high) - self.shift) / self.scale).astype(np.float32)


@dataclass
class LazyVolume:
    """A training volume read a patch at a time; the interface of :class:`app.data.dataset.Volume`
    that :class:`app.data.dataset.PatchDataset` uses."""

    name: str
    image: Regions
    label: Regions
    image_path: Path
    scale: PatchScale
    index: VolumeIndex

    def __post_init__(self) -> None:
        self.cumulative = np.cumsum(np.load(self.index.counts_file).ravel(), dtype=np.int64)

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.image.shape

    @property
    def has_foreground(self) -> bool:
        return self.index.foreground > 0

    def patch(self, window: tuple[slice, ...]) -> tuple[np.ndarray, np.ndarray]:
        return self.scale(self.image[window]), (self.label[window] != 0).astype(np.uint8)

    def foreground_centre(self, rng: np.random.Generator) -> tuple[int, ...]:
        """A foreground voxel drawn uniformly: a cell in proportion to its count, then the
        voxel of that rank inside it (one read of one cell of the label)."""
        k = int(rng.integers(self.index.foreground))
        cell = int(np.searchsorted(self.cumulative, k, side="right"))
        before = int(self.cumulative[cell - 1]) if cell else 0
        cells = tuple(math.ceil(s / b) for s, b in zip(self.shape, BLOCK))
        corner = [c * b for c, b in zip(np.unravel_index(cell, cells), BLOCK)]
        window = tuple(slice(c, min(c + b, s)) for c, b, s in zip(corner, BLOCK, self.shape))
        inside = np.flatnonzero(self.label[window])[k - before]
        offset = np.unravel_index(int(inside), tuple(w.stop - w.start for w in window))
        return tuple(int(c + o) for c, o in zip(corner, offset))

    def sampled(self, stride: int = 4) -> Volume:
        """Every ``stride``-th voxel on each axis, in memory and normalised (for the classical
        floor, which needs intensities and labels, not patches)."""
        planes = range(0, self.shape[0], stride)
        every = (slice(None, None, stride), slice(None, None, stride))
        image = np.stack([self.image[(slice(z, z + 1), *every)][0] for z in planes])
        label = np.stack([self.label[(slice(z, z + 1), *every)][0] for z in planes])
        return Volume(self.name, self.scale(image), (label != 0).astype(np.uint8), self.image_path,
                      np.flatnonzero(label))  # fmt: skip

    def in_memory(self) -> Volume:
        """The whole volume as an :class:`app.data.dataset.Volume` (for one smaller than the
        patch)."""
        whole = (slice(None),) * 3
        image, label = self.patch(whole)
        foreground = np.flatnonzero(label)[:FOREGROUND_SAMPLES]
        return Volume(self.name, image, label, self.image_path, foreground)


def raw_sample(image: Regions, stride: int) -> np.ndarray:
    """Every ``stride``-th voxel of ``image`` on each axis, read a plane at a time."""
    every = (slice(None, None, stride), slice(None, None, stride))
    return np.concatenate(
        [image[(slice(z, z + 1), *every)].ravel() for z in range(0, image.shape[0], stride)]
    )


def index_split(root: Path | str, index_dir: Path) -> None:
    """Build (or bring up to date) the index of the training split; DataError with every
    problem at once."""
    problems = build_index(pair_files(Path(root) / SPLITS["train"]), index_dir)
    if problems:
        raise DataError("\n".join(problems))


def load_mapped_train_val(
    root: Path | str,
    mode: str,
    seed: int,
    index_dir: Path,
    fitted: Normalization | None = None,
) -> tuple[list[LazyVolume], list[Volume], Normalization]:
    """The training split read by patches (indexed by :func:`index_split` first), the
    validation split in memory (it is evaluated whole), both normalised alike."""
    pairs = pair_files(Path(root) / SPLITS["train"])
    mapped = [(name, open_mapped(image), open_mapped(label), image) for name, image, label in pairs]
    indexes = [read_index(index_dir, name) for name, *_ in mapped]
    if fitted is None:
        stride = max(1, round((sum(m[1].size for m in mapped) / SAMPLE_VOXELS) ** (1 / 3)))
        fitted = Normalization.fit(mode, [raw_sample(image, stride) for _, image, _, _ in mapped])
    train = [
        LazyVolume(name, image, label, path, PatchScale.of(fitted, index), index)
        for (name, image, label, path), index in zip(mapped, indexes)
    ]
    return train, load_split(root, "val", fitted, seed), fitted
