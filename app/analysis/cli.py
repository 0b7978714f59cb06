"""Command-line pieces shared by the tools (``app.analysis.predict``, ``app.analysis.evaluate``,
``app.analysis.grains``, ``app.analysis.report``), in one module so that no command imports another
for a helper."""

from __future__ import annotations

import argparse


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the epilog's line breaks; shows a default only where there is one to show."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default not in (None, False, argparse.SUPPRESS) and "default" not in text:
            text += " (default: %(default)s)"
        return text
