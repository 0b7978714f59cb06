"""``--compile``: the ``auto`` decision (with faked timings), compiled <-> uncompiled checkpoints,
``app.predict`` on a compiled run, and a compiled run of 2 gloo processes."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from helpers import TINY, train_tiny
from test_distributed import launch, records

from app.config import Config, ConfigError, load_config
from app.distributed import DistEnv
from app.engine import compiling
from app.model import ReLU

ENV = DistEnv(0, 0, 1, torch.device("cpu"))
FAST = {"eager_s": 0.200, "compiled_s": 0.100, "compile_s": 30.0}  # 2x, 30 s to compile
SLOW = {"eager_s": 0.150, "compiled_s": 0.172, "compile_s": 34.0}  # the demo model on Zen 4


def tiny_cfg(*extra: str) -> Config:
    return load_config([*TINY, "--compile", "auto", *extra])


@pytest.fixture
def measured(monkeypatch, tmp_path):
    """``compiling.measure`` faked: returns the figures set in ``measured.figures``; an empty
    cache."""
    monkeypatch.setenv("IRONGRAIN_CACHE_DIR", str(tmp_path / "cache"))

    class Fake:
        figures = FAST
        calls = 0

    def fake(cfg, env):
        Fake.calls += 1
        return dict(Fake.figures)

    monkeypatch.setattr(compiling, "measure", fake)
    monkeypatch.setattr(compiling, "missing_compiler", lambda: "")
    return Fake


def test_a_short_run_does_not_compile_and_measures_nothing(measured):
    # 500 steps of 0.2 s could save at most 23 s at 1.3x: under 1.5 x 30 s of compiling
    decision = compiling.decide(tiny_cfg(), ENV, steps_left=500, step_s=0.2)
    assert not decision.use and decision.source == "prior" and measured.calls == 0
    assert "too short to repay it: 500 steps of 200 ms" in decision.reason


def test_a_long_run_compiles_when_the_measured_speed_up_repays_it(measured):
    decision = compiling.decide(tiny_cfg(), ENV, steps_left=20_000, step_s=0.2)
    assert decision.use and decision.source == "measured" and measured.calls == 1
    assert "eager 200 ms, compiled 100 ms (2.00x), compiling 30 s" in decision.reason
    assert "20000 steps save 2000 s -> on" in decision.reason
    # cached: the next run of this shape measures nothing, and a shorter one is weighed anew
    again = compiling.decide(tiny_cfg(), ENV, steps_left=400, step_s=1.0)
    assert again.source == "cached" and measured.calls == 1
    assert not again.use and "400 steps save 40 s, not 1.5x the compile -> off" in again.reason
    other = compiling.decide(tiny_cfg("--f-maps", "8"), ENV, steps_left=20_000, step_s=0.2)
    assert other.source == "measured" and measured.calls == 2


def test_a_long_run_does_not_compile_when_compiling_is_slower(measured):
    measured.figures = SLOW
    decision = compiling.decide(tiny_cfg(), ENV, steps_left=20_000, step_s=0.15)
    assert not decision.use and decision.source == "measured"
    assert "(0.87x)" in decision.reason and "steps lose 440 s" in decision.reason


def test_settings_and_rules(measured, monkeypatch):
    on = compiling.decide(tiny_cfg("--compile", "on"), ENV, steps_left=1, step_s=0.1)
    off = compiling.decide(tiny_cfg("--compile", "off"), ENV, steps_left=10**6, step_s=0.1)
    assert on.use and not off.use and on.source == off.source == "set"
    apex = dataclasses.replace(tiny_cfg(), amp_backend="apex")
    decision = compiling.decide(apex, ENV, steps_left=10**6, step_s=0.1)
    assert not decision.use and "apex" in decision.reason
    monkeypatch.setattr(compiling, "missing_compiler", lambda: "no C++ compiler on PATH")
    decision = compiling.decide(tiny_cfg(), ENV, steps_left=10**6, step_s=0.1)
    assert not decision.use and decision.reason == "no C++ compiler on PATH"
    with pytest.raises(ConfigError, match="--compile on: no C\\+\\+ compiler on PATH"):
        compiling.decide(tiny_cfg("--compile", "on"), ENV, steps_left=1, step_s=0.1)
    assert measured.calls == 0


def test_compile_on_is_refused_with_apex():
    with pytest.raises(ConfigError, match="--compile needs --amp-backend native"):
        load_config([*TINY, "--compile", "on", "--amp-backend", "apex"])


def test_the_compiler_is_found_on_path(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    for var in compiling.COMPILERS:
        monkeypatch.delenv(var, raising=False)
    assert "no C++ compiler on PATH" in compiling.missing_compiler()
    compiler = tmp_path / "g++"
    compiler.write_text("#!/bin/sh\n")
    compiler.chmod(0o755)
    assert compiling.missing_compiler() == ""
    include = tmp_path / "include"
    monkeypatch.setattr(compiling.sysconfig, "get_paths", lambda: {"include": str(include)})
    assert "Python.h (inductor's kernels include it: install python3-dev)" in (
        compiling.missing_compiler()
    )


@pytest.mark.slow
def test_compiled_and_uncompiled_checkpoints_load_in_each_other(dataset, tmp_path):
    compiled = train_tiny(dataset, tmp_path / "compiled", "--compile", "on", epochs=2)
    plain = train_tiny(dataset, tmp_path / "plain", epochs=2)
    saved = torch.load(compiled / "checkpoints/last.pt", weights_only=True)
    reference = torch.load(plain / "checkpoints/last.pt", weights_only=True)
    assert list(saved["model"]) == list(reference["model"])  # the same keys, in order
    resolved = (compiled / "config.yaml").read_text()
    assert "compile:" in resolved and "source: set" in resolved
    # compiled -> uncompiled: --resume continues it without compiling
    from app.train import main as train_main

    base = ["--data-root", str(dataset), *TINY, "--lr", "0.01"]
    assert train_main([*base, "--output-dir", str(compiled), "--epochs", "3"]) == 0
    assert [r["epoch"] for r in records(compiled)] == [1, 2, 3]
    # uncompiled -> compiled, with a weight average
    assert train_main([*base, "--output-dir", str(plain), "--epochs", "3", "--compile", "on"]) == 0
    last = records(plain)[-1]
    assert last["epoch"] == 3 and last["skipped_steps"] == 0 and 0 < last["utilisation"] < 1
    # app.predict reads the compiled run's checkpoint
    from app.analysis.predict import main as predict_main

    out = tmp_path / "pred"
    best = compiled / "checkpoints/best.pt"
    assert (
        predict_main(
            [
                "--checkpoint",
                str(best),
                "--input",
                str(dataset / "val_patches/images"),
                "--output",
                str(out),
            ]
        )
        == 0
    )
    assert list(out.glob("*"))


@pytest.mark.slow
def test_two_gloo_processes_train_compiled(tmp_path):
    from helpers import write_dataset

    data = write_dataset(tmp_path / "data", n_train=4, n_val=3)
    run_dir = tmp_path / "run"
    args = [*TINY, "--data-root", data, "--output-dir", run_dir, "--epochs", 2]
    launch([*args, "--compile", "on", "--ema-decay", "0.9"], NPROC_PER_NODE=2, timeout=400)
    rows = records(run_dir)
    assert [r["epoch"] for r in rows] == [1, 2] and rows[-1]["world_size"] == 2
    assert all(r["skipped_steps"] == 0 and r["dice"] >= 0 for r in rows)
    resolved = json.dumps((run_dir / "config.yaml").read_text())
    assert "compile" in resolved


def test_relu_under_compile_matches_eager_and_saves_no_bool_mask():
    """app.model.ReLU traces as _ReLUFromItsOutput on CPU: the same outputs and gradients as
    the eager nn.ReLU, and no boolean tensor saved between forward and backward (inductor's CPU
    code for bools is the slow path it works around; nn.ReLU here saves one)."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table

    x = torch.randn(2, 8, 4, 6, 6).contiguous(memory_format=torch.channels_last_3d)
    x[0, 0, 0, 0, :2] = 0.0  # ties at the threshold get no gradient, as in nn.ReLU

    def saved_dtypes(relu):
        saved = []

        def forward_compiler(graph, _inputs):
            (outputs,) = next(node.args for node in graph.graph.nodes if node.op == "output")
            saved.extend(node.meta["val"].dtype for node in outputs[1:])  # [0]: the loss
            return graph

        backend = aot_autograd(  # inductor's decompositions and partitioner, no codegen
            fw_compiler=forward_compiler,
            bw_compiler=lambda graph, _inputs: graph,
            decompositions=select_decomp_table(),
            partition_fn=min_cut_rematerialization_partition,
        )
        # only the mask is needed for the backward: the output goes into a sum
        torch.compile(lambda t: relu(t).sum(), backend=backend)(x.clone().requires_grad_())
        return saved

    assert torch.bool in saved_dtypes(torch.nn.ReLU())
    assert saved_dtypes(ReLU()) and torch.bool not in saved_dtypes(ReLU())

    def net(t):
        return ReLU(inplace=True)(t * 1.5).square().sum()

    grads = []
    for run in (net, torch.compile(net)):
        leaf = x.clone().requires_grad_()
        run(leaf).backward()
        grads.append(leaf.grad)
    torch.testing.assert_close(grads[1], grads[0])
    assert (grads[1][0, 0, 0, 0, :2] == 0).all() and (grads[1][x < 0] == 0).all()
