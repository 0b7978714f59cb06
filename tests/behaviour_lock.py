"""Fingerprints of tiny fixed-seed training runs, so that a refactor can prove it changed nothing.

    python tests/behaviour_lock.py            # print this machine's fingerprints
    python tests/behaviour_lock.py --record   # store them in tests/data/behaviour_lock.json
    python tests/behaviour_lock.py --fixture  # rewrite tests/data/last_epoch1.pt (see below)

A fingerprint is the sha256 of the final weights and optimizer state (every tensor's name,
dtype, shape and bytes, in key order) and of ``metrics.jsonl`` without its clock readings, for a
binary and a 3-class run (``--num-classes 3``) of two epochs on one CPU process.

Floating-point results depend on the CPU's vector instructions and on the torch build, so the
stored fingerprints are keyed by both (:func:`machine_key`); on a machine with no entry the test
skips and says how to record one, from a commit whose behaviour is the reference.

``last_epoch1.pt`` is the ``last.pt`` after epoch 1 of a binary run of a smaller model
(``SMALL``, 25 KB), written by the trainer as it was before the redesign: the test resumes it to
epoch 2, proving the checkpoint format still loads, and its weights then are fingerprinted too
(``resume``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from helpers import BF16, TIMING, TINY, train_tiny, write_dataset, write_phases

DATA = Path(__file__).resolve().parent / "data"
LOCK = DATA / "behaviour_lock.json"
FIXTURE = DATA / "last_epoch1.pt"
# name -> (dataset writer, extra training flags)
RUNS = {
    "binary": (write_dataset, ()),
    "k3": (write_phases, ("--num-classes", "3")),
}
SMALL = ("--f-maps", "2", "--depth", "2")


def machine_key() -> str:
    """torch, its CPU kernel level and the CPU model: oneDNN picks other kernels (AMX,
    AVX512-BF16) on other CPUs of the same level, and float results differ with them."""
    from app.precision.hardware import cpu_info

    name, _ = cpu_info()
    return f"torch {torch.__version__} / {torch.backends.cpu.get_cpu_capability()} / {name}"


def tensor_digest(digest, prefix: str, value: Any) -> None:
    """Feed every tensor (and plain value) of a nested state into ``digest``, in key order."""
    if isinstance(value, dict):
        for key in sorted(value, key=str):
            tensor_digest(digest, f"{prefix}/{key}", value[key])
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            tensor_digest(digest, f"{prefix}/{i}", item)
    elif isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous().reshape(-1)
        digest.update(f"{prefix}:{value.dtype}:{tuple(value.shape)}".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    else:
        digest.update(f"{prefix}={value!r}".encode())


def run_fingerprint(run_dir: Path) -> dict[str, Any]:
    state = torch.load(run_dir / "checkpoints/last.pt", map_location="cpu", weights_only=True)
    weights = hashlib.sha256()
    tensor_digest(weights, "model", state["model"])
    tensor_digest(weights, "optimizer", state["optimizer"]["state"])
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    kept = [{k: v for k, v in row.items() if k not in TIMING} for row in rows]
    text = json.dumps(kept, sort_keys=True)
    return {
        "weights": weights.hexdigest(),
        "metrics": hashlib.sha256(text.encode()).hexdigest(),
        "dice": [row.get("dice") for row in rows],
        "train_loss": [row["train_loss"] for row in rows],
    }


def train_run(name: str, work: Path, *extra: str, epochs: int = 2) -> Path:
    writer, flags = RUNS[name]
    data = work / f"data-{name}"
    if not data.exists():
        writer(data)
    return train_tiny(data, work / f"run-{name}-{epochs}", *flags, *extra, epochs=epochs)


def resume_fixture(work: Path) -> Path:
    """Resume ``last_epoch1.pt`` to epoch 2 in a new run dir; returns the run dir."""
    from app.train import main as train_main

    run_dir = work / "run-resumed"
    (run_dir / "checkpoints").mkdir(parents=True)
    shutil.copyfile(FIXTURE, run_dir / "checkpoints/last.pt")
    data = work / "data-binary"
    if not data.exists():
        write_dataset(data)
    args = ["--data-root", data, "--output-dir", run_dir, "--epochs", 2, "--lr", 0.01]
    # the fixture was trained in bf16 autocast: resume it so on every machine
    assert train_main([*map(str, args), "--resume", "auto", *TINY, *SMALL, *BF16]) == 0
    return run_dir


def fingerprints(work: Path) -> dict[str, Any]:
    found = {name: run_fingerprint(train_run(name, work)) for name in RUNS}
    return found | {"resume": run_fingerprint(resume_fixture(work))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--record", action="store_true", help="store this machine's entry")
    parser.add_argument("--fixture", action="store_true", help=f"rewrite {FIXTURE.name}")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if args.fixture:
            run_dir = train_run("binary", work, *SMALL, epochs=1)
            shutil.copyfile(run_dir / "checkpoints/last.pt", FIXTURE)
        found = fingerprints(work)
        print(json.dumps({machine_key(): found}, indent=2))
        if args.record:
            lock = json.loads(LOCK.read_text()) if LOCK.exists() else {}
            lock[machine_key()] = found
            LOCK.write_text(json.dumps(lock, indent=2, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
