"""Checks that fail in a second, before a precision probe or a data load takes minutes: the run
dir can be written and the data root can be read. Each failure is one line naming the path, the
flag and the cause.
"""

from __future__ import annotations

import os
from pathlib import Path

from app.atomic import os_cause, probe_writable
from app.config import ConfigError
from app.data.dataset import DataError


def check_output_dir(run_dir: Path) -> None:
    """Create ``run_dir`` and write and delete a file there: a read-only mount, a missing
    permission or a full disk shows up now, not after the first epoch."""
    try:
        probe_writable(run_dir)
    except OSError as exc:
        where = exc.filename or run_dir
        raise ConfigError(f"--output-dir {run_dir}: cannot write {where}: {os_cause(exc)}") from exc


def check_data_root(root: Path) -> None:
    """List the data root: an unreadable or missing root is named before anything loads."""
    try:
        os.listdir(root)
    except FileNotFoundError:
        raise DataError(
            f"{root}: data root is missing (--data-root); see datasets/README.md"
        ) from None
    except OSError as exc:
        raise DataError(f"--data-root {root}: cannot read it: {os_cause(exc)}") from exc
