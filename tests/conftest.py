"""Shared fixtures. The helpers behind them live in ``helpers`` (imported as a plain module),
which also sets the CPU-only test environment before torch is imported."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import TINY, write_dataset


@pytest.fixture
def dataset(tmp_path: Path) -> Path:
    return write_dataset(tmp_path / "data")


@pytest.fixture
def tiny_args() -> list[str]:
    return list(TINY)
