"""Graceful preemption: SIGTERM mid-epoch -> every rank finishes its step, rank 0 writes a
mid-epoch checkpoint, the run exits 128 + 15, and ``--resume auto`` continues at that step with
the figures of an uninterrupted run (1e-6)."""

import os
import signal
import subprocess
import time

import pytest
import torch
from helpers import ROOT, TIMING, TINY, records, write_dataset
from torch.utils.data import DistributedSampler

from app.engine.epoch_position import EpochPosition, ResumableSampler
from app.engine.preemption import EpochControl
from app.train import main


def assert_same_epochs(straight, resumed):
    a, b = records(straight), records(resumed)
    assert [r["epoch"] for r in a] == [r["epoch"] for r in b]
    for ra, rb in zip(a, b):
        for key, value in ra.items():
            if key not in TIMING:
                assert rb[key] == pytest.approx(value, abs=1e-6), (ra["epoch"], key)


@pytest.mark.parametrize(("size", "world"), [(7, 1), (7, 2), (10, 3), (2, 3)])
def test_resumable_sampler_draws_what_distributed_sampler_draws(size, world):
    data = list(range(size))
    for rank in range(world):
        for epoch in (0, 3):
            ours = ResumableSampler(data, world, rank, seed=5)
            theirs = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=5)
            ours.start(EpochPosition(epoch), batch_size=2)
            theirs.set_epoch(epoch)
            assert list(ours) == list(theirs) and len(ours) == len(theirs)


def test_resumable_sampler_continues_a_saved_order():
    data = list(range(12))
    sampler = ResumableSampler(data, 2, 1, seed=0)
    sampler.start(EpochPosition(4), batch_size=2)
    whole, order = list(sampler), sampler.epoch_order()
    saved = EpochPosition(4, step=2, order=order, world_size=2, batch_size=2)
    assert sampler.mismatch(saved, 2) is None
    sampler.start(saved, batch_size=2)
    assert list(sampler) == whole[4:] and len(sampler) == 2
    assert "(2, 2, 12)" in sampler.mismatch(saved, batch_size=3)


def signal_at(monkeypatch, epoch, step, signum=signal.SIGTERM):
    """Send ``signum`` to this process during ``step`` of ``epoch`` (before its check)."""
    original = EpochControl.after_step

    def after_step(self, at, totals):
        if (self.position.epoch, at) == (epoch, step):
            os.kill(os.getpid(), signum)
        return original(self, at, totals)

    monkeypatch.setattr(EpochControl, "after_step", after_step)


@pytest.fixture
def common(dataset, tiny_args):
    # 3 volumes x 8 patches / batch 2 = 12 steps an epoch; agreement every 3 steps
    return [
        *tiny_args,
        "--data-root",
        dataset,
        "--samples-per-volume",
        8,
        "--stop-check-every",
        3,
        "--milestones",
        2,
        "--gamma",
        0.5,
        "--epochs",
        3,
    ]


def run(args):
    return main([str(a) for a in args])


def test_sigterm_mid_epoch_then_resume_matches_an_uninterrupted_run(common, tmp_path, monkeypatch):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert run([*common, "--output-dir", straight]) == 0

    signal_at(monkeypatch, epoch=2, step=4)
    assert run([*common, "--output-dir", resumed]) == 128 + signal.SIGTERM
    state = torch.load(resumed / "checkpoints/last.pt", weights_only=True)
    position = state["position"]
    assert (state["epoch"], position["epoch"], position["step"]) == (1, 2, 6)  # next agreement
    assert position["totals"][1] == 6 and len(position["order"]) == 24
    assert [r["epoch"] for r in records(resumed)] == [1]
    monkeypatch.undo()

    assert run([*common, "--output-dir", resumed, "--resume", "auto"]) == 0
    assert_same_epochs(straight, resumed)


