"""launch.sh on every torch an image ships: it asks the torchrun it runs for its options and
passes --shutdown-timeout only to one that has it (torch >= 2.12), saying what the grace is
otherwise. Tested with the installed torchrun and with a stand-in of an older one
(tests/old_torchrun_standin.py: the same torchrun without the option)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import ROOT, TINY, write_dataset

from app.distributed import PEER_LOST_EXIT
from app.launcher import drop_unsupported, torchrun_options

NOTE = "has no --shutdown-timeout"
TORCHRUN_PART = ["--standalone", "--nproc-per-node", "2", "--max-restarts", "0"]


def test_installed_torchrun_is_asked_and_keeps_the_grace():
    assert "--shutdown-timeout" in torchrun_options()  # torch 2.13 (requirements-cpu.txt)
    argv = [*TORCHRUN_PART, "--shutdown-timeout", "120", "-m", "app.train", "--epochs", "1"]
    assert drop_unsupported(argv, torchrun_options()) == (argv, [])


@pytest.mark.parametrize("form", [["--shutdown-timeout", "150"], ["--shutdown-timeout=150"]])
def test_an_older_torchrun_gets_no_shutdown_timeout_and_the_grace_is_said(form):
    supported = torchrun_options() - {"--shutdown-timeout", "--shutdown_timeout"}
    argv = [*TORCHRUN_PART, *form, "-m", "app.train", "--epochs", "1"]
    kept, notes = drop_unsupported(argv, supported)
    assert kept == [*TORCHRUN_PART, "-m", "app.train", "--epochs", "1"]
    assert len(notes) == 1
    assert NOTE in notes[0] and "fixed 30 s" in notes[0] and "SHUTDOWN_TIMEOUT=150" in notes[0]


def test_the_trainers_own_flags_are_never_touched():
    argv = ["-m", "app.train", "--shutdown-timeout", "5"]
    assert drop_unsupported(argv, set()) == (argv, [])


def older_torchrun_python(tmp_path: Path) -> Path:
    """An interpreter for launch.sh's PYTHON whose torchrun lacks --shutdown-timeout."""
    wrapper = tmp_path / "python-old-torchrun"
    standin = Path(__file__).with_name("old_torchrun_standin.py")
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{standin}" "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


@pytest.mark.slow
def test_launch_sh_trains_on_an_older_torchrun_and_says_its_grace(tmp_path):
    """(With the installed torchrun every launch.sh test of test_distributed.py checks that the
    option is passed without a word.)"""
    data = write_dataset(tmp_path / "data", n_train=2, n_val=1)
    python = older_torchrun_python(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "NPROC_PER_NODE"))}
    env.update(PYTHON=str(python), NPROC_PER_NODE="2", OMP_NUM_THREADS="1")
    run_dir = tmp_path / "run"
    args = [*TINY, "--data-root", str(data), "--output-dir", str(run_dir), "--epochs", "1"]
    result = subprocess.run(
        ["bash", "launch.sh", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert (run_dir / "checkpoints/last.pt").is_file()
    assert NOTE in result.stderr and "fixed 30 s" in result.stderr, result.stderr[-2000:]


GLOO_PEER_GONE = (
    "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
    "[127.0.0.1]:24465. This is typically caused by a remote worker crashing."
)


@pytest.mark.parametrize(
    "error",
    [RuntimeError(GLOO_PEER_GONE), torch.distributed.DistBackendError("NCCL error: remote")],
)
def test_a_lost_rank_exits_with_a_code_restart_policies_retry(monkeypatch, error, capsys):
    """The PyTorchJob's ExitCode policy retries exit codes >= 128 only: a rank whose peer died
    must not exit 1 (a traceback), which would fail the whole job for good."""
    import app.train

    def train(*args, **kwargs):
        raise error

    monkeypatch.setattr(app.train, "train", train)
    code = app.train.main(["--device", "cpu", "--output-dir", "unused", "--data-root", "."])
    assert code == PEER_LOST_EXIT >= 128
    assert "lost contact with another rank" in capsys.readouterr().err


def test_other_runtime_errors_still_raise(monkeypatch):
    import app.train

    def train(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(app.train, "train", train)
    with pytest.raises(RuntimeError, match="a bug"):
        app.train.main(["--device", "cpu", "--output-dir", "unused", "--data-root", "."])
