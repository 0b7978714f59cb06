"""I/O failures end in one line naming the path and the cause, exit non-zero, print no traceback,
and leave the last good checkpoint as it was: an unwritable or full output location, an
unreadable data root, ENOSPC in the middle of a checkpoint write (injected, and on a real tmpfs
where the tests run as root)."""

import errno
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch
from helpers import ROOT, write_dataset

import app.engine.checkpoint
from app.train import main


def run(args):
    return main([str(a) for a in args])


def one_error_line(err: str) -> str:
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, err
    return lines[0]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_dataset(tmp_path_factory.mktemp("data"), n_train=2, n_val=1)


def test_output_dir_under_a_file_is_one_line(data, tmp_path, tiny_args, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    assert run([*tiny_args, "--data-root", data, "--output-dir", blocker / "run"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert f"--output-dir {blocker / 'run'}" in line and "Not a directory" in line


def test_output_dir_without_permission_is_one_line(data, tmp_path, tiny_args, capsys, monkeypatch):
    locked = tmp_path / "locked"
    real_mkdir = Path.mkdir

    def mkdir(self, *args, **kwargs):  # what a non-root user gets in a folder of root's
        if locked in (self, *self.parents):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    assert run([*tiny_args, "--data-root", data, "--output-dir", locked / "run"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert f"--output-dir {locked / 'run'}" in line and "Permission denied (EACCES)" in line


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through permissions")
def test_read_only_output_dir_is_one_line(data, tmp_path, tiny_args, capsys):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    assert run([*tiny_args, "--data-root", data, "--output-dir", locked / "run"]) == 2
    assert "Permission denied" in one_error_line(capsys.readouterr().err)


def test_unreadable_data_root_is_one_line(data, tmp_path, tiny_args, capsys, monkeypatch):
    real_listdir = os.listdir

    def listdir(path="."):
        if Path(path) == data:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real_listdir(path)

    monkeypatch.setattr(os, "listdir", listdir)
    assert run([*tiny_args, "--data-root", data, "--output-dir", tmp_path / "run"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert f"--data-root {data}" in line and "Permission denied" in line


def test_unlistable_split_folder_is_one_line(data, tmp_path, tiny_args, capsys, monkeypatch):
    images = data / "train_patches" / "images"
    real_iterdir = Path.iterdir

    def iterdir(self):
        if self == images:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))
        return real_iterdir(self)

    monkeypatch.setattr(Path, "iterdir", iterdir)
    assert run([*tiny_args, "--data-root", data, "--output-dir", tmp_path / "run"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert f"{images}: cannot list this folder: Permission denied" in line


def test_enospc_in_a_checkpoint_write_keeps_the_last_one(
    data, tmp_path, tiny_args, capsys, monkeypatch
):
    run_dir = tmp_path / "run"
    args = [*tiny_args, "--data-root", data, "--output-dir", run_dir]
    assert run([*args, "--epochs", 1]) == 0
    last = run_dir / "checkpoints" / "last.pt"
    before = last.read_bytes()
    real_save = torch.save

    def save(obj, f, *a, **kw):  # half the bytes land, then the disk is full
        f.write(b"\0" * 1000)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(app.engine.checkpoint.torch, "save", save)
    capsys.readouterr()
    assert run([*args, "--epochs", 2]) == 2
    monkeypatch.setattr(app.engine.checkpoint.torch, "save", real_save)
    line = one_error_line(capsys.readouterr().err)
    assert f"{last}: checkpoint not written: No space left on device (ENOSPC)" in line
    assert "previous last.pt is kept" in line
    assert last.read_bytes() == before
    assert sorted(p.name for p in last.parent.iterdir()) == ["best.pt", "last.pt"]  # no temp
    assert torch.load(last, weights_only=True)["epoch"] == 1


def can_mount_tmpfs(tmp_path: Path) -> bool:
    if os.geteuid() != 0:
        return False
    probe = tmp_path / "probe"
    probe.mkdir()
    ok = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", probe]).returncode == 0
    if ok:
        subprocess.run(["umount", probe], check=True)
    return ok


@pytest.fixture
def small_disk(tmp_path):
    if not can_mount_tmpfs(tmp_path):
        pytest.skip("needs root and mount to make a small tmpfs")
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", disk], check=True)
    yield disk
    subprocess.run(["umount", disk], check=True)


def fill(disk: Path, leave: int) -> None:
    """Fill ``disk`` up to ``leave`` free bytes."""
    stat = os.statvfs(disk)
    free = stat.f_bavail * stat.f_frsize
    with open(disk / "filler", "wb") as f:
        f.write(b"\0" * max(0, free - leave))


def test_a_full_tmpfs_during_a_checkpoint_write(data, small_disk, tiny_args, capsys):
    run_dir = small_disk / "run"
    args = [*tiny_args, "--data-root", data, "--output-dir", run_dir]
    assert run([*args, "--epochs", 1]) == 0
    last = run_dir / "checkpoints" / "last.pt"
    before = last.read_bytes()
    assert len(before) > 64 * 1024
    fill(small_disk, leave=64 * 1024)  # room for the logs, not for a checkpoint
    capsys.readouterr()
    assert run([*args, "--epochs", 2]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert str(last) in line and "No space left on device (ENOSPC)" in line
    assert last.read_bytes() == before
    assert not list(last.parent.glob(".*.tmp"))


@pytest.mark.slow
def test_two_ranks_stop_together_when_rank_0_cannot_write(data, small_disk, tiny_args):
    """Rank 0's failed write reaches rank 1 (which would otherwise wait in a collective until
    the timeout): both exit at once with the same one-line error."""
    from test_distributed import clean_env

    run_dir = small_disk / "run"
    args = [*tiny_args, "--data-root", data, "--output-dir", run_dir]

    def launch(epochs):
        return subprocess.run(
            ["bash", "launch.sh", *map(str, args), "--epochs", str(epochs)],
            cwd=ROOT,
            env=clean_env(NPROC_PER_NODE=2),
            capture_output=True,
            text=True,
            timeout=180,
        )

    assert launch(1).returncode == 0
    last = run_dir / "checkpoints" / "last.pt"
    before = last.read_bytes()
    fill(small_disk, leave=64 * 1024)
    failed = launch(2)
    assert failed.returncode == 2 and "Traceback" not in failed.stderr, failed.stderr[-3000:]
    assert re.search(r"launch.sh: app.train failed: rank [01] exited with 2", failed.stderr)
    errors = [line for line in failed.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 2 and len(set(errors)) == 1, failed.stderr[-3000:]
    assert str(last) in errors[0] and "No space left on device" in errors[0]
    assert last.read_bytes() == before


def test_the_launcher_keeps_the_failed_workers_exit_code():
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from app.launcher import failed_worker

    def failure(code, at):
        f = ProcessFailure(local_rank=0, pid=1, exitcode=code, error_file="")
        f.timestamp = at
        return f

    exc = ChildFailedError("app.train", {1: failure(-15, 2), 0: failure(2, 1)})
    assert failed_worker(exc) == (0, 2)
    assert failed_worker(ChildFailedError("app.train", {1: failure(-9, 1)})) == (1, 137)
