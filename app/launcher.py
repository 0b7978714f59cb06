"""torchrun, with its outcome in one line: ``launch.sh`` runs ``python -m app.launcher ARGS``,
where ARGS are torchrun's.

When a worker exits non-zero, torchrun raises ``ChildFailedError`` and Python prints it as a
traceback with a summary box; when torchrun itself is signalled, it raises ``SignalException``.
The worker has already said what went wrong in one line (``error: ...``), so here torchrun's
outcome becomes one more line and an exit code that keeps its meaning for a restart policy: the
first failed worker's own code (2: a mistake, a restart would fail alike; 128 + N: signal N,
worth a restart), or 128 + N when torchrun was stopped by signal N.
"""

from __future__ import annotations

import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main as torchrun


def failed_worker(exc: ChildFailedError) -> tuple[int, int]:
    """(global rank, exit code) of the first worker that failed; killed by signal N is 128 + N,
    as a shell reports it."""
    rank, failure = exc.get_first_failure()
    code = failure.exitcode
    return rank, 128 - code if code < 0 else code


def main(argv: list[str] | None = None) -> int:
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
