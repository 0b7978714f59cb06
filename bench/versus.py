"""The training step of another git revision side by side with this tree's, in one run.

    python bench/versus.py --baseline 63eab3f --config configs/demo.yaml --precision bf16 \
        --candidate-flags "--compile on" --steps 5 --repeats 7

Each side is one worker process (``sys.path`` on its own tree: the baseline is ``git archive``d
into a temporary folder, the candidate is this checkout) that builds the trainer's own step,
``app.engine.steps.SyntheticStepper``, at world size 1 on one random batch already on the
device. The parent asks the workers in turn for one timed run of ``--steps`` steps, so both see
the same machine load, and prints the medians and the candidate's speed-up over the baseline.
Only one worker computes at a time; the other waits on its pipe.

Every trainer flag in the command (``--config``, ``--patch-size``, ``--f-maps``, ...) goes to
both sides and must mean the same in both revisions; ``--baseline-flags`` and
``--candidate-flags`` go to one side only (``--compile on`` exists in the candidate alone).
``--precision`` fixes the opt level, autocast dtype and memory format, so neither side resolves
``auto`` on its own.

A benchmark, not a test: figures hold on the hardware named in the header.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from app.config import load_config  # noqa: E402
from app.distributed import resolve_device  # noqa: E402
from bench.train_step import versions_line  # noqa: E402
from bench.utilisation import PRECISIONS  # noqa: E402

# Runs in the worker's own tree, so it uses only what both revisions have: load_config,
# resolve_device, DistEnv and SyntheticStepper (whose compile= exists in the candidate alone).
WORKER = """
import dataclasses, json, sys, time
tree, argv, settings = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
sys.path.insert(0, tree)
import torch
from app.config import load_config
from app.distributed import DistEnv, resolve_device
from app.engine.steps import SyntheticStepper
cfg = load_config(argv)
cfg = dataclasses.replace(cfg, **settings)
device = resolve_device(cfg.device, 0)
torch.manual_seed(cfg.seed)
compiled = getattr(cfg, "compile", "off") == "on"
stepper = SyntheticStepper(cfg, DistEnv(0, 0, 1, device), **({"compile": True} if compiled else {}))
def timed(steps):
    started = time.perf_counter()
    stepper.run(steps)  # ends with a host sync
    return time.perf_counter() - started
first = timed(1)
print(json.dumps({"first_s": first, "compiled": compiled}), flush=True)
for line in sys.stdin:
    print(json.dumps({"s": timed(int(line))}), flush=True)
"""


@dataclass
class Side:
    label: str
    tree: Path
    flags: list[str]
    process: subprocess.Popen | None = None
    first_s: float = 0.0
    compiled: bool = False
    times: list[float] = field(default_factory=list)

    def start(self, argv: list[str], settings: dict[str, str]) -> None:
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-c",
                WORKER,
                str(self.tree),
                json.dumps(argv + self.flags),
                json.dumps(settings),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=self.tree,
        )
        ready = self._answer()
        self.first_s, self.compiled = ready["first_s"], ready["compiled"]

    def run(self, steps: int) -> None:
        self.process.stdin.write(f"{steps}\n")
        self.process.stdin.flush()
        self.times.append(self._answer()["s"] / steps)

    def stop(self) -> None:
        if self.process:
            self.process.stdin.close()
            self.process.wait()

    def _answer(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            code = self.process.wait()
            raise SystemExit(
                f"bench/versus.py: the {self.label} worker in {self.tree} exited ({code})"
            )
        return json.loads(line)


def export(revision: str, into: Path) -> None:
    """``revision``'s files (not the working tree's) into ``into``."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", revision],
        capture_output=True,
    )
    if archive.returncode:
        raise SystemExit(
            f"bench/versus.py: --baseline {revision}: "
            f"{archive.stderr.decode().strip() or 'git archive failed'}"
        )
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        prog="bench/versus.py", description=__doc__.splitlines()[0], allow_abbrev=False
    )
    parser.add_argument("--baseline", required=True, help="git revision to compare against")
    parser.add_argument("--precision", choices=sorted(PRECISIONS), default="bf16")
    parser.add_argument(
        "--memory-format",
        choices=["channels_last", "contiguous"],
        default=None,
        help="both sides (default: channels_last on CPU, contiguous on CUDA)",
    )
    parser.add_argument("--steps", type=int, default=5, help="training steps per timed run")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per side (medians)")
    parser.add_argument("--baseline-flags", default="", help="trainer flags for the baseline only")
    parser.add_argument(
        "--candidate-flags",
        default="",
        help="trainer flags for this tree only, e.g. '--compile on'",
    )
    args, trainer_argv = parser.parse_known_args(argv)
    if args.steps < 1 or args.repeats < 1:
        parser.error("--steps and --repeats must be at least 1")
    return args, trainer_argv


def main(argv: list[str] | None = None) -> int:
    args, trainer_argv = parse_args(argv)
    device = resolve_device(load_config(trainer_argv).device, 0)  # checks the flags, too
    memory_format = args.memory_format or (
        "contiguous" if device.type == "cuda" else "channels_last"
    )
    level, dtype = PRECISIONS[args.precision]
    settings = {"opt_level": level, "amp_dtype": dtype, "memory_format": memory_format}
    with tempfile.TemporaryDirectory(prefix="versus-") as folder:
        export(args.baseline, Path(folder))
        sides = [
            Side(f"baseline {args.baseline}", Path(folder), shlex.split(args.baseline_flags)),
            Side("candidate (this tree)", ROOT, shlex.split(args.candidate_flags)),
        ]
        try:
            for side in sides:
                side.start(trainer_argv, settings)
            for _ in range(args.repeats):  # interleaved: both sides see the same machine load
                for side in sides:
                    side.run(args.steps)
        finally:
            for side in sides:
                side.stop()
    print(versions_line(device))
    print(
        f"{args.precision}, {memory_format}; trainer flags: {shlex.join(trainer_argv) or '-'}; "
        f"{args.steps} steps x {args.repeats} runs per side, interleaved, medians"
    )
    base = statistics.median(sides[0].times)
    print(
        f"{'side':<32} {'flags':<20} {'ms/step':>8} {'min':>6} {'max':>6} {'speed-up':>8} "
        f"{'first step s':>12}"
    )
    for side in sides:
        median = statistics.median(side.times)
        print(
            f"{side.label:<32} {' '.join(side.flags) or '-':<20} {median * 1000:>8.1f} "
            f"{min(side.times) * 1000:>6.1f} {max(side.times) * 1000:>6.1f} "
            f"{base / median:>7.2f}x {side.first_s:>12.1f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
