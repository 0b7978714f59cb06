"""Write ``docs/configuration.md`` from the configuration's own help: ``python -m app.config_doc``.

Every setting of :class:`app.config.Config`, section by section (the flag groups of
``python -m app.train --help``), with its flag, YAML key, default, choices and help. The page is
generated, never edited: ``tests/test_config_doc.py`` fails when it differs from what this module
writes, so a changed flag shows up as a stale page in the same commit.
"""

from __future__ import annotations

import sys
import typing
from pathlib import Path
from typing import Literal, get_args, get_origin

from app.config import FIELDS, Config, removed_settings, show_default

PAGE = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
INTRO = """\
# Configuration

Generated from `app/config.py` by `python -m app.config_doc`; edit the help there, not this page.

Every setting has a flag (`--patch-size 32 160 160`) and a YAML key of the same name with
underscores (`patch_size: [32, 160, 160]`). The order is defaults < the YAML file of `--config` <
flags. `python -m app.train --help` prints the same help; a run's `config.yaml` records its
settings (and, under `resolved:`, what its `auto` values resolved to) and can be passed back as
`--config`.
"""


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def choices(name: str) -> str:
    hint = typing.get_type_hints(Config)[name]
    if get_origin(hint) is Literal:
        return ", ".join(f"`{c}`" for c in get_args(hint))
    if hint is bool:
        return f"`--{name.replace('_', '-')}` / `--no-{name.replace('_', '-')}`"
    return ""


def markdown() -> str:
    sections: dict[str, list[str]] = {}
    for name, f in FIELDS.items():
        flag = "--" + name.replace("_", "-")
        row = (
            f"| `{flag}` | `{name}` | `{cell(show_default(f)) or ' '}` | {choices(name)} | "
            f"{cell(f.metadata['help'])} |"
        )
        sections.setdefault(f.metadata["group"], []).append(row)
    out = [INTRO]
    for group, rows in sections.items():
        out += [f"## {group}", "", "| flag | YAML key | default | choices | meaning |"]
        out += ["| --- | --- | --- | --- | --- |", *rows, ""]
    removed = removed_settings()
    if removed:
        out += ["## Removed settings", "", "| flag / YAML key | instead |", "| --- | --- |"]
        out += [f"| `--{n.replace('_', '-')}` / `{n}` | {cell(why)} |" for n, why in removed]
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    PAGE.write_text(markdown())
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
