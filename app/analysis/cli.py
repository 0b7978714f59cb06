"""Command-line pieces shared by the tools (``app.analysis.predict``, ``app.analysis.evaluate``,
``app.analysis.grains``, ``app.analysis.report``, ``app.analysis.learned_floor``), in one module so
that no command imports another for a helper."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import yaml

LEARNED_FLOOR_JSON = "learned_floor.json"  # in a run dir: app.analysis.learned_floor -> the report


class RunDirError(ValueError):
    """A file of a run directory is unusable; the message names the file."""


def run_config(run_dir: Path) -> dict[str, Any]:
    """The settings of a run directory of app.train (its ``config.yaml``); {} when it has none."""
    path = run_dir / "config.yaml"
    if not path.is_file():
        return {}
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise RunDirError(f"{path}: cannot read the run's config ({exc})") from exc
    return data if isinstance(data, dict) else {}


def add_spacing_argument(parser: argparse.ArgumentParser, sized: str) -> None:
    """``--spacing header|voxel``: ``sized`` (what is measured) in the voxel size the file
    states (``app.data.volume_io``: NIfTI, ImageJ/OME TIFF, zarr), or in voxels."""
    parser.add_argument(
        "--spacing",
        choices=["header", "voxel"],
        default="header",
        help=f"{sized} in the voxel size the file states, or in voxels",
    )


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the epilog's line breaks; shows a default only where there is one to show."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default not in (None, False, argparse.SUPPRESS) and "default" not in text:
            text += " (default: %(default)s)"
        return text
