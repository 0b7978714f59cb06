"""Real multi-process behaviour on CPU with gloo: launch.sh, exact evaluation, legacy launcher,
a worker killed mid-epoch, and a simulated Kubeflow PyTorchJob with two pods of two ranks."""

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
from helpers import ROOT, TINY, free_port, records, write_dataset

from app.config import Config
from app.distributed import init_distributed

pytestmark = pytest.mark.slow
PYTHON = sys.executable


def clean_env(**extra):
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(
            (
                "PET_",
                "RANK",
                "LOCAL_RANK",
                "WORLD_SIZE",
                "MASTER_",
                "NNODES",
                "NODE_RANK",
                "NPROC_PER_NODE",
                "MAX_RESTARTS",
            )
        )
    }
    env.update(PYTHON=PYTHON, OMP_NUM_THREADS="1", **{k: str(v) for k, v in extra.items()})
    return env


def launch(args, timeout=240, **env):
    result = subprocess.run(
        ["bash", "launch.sh", *map(str, args)],
        cwd=ROOT,
        env=clean_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    # the installed torchrun (torch 2.13) has --shutdown-timeout: launch.sh keeps it, silently
    assert "has no --shutdown-timeout" not in result.stderr
    return result


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    # an odd number of validation volumes: 2 ranks get 2 and 1, with nothing padded
    return write_dataset(tmp_path_factory.mktemp("data"), n_train=4, n_val=3)


def test_two_cpu_processes_train_and_evaluate_exactly_like_one(data, tmp_path):
    run_dir = tmp_path / "run"
    argv = [*TINY, "--data-root", data, "--output-dir", run_dir, "--epochs", 2, "--tta"]
    launch(argv, NPROC_PER_NODE=2)
    assert [(r["epoch"], r["world_size"]) for r in records(run_dir)] == [(1, 2), (2, 2)]
    # --tta: at the end both ranks scored best.pt mirrored (rank 0 read it and sent its weights),
    # each volume once, as one process scores it
    mirrored = json.loads((run_dir / "eval.json").read_text())
    best = run_dir / "checkpoints/best.pt"
    assert mirrored["tta"] is True and mirrored["checkpoint"] == str(best)
    out = tmp_path / "mirrored1"
    argv = [*TINY, "--data-root", data, "--output-dir", out, "--eval-only", "--tta"]
    launch([*argv, "--resume", best], NPROC_PER_NODE=1)
    alone = json.loads((out / "eval.json").read_text())
    counts = [[(v["tp"], v["fp"], v["fn"]) for v in r["volumes"]] for r in (mirrored, alone)]
    assert counts[0] == counts[1] and alone["dice"] == mirrored["dice"]

    checkpoint = run_dir / "checkpoints/last.pt"
    reports = {}
    for nproc in (1, 2):
        out = tmp_path / f"eval{nproc}"
        launch(
            [
                *TINY,
                "--data-root",
                data,
                "--output-dir",
                out,
                "--eval-only",
                "--resume",
                checkpoint,
            ],
            NPROC_PER_NODE=nproc,
        )
        reports[nproc] = json.loads((out / "eval.json").read_text())
    one, two = reports[1], reports[2]
    assert [v["name"] for v in two["volumes"]] == ["vol_00", "vol_01", "vol_02"]
    for a, b in zip(one["volumes"], two["volumes"]):
        assert (a["tp"], a["fp"], a["fn"]) == (b["tp"], b["fp"], b["fn"])  # each counted once
    for key in ("dice", "iou", "dice_per_volume_mean"):
        assert one[key] == two[key]
    assert one["val_loss"] == pytest.approx(two["val_loss"], abs=1e-12)
    # and it matches the last training epoch's validation, computed by the 2-process run
    assert records(run_dir)[-1]["dice"] == one["dice"]


def test_legacy_torch_distributed_launch_local_rank(data, tmp_path):
    run_dir = tmp_path / "run"
    cmd = [
        PYTHON,
        "-m",
        "torch.distributed.launch",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(free_port()),
        "-m",
        "app.train",
        *TINY,
        "--data-root",
        str(data),
        "--output-dir",
        str(run_dir),
        "--epochs",
        "1",
    ]
    result = subprocess.run(
        cmd, cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=240
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert records(run_dir)[0]["world_size"] == 2


def test_local_rank_flag_is_used_without_the_env(monkeypatch):
    for name in ("LOCAL_RANK", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    env = init_distributed(Config(local_rank=1, device="cpu"))
    assert (env.local_rank, env.world_size, env.rank) == (1, 1, 0)


def worker_pids(marker, rank):
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if (
            f"TEST_MARKER={marker}".encode() in environ
            and f"RANK={rank}".encode() in environ
            and b"TORCHELASTIC_RESTART_COUNT=0" in environ
        ):
            pids.append(int(proc.name))
    return pids


def in_epoch(last: Path, epoch: int) -> bool:
    """Whether ``last`` is a mid-epoch checkpoint of ``epoch`` or later (written atomically: a
    reader sees the previous file or this one, never half of one)."""
    if not last.exists():
        return False
    position = torch.load(last, map_location="cpu", weights_only=True).get("position")
    return bool(position) and position["epoch"] >= epoch


def test_a_killed_worker_is_restarted_and_training_resumes(tmp_path):
    data = write_dataset(tmp_path / "data", n_train=6, n_val=1)
    run_dir = tmp_path / "run"
    marker = uuid.uuid4().hex
    args = [
        *TINY,
        "--data-root",
        data,
        "--output-dir",
        run_dir,
        "--epochs",
        3,
        "--samples-per-volume",
        10,
        "--batch-size",
        1,
        # a mid-epoch checkpoint every few steps: the file that says when epoch 2 is under way
        "--checkpoint-every-min",
        0.0001,
    ]
    proc = subprocess.Popen(
        ["bash", "launch.sh", *map(str, args)],
        cwd=ROOT,
        env=clean_env(NPROC_PER_NODE=2, MAX_RESTARTS=1, TEST_MARKER=marker),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        last = run_dir / "checkpoints/last.pt"
        deadline = time.time() + 120
        while not in_epoch(last, 2) and time.time() < deadline and proc.poll() is None:
            time.sleep(0.1)
        assert in_epoch(last, 2), "no mid-epoch checkpoint of epoch 2 was written"
        victims = worker_pids(marker, rank=1)
        assert victims, "rank 1 not found"
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        output, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output[-4000:]
    assert "resumed from" in output
    assert [r["epoch"] for r in records(run_dir)] == [1, 2, 3]


def test_pytorchjob_simulation_two_pods_four_ranks(data, tmp_path):
    run_dir = tmp_path / "run"  # the PVC both pods mount
    port = free_port()
    pods = []
    for node_rank in (0, 1):
        # exactly what the training operator injects into a Master (0) and a Worker (1) pod
        operator_env = {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "WORLD_SIZE": 2,
            "RANK": node_rank,
            "PET_NNODES": 2,
            "PET_NPROC_PER_NODE": 2,
            "PET_NODE_RANK": node_rank,
            "PET_MASTER_ADDR": "127.0.0.1",
            "PET_MASTER_PORT": port,
        }
        args = [*TINY, "--data-root", data, "--output-dir", run_dir, "--epochs", 1]
        pods.append(
            subprocess.Popen(
                ["bash", "launch.sh", *map(str, args)],
                cwd=ROOT,
                env=clean_env(**operator_env),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = [pod.communicate(timeout=240)[0] for pod in pods]
    for pod, output in zip(pods, outputs):
        assert pod.returncode == 0, output[-3000:]
    assert records(run_dir)[0]["world_size"] == 4
    assert "world size 4" in outputs[0]


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"NPROC_PER_NODE": "auto"}, "NPROC_PER_NODE must be a positive integer (not 'auto')"),
        ({"NNODES": "2"}, "NNODES=2 needs MASTER_ADDR"),
        ({"NNODES": "2", "MASTER_ADDR": "127.0.0.1", "NODE_RANK": "5"}, "NODE_RANK must be in"),
        ({"MAX_RESTARTS": "-1"}, "MAX_RESTARTS must be a non-negative integer"),
        ({"PET_NNODES": "2"}, "PET_NPROC_PER_NODE is not"),
    ],
)
def test_invalid_launch_settings_fail_before_training(env, message):
    result = subprocess.run(
        ["bash", "launch.sh", "--epochs", "1"],
        cwd=ROOT,
        env=clean_env(**env),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and message in result.stderr


def test_channels_last_ddp_has_no_grad_stride_warning(data, tmp_path):
    """The 1x1x1 head's gradient comes back with contiguous strides (same bytes); DDP warned
    "Grad strides do not match bucket view strides" on every channels_last run until the model
    restrided it (app.model._gradient_like)."""
    args = [*TINY, "--opt-level", "O0", "--memory-format", "channels_last", "--epochs", 1]
    done = launch([*args, "--data-root", data, "--output-dir", tmp_path / "run"], NPROC_PER_NODE=2)
    assert "finished epoch 1" in done.stderr
    assert "Grad strides do not match" not in done.stdout + done.stderr
