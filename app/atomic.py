"""Atomic file writes: a temporary file in the target's folder, flushed to disk, then renamed.

A writer killed at any point leaves the previous file intact (and at worst a hidden ``.NAME.*``
temporary next to it). Files get the usual permissions (``0o666`` less the umask), not the
``0o600`` of ``mkstemp``, so results on shared volumes stay readable.
"""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO


def os_cause(exc: OSError) -> str:
    """The cause of an I/O error in a few words: ``No space left on device (ENOSPC)``."""
    name = errno.errorcode.get(exc.errno or 0)
    return f"{exc.strerror or exc}" + (f" ({name})" if name else "")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _fsync(path: Path | str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path: Path | str, suffix: str = ".tmp") -> Iterator[Path]:
    """Yield a temporary path to write; on success it replaces ``path``, on error it is removed.

    ``suffix`` lets a writer that infers the format from the name (nibabel) see the extension.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=suffix)
    os.fchmod(fd, 0o666 & ~_umask())
    os.close(fd)
    try:
        yield Path(tmp)
        _fsync(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync(path.parent)


def probe_writable(folder: Path | str) -> None:
    """Create ``folder`` and write, sync and delete a hidden file there; raises the OSError of a
    read-only mount, a missing permission or a full disk now, before any result is computed."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    fd, probe = tempfile.mkstemp(dir=folder, prefix=".write-check.")
    try:
        os.write(fd, b"irongrain")
        os.fsync(fd)
    finally:
        os.close(fd)
        os.unlink(probe)


def atomic_write(path: Path | str, write: Callable[[BinaryIO], object]) -> None:
    """Call ``write(file_object)`` on a temporary file, then rename it to ``path``."""
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        write(f)


def atomic_write_bytes(path: Path | str, data: bytes) -> None:
    atomic_write(path, lambda f: f.write(data))
