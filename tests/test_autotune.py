"""``auto`` precision and memory format: the capability rules on faked hardware, the probe's
pick, the cache, the decision broadcast to 2 gloo ranks, and what a run records."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
import yaml
from helpers import free_port

from app import cache
from app.config import Config
from app.distributed import DistEnv
from app.precision import auto as autotune
from app.precision import hardware
from app.precision.auto import Candidate
from app.precision.hardware import Capabilities

CPU = torch.device("cpu")
ENV = DistEnv(0, 0, 1, CPU)

AVX2 = Capabilities("cpu", "AMD EPYC 7B13", "AVX2", native_bf16=False, native_fp16=False)
AVX512_BF16 = Capabilities("cpu", "AMD EPYC 9B14", "AVX512", native_bf16=True, native_fp16=False)
AMX = Capabilities(
    "cpu", "Intel Xeon 8480+", "AVX512", native_bf16=True, native_fp16=True, amx=True
)
A100 = Capabilities("cuda", "NVIDIA A100", "sm_80", True, True, cudnn=91500)
H100_BUGGY_CUDNN = Capabilities("cuda", "NVIDIA H100", "sm_90", True, True, cudnn=91002)
T4 = Capabilities("cuda", "Tesla T4", "sm_75", native_bf16=False, native_fp16=True, cudnn=91500)


def labels(cands):
    return [c.label for c in cands]


def tiny(**kwargs) -> Config:
    values = dict(patch_size=(8, 16, 16), f_maps=2, depth=2, batch_size=1, device="cpu")
    return Config(**{**values, **kwargs})


# ----------------------------------------------------------------------------- rules
def test_a_cpu_without_native_bf16_never_gets_bf16_by_default():
    cands, notes = autotune.candidates(Config(), AVX2)
    assert labels(cands) == ["fp32, channels_last", "fp32, contiguous"]
    assert any("no native bf16 (AVX2)" in n and "62x" in n for n in notes)
    assert autotune.rule_choice(cands, AVX2)[0] == Candidate("O0", "float32", "channels_last")


def test_a_cpu_with_native_bf16_weighs_bf16_against_fp32():
    for caps in (AVX512_BF16, AMX):
        cands, _ = autotune.candidates(Config(), caps)
        assert "bf16 autocast, channels_last" in labels(cands)
        assert "fp32, channels_last" in labels(cands)
        choice, why = autotune.rule_choice(cands, caps)
        assert choice == Candidate("O1", "bfloat16", "channels_last") and "native bf16" in why
    # fp16 autocast on CPU only where it is native
    assert "fp16 autocast, channels_last" in labels(autotune.candidates(Config(), AMX)[0])
    assert not any("fp16" in x for x in labels(autotune.candidates(Config(), AVX512_BF16)[0]))


def test_cuda_gets_bf16_only_where_the_gpu_and_cudnn_compute_it():
    a100, _ = autotune.candidates(Config(), A100)
    assert labels(a100) == [
        f"{p}, {f}"
        for p in ("fp32", "bf16 autocast", "fp16 autocast")
        for f in ("channels_last", "contiguous")
    ]
    assert autotune.rule_choice(a100, A100)[0] == Candidate("O1", "bfloat16", "contiguous")
    t4, notes = autotune.candidates(Config(), T4)
    assert not any("bf16" in x for x in labels(t4)) and "no native bf16 (sm_75)" in notes[0]
    assert autotune.rule_choice(t4, T4)[0] == Candidate("O1", "float16", "contiguous")
    buggy, notes = autotune.candidates(Config(), H100_BUGGY_CUDNN)
    assert not any("bf16" in x for x in labels(buggy)) and "pytorch#163539" in notes[0]


def test_settings_given_are_kept_as_given():
    cands, notes = autotune.candidates(Config(opt_level="O1", amp_dtype="bfloat16"), AVX2)
    assert labels(cands) == ["bf16 autocast, channels_last", "bf16 autocast, contiguous"]
    assert "not native here" in notes[-1]
    cands, notes = autotune.candidates(Config(opt_level="O1"), AVX2)  # no native half dtype
    assert {c.amp_dtype for c in cands} == {"bfloat16"} and "--opt-level O0 is faster" in notes[-1]
    cands, _ = autotune.candidates(Config(memory_format="contiguous"), AMX)
    assert {c.memory_format for c in cands} == {"contiguous"}
    apex, _ = autotune.candidates(Config(amp_backend="apex"), A100)
    assert apex == [Candidate("O1", "float16", "contiguous")]
    fixed = Config(opt_level="O0", memory_format="contiguous")
    assert not autotune.needs_deciding(fixed)  # O0 has no dtype to choose
    decision = autotune.decide(fixed, ENV)
    assert decision.source == "fixed" and decision.apply(fixed) == fixed


def test_cpu_capabilities_need_the_instructions_not_only_onednn(monkeypatch):
    """oneDNN says yes to bf16 on plain AVX-512 (it emulates); the CPU flags decide."""
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_fp16_supported", lambda: False)
    for flags, native, amx in (
        ({"avx2", "avx512f"}, False, False),
        ({"avx2", "avx512f", "avx512_bf16"}, True, False),
        ({"avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}, True, True),
    ):
        monkeypatch.setattr(hardware, "cpu_info", lambda f=flags: ("Some CPU", frozenset(f)))
        caps = hardware.cpu_capabilities()
        assert (caps.native_bf16, caps.amx, caps.native_fp16) == (native, amx, False), flags
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    monkeypatch.setattr(hardware, "cpu_info", lambda: ("Some CPU", frozenset({"amx_bf16"})))
    assert not hardware.cpu_capabilities().native_bf16  # capped by ONEDNN_MAX_CPU_ISA, say


# ----------------------------------------------------------------------------- probe and pick
def test_pick_takes_the_fastest_and_the_higher_precision_on_a_near_tie():
    fp32, bf16, fp16 = (
        Candidate("O0", "float32", "channels_last"),
        Candidate("O1", "bfloat16", "channels_last"),
        Candidate("O1", "float16", "channels_last"),
    )
    cands = [fp32, bf16, fp16]

    def timed(*ms):
        return {c.label: {"ms": m, "note": "" if m else "failed"} for c, m in zip(cands, ms)}

    assert autotune.pick(cands, timed(300.0, 100.0, 120.0))[0] == bf16
    assert autotune.pick(cands, timed(103.0, 100.0, 99.0))[0] == fp32  # within 5%: fp32
    choice, reason = autotune.pick(cands, timed(None, 100.0, 150.0))
    assert choice == bf16 and "fp32, channels_last not timed (failed)" in reason
    assert "1.50x" in reason
    assert autotune.pick(cands, timed(None, None, None)) is None


def test_the_probe_times_the_real_step_of_every_candidate():
    cfg = tiny()
    cands = [Candidate("O0", "float32", "channels_last"), Candidate("O0", "float32", "contiguous")]
    rng = torch.get_rng_state()
    timings = autotune.probe(cfg, ENV, cands)
    assert torch.equal(torch.get_rng_state(), rng)  # training starts from the seeds it would
    assert set(timings) == set(labels(cands))
    assert all(t["ms"] is not None and t["ms"] > 0 for t in timings.values())


# ----------------------------------------------------------------------------- cache
def test_the_screen_leaves_out_a_precision_far_slower_at_one_convolution():
    fp32, fp16 = Candidate("O0", "float32", "contiguous"), Candidate("O1", "float16", "contiguous")
    # clock readings: two runs each, start and end; fp32 takes 1 ms, fp16 180 ms
    readings = itertools.accumulate([0, 0.001, 0, 0.001, 0, 0.5, 0, 0.18])
    slow = autotune.screen(tiny(), [fp32, fp16], CPU, clock=lambda: next(readings))
    assert slow == {"fp16 autocast": "180x slower than fp32 at one convolution"}
    readings = itertools.accumulate([0, 0.001, 0, 0.001, 0, 0.5, 0, 0.009])
    assert autotune.screen(tiny(), [fp32, fp16], CPU, clock=lambda: next(readings)) == {}
    one_precision = [fp32, Candidate("O0", "float32", "channels_last")]
    assert autotune.screen(tiny(), one_precision, CPU, clock=pytest.fail) == {}


def test_the_probe_builds_nothing_for_a_screened_out_precision(monkeypatch):
    fp32, fp16 = Candidate("O0", "float32", "contiguous"), Candidate("O1", "float16", "contiguous")
    monkeypatch.setattr(autotune, "screen", lambda *a: {"fp16 autocast": "180x slower"})
    monkeypatch.setattr(autotune, "check_convolutions", lambda *a: pytest.fail("checked fp16"))
    timings = autotune.probe(tiny(), ENV, [fp32, fp16])
    assert timings["fp32, contiguous"]["ms"] > 0
    assert timings["fp16 autocast, contiguous"] == {"ms": None, "note": "180x slower"}
    choice, reason = autotune.pick([fp32, fp16], timings)
    assert choice == fp32 and "fp16 autocast, contiguous not timed (180x slower)" in reason


def fake_probe(ms_by_format):
    """A probe that reports ``ms_by_format`` for fp32 and twice that for a half dtype."""
    calls = []

    def probe(cfg, env, cands):
        calls.append(labels(cands))
        slower = {"float32": 1.0}
        return {
            c.label: {
                "ms": ms_by_format[c.memory_format] * slower.get(c.amp_dtype, 2.0),
                "note": "",
            }
            for c in cands
        }

    return probe, calls


def test_decisions_are_cached_and_a_damaged_cache_is_measured_again(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(autotune, "detect", lambda device: AVX2)
    probe, calls = fake_probe({"channels_last": 200.0, "contiguous": 100.0})
    monkeypatch.setattr(autotune, "probe", probe)
    monkeypatch.setenv("IRONGRAIN_CACHE_DIR", str(tmp_path / "cache"))
    cfg = tiny()
    first = autotune.decide(cfg, ENV)
    assert first.source == "probe" and first.choice == Candidate("O0", "float32", "contiguous")
    assert "fp32, contiguous 100 ms; fp32, channels_last 200 ms (2.00x)" in first.reason
    assert "no native bf16 (AVX2)" in first.log_line()
    files = list((tmp_path / "cache" / "auto").glob("*.json"))
    assert len(files) == 1 and len(calls) == 1

    again = autotune.decide(cfg, ENV)
    assert again.source == "cache" and again.choice == first.choice and len(calls) == 1
    assert str(files[0]) in again.reason

    other_shape = dataclasses.replace(cfg, patch_size=(8, 16, 32))
    assert autotune.decide(other_shape, ENV).source == "probe" and len(calls) == 2
    other_block = dataclasses.replace(cfg, block="residual")  # other layers: check them too
    assert autotune.decide(other_block, ENV).source == "probe" and len(calls) == 3

    files[0].write_text("{not json")
    assert autotune.decide(cfg, ENV).source == "probe" and len(calls) == 4
    assert "ignoring the cache file" in caplog.text
    assert json.loads(files[0].read_text())["decision"]["memory_format"] == "contiguous"


def test_an_unwritable_cache_costs_a_probe_not_the_run(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(autotune, "detect", lambda device: AVX2)
    monkeypatch.setattr(autotune, "probe", fake_probe({"channels_last": 1.0, "contiguous": 2.0})[0])
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("IRONGRAIN_CACHE_DIR", str(blocker / "cache"))
    decision = autotune.decide(tiny(), ENV)
    assert decision.choice.memory_format == "channels_last"
    assert "cannot write the cache" in caplog.text


def test_no_auto_probe_decides_by_the_rules(monkeypatch):
    monkeypatch.setattr(autotune, "detect", lambda device: AVX2)
    monkeypatch.setattr(autotune, "probe", lambda *a: pytest.fail("probed with --no-auto-probe"))
    decision = autotune.decide(tiny(auto_probe=False), ENV)
    assert decision.source == "rules" and decision.choice.label == "fp32, channels_last"
    assert "--no-auto-probe" in decision.reason


def test_the_default_cache_folder_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("IRONGRAIN_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache.cache_root() == tmp_path / "irongrain"
    monkeypatch.setenv("IRONGRAIN_CACHE_DIR", str(tmp_path / "x"))
    assert cache.cache_root() == tmp_path / "x"


# ----------------------------------------------------------------------------- resume
def test_a_resumed_run_keeps_the_checkpoint_precision(monkeypatch):
    monkeypatch.setattr(autotune, "probe", lambda *a: pytest.fail("a resumed run probed"))
    state = {
        "precision": {"backend": "native", "opt_level": "O1", "dtype": "bfloat16"},
        "resolved": {"memory_format": "contiguous"},
        "config": {},
    }
    decision = autotune.decide(tiny(), ENV, resumed=state)
    assert decision.source == "checkpoint"
    assert decision.choice == Candidate("O1", "bfloat16", "contiguous")
    old = {"precision": {"opt_level": "O0", "dtype": "float32"}, "config": {}}
    kept = autotune.decide(tiny(), ENV, resumed=old).apply(tiny())
    assert (kept.opt_level, kept.memory_format) == ("O0", "channels_last")  # its CPU rule


# ----------------------------------------------------------------------------- 2 gloo ranks
def _broadcast_worker(rank: int, port: int, cache: str, out: str) -> None:
    import torch.distributed as dist

    os.environ["LOCAL_WORLD_SIZE"] = "2"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    # each rank measures the opposite: only rank 0's measurement may count
    fast = "contiguous" if rank == 0 else "channels_last"
    slow = "channels_last" if rank == 0 else "contiguous"
    autotune.detect = lambda device: AVX2
    autotune.probe = fake_probe({fast: 100.0, slow: 300.0})[0]
    env = DistEnv(rank, rank, 2, CPU)
    os.environ["IRONGRAIN_CACHE_DIR"] = cache
    first = autotune.decide(tiny(), env)
    second = autotune.decide(tiny(), env)
    with open(f"{out}.{rank}", "w") as f:
        json.dump([first.to_dict(), second.to_dict()], f)
    dist.destroy_process_group()


def test_rank_0_decides_for_every_rank(tmp_path):
    out = str(tmp_path / "decision")
    mp.spawn(
        _broadcast_worker, args=(free_port(), str(tmp_path / "cache"), out), nprocs=2, join=True
    )
    results = [json.loads(Path(f"{out}.{r}").read_text()) for r in (0, 1)]
    for first, second in results:
        assert first["memory_format"] == "contiguous" and first["source"] == "probe"
        assert second["memory_format"] == "contiguous" and second["source"] == "cache"
    assert results[0] == results[1]


# ----------------------------------------------------------------------------- a real run
def test_a_run_logs_and_records_what_auto_resolved_to(dataset, tmp_path, capsys, monkeypatch):
    from app.engine.checkpoint import load_checkpoint
    from app.train import main as train_main

    run_dir = tmp_path / "run"
    tiny_run = [
        "--data-root", str(dataset), "--output-dir", str(run_dir), "--epochs", "1",
        "--patch-size", "16", "32", "32", "--f-maps", "4", "--depth", "3", "--batch-size", "2",
        "--samples-per-volume", "2", "--num-workers", "0", "--device", "cpu",
    ]  # fmt: skip
    monkeypatch.setenv("IRONGRAIN_CACHE_DIR", str(tmp_path / "cache"))
    assert train_main(tiny_run) == 0
    line = next(x for x in capsys.readouterr().err.splitlines() if "auto ->" in x)
    assert "app.train: opt_level/amp_dtype/memory_format auto -> " in line
    assert "measured per step" in line
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["opt_level"] == "auto" and saved["resolved"]["source"] == "probe"
    state = load_checkpoint(run_dir / "checkpoints" / "last.pt")
    assert state["config"]["opt_level"] == saved["resolved"]["opt_level"] != "auto"
    assert state["resolved"]["label"] == saved["resolved"]["label"]
    # the config.yaml of a run can be given back with --config
    again = [*tiny_run[:4], "--config", str(run_dir / "config.yaml"), "--epochs", "2"]
    assert train_main(again) == 0
