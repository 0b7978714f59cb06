"""Convert a data root to ``.npy`` volumes that ``--data-access mmap`` reads by patches.

    python -m app.convert --data-root datasets/IronGrain/74x320x320 --out /cache/irongrain-npy

Compressed NIfTI (``.nii.gz``) cannot be read by regions (compressed or tiled TIFF and zarr can,
but a plain ``.npy`` is the fastest to read patches from, and TIFF compressed by whole pages
decodes every page a patch spans). This copies
the layout (``{train,val}_patches/{images,labels}/NAME``) with every volume as a C-order ``.npy``
of the same dtype and values, written atomically; a volume already converted (an ``.npy`` newer
than its source) is skipped, so an interrupted conversion continues where it stopped. NIfTI
volumes are read a slab at a time along their last axis (the slowest in the file), so a
``.nii.gz`` larger than memory converts in one sequential pass.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from app.atomic import atomic_path, os_cause
from app.data.dataset import SPLITS, DataError, pair_files
from app.data.volume_io import VolumeError, read_volume, split_ext

SLAB_BYTES = 256 << 20


def convert_volume(source: Path, target: Path) -> bool:
    """Write ``source`` as ``target`` (.npy); False when ``target`` is already up to date."""
    if target.is_file() and target.stat().st_mtime_ns >= source.stat().st_mtime_ns:
        return False
    ext = split_ext(source)[1]
    with atomic_path(target, suffix=".npy") as tmp:
        if ext in (".nii", ".nii.gz"):
            import nibabel as nib

            try:
                proxy = nib.load(str(source)).dataobj
                shape, dtype = tuple(proxy.shape), np.dtype(proxy.dtype)
            except Exception as exc:  # nibabel's errors for a bad file vary
                raise VolumeError(f"{source}: cannot read .nii header ({exc})") from exc
            if len(shape) != 3:
                raise VolumeError(f"{source}: expected a 3D array (D, H, W), got shape {shape}")
            out = np.lib.format.open_memmap(tmp, mode="w+", dtype=dtype, shape=shape)
            step = max(1, SLAB_BYTES // max(1, shape[0] * shape[1] * dtype.itemsize))
            for start in range(0, shape[2], step):
                out[..., start : start + step] = np.asarray(proxy[..., start : start + step])
            out.flush()
            del out
        else:
            array, _ = read_volume(source)
            np.save(tmp, np.ascontiguousarray(array))
    return True


def convert_root(root: Path, out: Path) -> int:
    converted = 0
    for split in SPLITS.values():
        for name, image, label in pair_files(root / split):
            for kind, source in (("images", image), ("labels", label)):
                converted += convert_volume(source, out / split / kind / f"{name}.npy")
    return converted


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m app.convert", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--data-root", type=Path, required=True, help="the data root to convert")
    parser.add_argument("--out", type=Path, required=True, help="the .npy data root to write")
    args = parser.parse_args(argv)
    if args.out.resolve() == args.data_root.resolve():
        print(f"error: --out {args.out}: must differ from --data-root", file=sys.stderr)
        return 2
    try:
        converted = convert_root(args.data_root, args.out)
    except (DataError, VolumeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"error: {exc.filename or args.out}: {os_cause(exc)}", file=sys.stderr)
        return 2
    print(f"converted {converted} volume(s) into {args.out} (train with --data-access mmap)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