def test_sigint_after_the_last_check_stops_at_the_epoch_end(common, tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    args = [*common, "--output-dir", run_dir, "--stop-check-every", 5]
    signal_at(monkeypatch, epoch=1, step=11, signum=signal.SIGINT)  # no check at 11 or 12
    assert run(args) == 128 + signal.SIGINT
    state = torch.load(run_dir / "checkpoints/last.pt", weights_only=True)
    assert state["epoch"] == 1 and "position" not in state
    monkeypatch.undo()
    assert run(args) == 0
    assert [r["epoch"] for r in records(run_dir)] == [1, 2, 3]


@pytest.mark.slow
def test_sigterm_to_the_launcher_with_two_ranks_then_resume_is_exact(tmp_path):
    """The acceptance test: 2 gloo ranks under launch.sh/torchrun, SIGTERM to the launcher in
    epoch 1 (as Kubernetes sends it to a pod's PID 1): exit 143, a mid-epoch
    checkpoint, and a resumed run whose epochs match an uninterrupted one to 1e-6."""
    from test_distributed import clean_env, launch

    data = write_dataset(tmp_path / "data", n_train=4, n_val=2)
    # 4 volumes x 30 patches / (2 ranks x batch 1) = 60 steps an epoch on each rank
    args = [
        *TINY,
        "--data-root",
        data,
        "--samples-per-volume",
        30,
        "--batch-size",
        1,
        "--stop-check-every",
        2,
        "--epochs",
        2,
    ]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    launch([*args, "--output-dir", straight], NPROC_PER_NODE=2)

    proc = subprocess.Popen(
        ["bash", "launch.sh", *map(str, [*args, "--output-dir", resumed])],
        cwd=ROOT,
        env=clean_env(NPROC_PER_NODE=2),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        # config.yaml is written just before the first step: a SIGTERM now reaches every rank
        # before the first agreement (step 2), whatever the speed of the machine
        started = resumed / "config.yaml"
        deadline = time.time() + 120
        while not started.exists() and time.time() < deadline and proc.poll() is None:
            time.sleep(0.02)
        assert started.exists(), "training never started"
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, output[-4000:]
    state = torch.load(resumed / "checkpoints/last.pt", weights_only=True)
    position = state["position"]
    assert state["epoch"] == 0 and position["epoch"] == 1, "not stopped inside epoch 1"
    assert 0 < position["step"] < 60 and position["step"] % 2 == 0
    assert len(state["rng_per_rank"]) == 2 and "stopped by SIGTERM" in output

    launch([*args, "--output-dir", resumed], NPROC_PER_NODE=2)  # --resume auto is the default
    assert_same_epochs(straight, resumed)


class Killed(Exception):
    """Stands for a SIGKILL: nothing after it runs."""


def test_time_based_checkpoints_survive_a_kill(common, tmp_path, monkeypatch):
    """--checkpoint-every-min writes the mid-epoch checkpoint at the first agreement after each
    period; a process killed later resumes at that step with the uninterrupted figures."""
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    assert run([*common, "--output-dir", straight]) == 0

    original = EpochControl.after_step

    def after_step(self, at, totals):
        if (self.position.epoch, at) == (2, 8):
            raise Killed
        return original(self, at, totals)

    monkeypatch.setattr(EpochControl, "after_step", after_step)
    args = [*common, "--output-dir", killed, "--checkpoint-every-min", 1e-6]  # every agreement
    with pytest.raises(Killed):
        run(args)
    monkeypatch.undo()
    state = torch.load(killed / "checkpoints/last.pt", weights_only=True)
    assert (state["position"]["epoch"], state["position"]["step"]) == (2, 6)

    assert run(args) == 0
    assert_same_epochs(straight, killed)


def test_checkpoint_period_defaults_by_device():
    from app.engine.preemption import checkpoint_every_s

    assert checkpoint_every_s("auto", torch.device("cpu")) == 0
    assert checkpoint_every_s("auto", torch.device("cuda")) == 30 * 60
    assert checkpoint_every_s("0", torch.device("cuda")) == 0
    assert checkpoint_every_s("2.5", torch.device("cpu")) == 150


def test_checkpoint_period_auto_replaces_the_old_minus_one(tmp_path):
    from app.config import load_config

    assert load_config([]).checkpoint_every_min == "auto"
    assert load_config(["--checkpoint-every-min", "-1"]).checkpoint_every_min == "auto"
    old = tmp_path / "config.yaml"  # an older run's config.yaml: numbers, and -1.0 for auto
    old.write_text("checkpoint_every_min: -1.0\n")
    assert load_config(["--config", str(old)]).checkpoint_every_min == "auto"
    old.write_text("checkpoint_every_min: 30\n")
    assert load_config(["--config", str(old)]).checkpoint_every_min == "30"


def test_bad_checkpoint_period_is_refused(tmp_path, tiny_args, capsys):
    assert run([*tiny_args, "--output-dir", tmp_path, "--checkpoint-every-min", -3]) == 2
    assert "--checkpoint-every-min must be minutes" in capsys.readouterr().err


def test_the_same_signal_twice_stops_at_once():
    from app.engine.preemption import StopSignals

    before = signal.getsignal(signal.SIGINT)  # SIG_IGN where the suite was started with `&`
    with StopSignals() as signals:
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C: the terminal's SIGINT, then torchrun's
        os.kill(os.getpid(), signal.SIGTERM)  # SIGTERM: still the graceful stop
        assert signals.received == signal.SIGTERM
        with pytest.raises(SystemExit) as stopped:
            os.kill(os.getpid(), signal.SIGINT)  # a second Ctrl-C
        assert stopped.value.code == 128 + signal.SIGINT
    assert signal.getsignal(signal.SIGINT) is before  # handlers restored
