"""The measurement cache: what a run measured about this machine, so that the next run starts at
once. One JSON file per measurement under ``$IRONGRAIN_CACHE_DIR`` (else
``$XDG_CACHE_HOME/irongrain``, else ``~/.cache/irongrain``), named by a hash of the facts it
depends on (device, torch version, threads, processes per node, model shape, ...): any change
measures again, and deleting the folder re-measures everything.

Used by the precision decision (``app.precision.auto``), the compile decision
(``app.engine.compiling``) and the practical peak (``app.engine.utilisation``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from app.atomic import atomic_write_bytes

log = logging.getLogger(__name__)


def cache_root() -> Path:
    """$IRONGRAIN_CACHE_DIR, else $XDG_CACHE_HOME/irongrain, else ~/.cache/irongrain."""
    if os.environ.get("IRONGRAIN_CACHE_DIR"):
        return Path(os.environ["IRONGRAIN_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "irongrain"


def cache_file(kind: str, facts: dict[str, Any]) -> Path:
    """Where the measurement of ``kind`` for ``facts`` is kept."""
    digest = hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:20]
    return cache_root() / kind / f"{digest}.json"


def load(path: Path, facts: dict[str, Any], key: str) -> Any | None:
    """The cached ``key`` of ``path`` when it was measured for ``facts``, else None; a damaged
    or foreign file is reported and ignored (the caller measures again)."""
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        return data[key] if data["facts"] == facts else None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("ignoring the cache file %s (%s); measuring again", path, exc)
        return None


def store(path: Path, facts: dict[str, Any], key: str, value: Any) -> None:
    """Best effort: a cache that cannot be written costs the next run a measurement."""
    try:
        data = {"facts": facts, key: value, "written": time.time()}
        atomic_write_bytes(path, (json.dumps(data, indent=2) + "\n").encode())
    except OSError as exc:
        log.warning("cannot write the cache %s (%s); set IRONGRAIN_CACHE_DIR", path, exc.strerror)
