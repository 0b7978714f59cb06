"""torchrun, with its outcome in one line: ``launch.sh`` runs ``python -m app.launcher ARGS``,
where ARGS are torchrun's.

When a worker exits non-zero, torchrun raises ``ChildFailedError`` and Python prints it as a
traceback with a summary box; when torchrun itself is signalled, it raises ``SignalException``.
The worker has already said what went wrong in one line (``error: ...``), so here torchrun's
outcome becomes one more line and an exit code that keeps its meaning for a restart policy: the
first failed worker's own code (2: a mistake, a restart would fail alike; 128 + N: signal N,
worth a restart), or 128 + N when torchrun was stopped by signal N.

torchrun's options differ by release: ``--shutdown-timeout`` (the grace between passing on a
SIGTERM and SIGKILL) exists only from torch 2.12, and older torchruns refuse the whole command
line over it. ``launch.sh`` always asks for its grace; here the torchrun that will run is asked
once, through its own parser, and an option it lacks is dropped with one line saying what the
run gets instead, so the same ``launch.sh`` starts on every image's torch.
"""

from __future__ import annotations

import sys

import torch
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import get_args_parser
from torch.distributed.run import main as torchrun

# Options launch.sh may pass that not every torchrun has: what a torchrun without one does
# instead, for the line that says so.
OPTIONAL_OPTIONS = {
    "--shutdown-timeout": (
        "after a SIGTERM its workers get torchrun's fixed 30 s before SIGKILL, "
        "not SHUTDOWN_TIMEOUT={value} s"
    ),
}


def torchrun_options() -> set[str]:
    """Every option string the installed torchrun's parser accepts."""
    return {flag for action in get_args_parser()._actions for flag in action.option_strings}


def drop_unsupported(argv: list[str], supported: set[str]) -> tuple[list[str], list[str]]:
    """``argv`` without the optional options (and their values) that ``supported`` lacks, and
    one note for each option dropped. Only torchrun's part, before ``-m MODULE`` (launch.sh
    always runs a module), is looked at: the trainer's flags after it are not torchrun's."""
    kept: list[str] = []
    notes: list[str] = []
    args = iter(argv)
    for arg in args:
        if arg == "-m":
            kept.append(arg)
            kept.extend(args)
            break
        name, has_value, value = arg.partition("=")
        if name in OPTIONAL_OPTIONS and name not in supported:
            if not has_value:
                value = next(args, "")
            notes.append(
                f"launch.sh: this torchrun (torch {torch.__version__}) has no {name}: "
                + OPTIONAL_OPTIONS[name].format(value=value)
            )
            continue
        kept.append(arg)
    return kept, notes


def failed_worker(exc: ChildFailedError) -> tuple[int, int]:
    """(global rank, exit code) of the first worker that failed; killed by signal N is 128 + N,
    as a shell reports it."""
    rank, failure = exc.get_first_failure()
    code = failure.exitcode
    return rank, 128 - code if code < 0 else code


def main(argv: list[str] | None = None) -> int:
    argv, notes = drop_unsupported(sys.argv[1:] if argv is None else argv, torchrun_options())
    for note in notes:
        print(note, file=sys.stderr)
    try:
        torchrun(argv)
    except ChildFailedError as exc:
        rank, code = failed_worker(exc)
        print(
            f"launch.sh: {exc.name} failed: rank {rank} exited with {code} (its error is above)",
            file=sys.stderr,
        )
        return code or 1
    except SignalException as exc:
        print(f"launch.sh: torchrun stopped by {exc.sigval.name}", file=sys.stderr)
        return 128 + int(exc.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
