"""Command-line pieces shared by the tools (``app.analysis.predict``, ``app.analysis.evaluate``,
``app.analysis.grains``, ``app.analysis.report``), in one module so that no command imports another
for a helper."""

from __future__ import annotations

import argparse


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
