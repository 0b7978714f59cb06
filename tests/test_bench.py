"""Smoke tests of bench/: the scripts run end to end with tiny settings and print what they
promise. No timing is asserted here (speed is measured by the benchmarks, as ratios)."""

import importlib.util
import math
import os
import re
import subprocess
import sys

import apex_recording_standin
import pytest
import torch
from helpers import ROOT

TINY = ["--patch-size", "16", "32", "32", "--f-maps", "4", "--depth", "3", "--batch-size", "2"]
VERDICT = re.compile(r"^(PASS|FAIL|SKIP|WARN) [\w.-]+: \S")


def load(name, path):
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


train_step = load("bench_train_step", "bench/train_step.py")
data_pipeline = load("bench_data_pipeline", "bench/data_pipeline.py")
gpu_check = load("bench_gpu_check", "bench/gpu_check.py")
utilisation = load("bench_utilisation", "bench/utilisation.py")
versus = load("bench_versus", "bench/versus.py")


AUGMENT_MODES = ["off", "flips", "rot90", "gamma", "spatial", "basic", "full"]


def rows(text, first_words):
    return {line.split()[0]: line for line in text.splitlines() if line.split()[:1] in first_words}


def test_train_step_prints_the_rate_of_the_configured_level(capsys):
    argv = [*TINY, "--device", "cpu", "--opt-level", "O0", "--steps", "2", "--repeats", "1"]
    assert train_step.main([*argv, "--warmup", "1"]) == 0
    out = capsys.readouterr().out
    assert "train_step: torch" in out and "16,384 voxels/sample" in out
    assert re.search(r"^level +samples/s .* voxels/s +ms/step +peak MiB", out, re.M)
    (row,) = rows(out, [["O0"]]).values()
    rate, voxels = float(row.split()[1]), float(row.split()[3])
    assert rate > 0 and voxels == pytest.approx(rate * 16 * 32 * 32, rel=0.01)


def test_utilisation_prints_flops_peak_and_their_ratio_per_row(capsys):
    argv = ["--f-maps", "4", "--depth", "3", "--batch-size", "2", "--patch-size", "16", "32", "32"]
    argv += ["--device", "cpu", "--steps", "2", "--repeats", "1", "--f-maps-list", "4"]
    assert utilisation.main([*argv, "--precisions", "fp32", "bf16", "--with-compiled"]) == 0
    out = capsys.readouterr().out
    assert " threads" in out.splitlines()[0]  # the CPU is named
    table = [line for line in out.splitlines() if line.startswith("f_maps 4, ")]
    assert [row.split()[2] for row in table] == ["fp32", "bf16"]
    for row in table:
        gflop, ms, achieved, peak, util = (float(v.rstrip("%")) for v in row.split()[3:8])
        assert 0 < achieved < peak and 0 < util <= 100
        # the printed figures are rounded (GFLOP/s and ms to integers): compare within that
        assert achieved == pytest.approx(gflop / ms * 1000, abs=0.5 + gflop / ms * 1000 * 0.05)
        assert util == pytest.approx(100 * achieved / peak, abs=1 + 100 * 0.5 / peak)
        assert row.split()[9].endswith("x")  # the compiled step's speed-up


def test_versus_times_a_revision_and_this_tree_side_by_side(capsys):
    argv = [*TINY, "--device", "cpu", "--precision", "fp32", "--steps", "1", "--repeats", "2"]
    assert versus.main([*argv, "--baseline", "HEAD", "--candidate-flags", "--f-maps 2"]) == 0
    out = capsys.readouterr().out
    assert " threads" in out.splitlines()[0]  # the CPU is named
    base, candidate = out.splitlines()[-2:]
    assert base.startswith("baseline HEAD ") and " 1.00x " in base
    assert candidate.startswith("candidate (this tree) ") and " --f-maps 2 " in candidate
    assert float(re.search(r" (\d+\.\d\d)x ", candidate).group(1)) > 0


def test_versus_names_a_revision_that_does_not_exist(capsys):
    with pytest.raises(SystemExit, match=r"--baseline no-such-revision: "):
        versus.main([*TINY, "--device", "cpu", "--baseline", "no-such-revision"])


def test_train_step_compares_memory_formats_side_by_side(tmp_path, capsys):
    argv = ["--f-maps", "4", "--depth", "3", "--batch-size", "2", "--patch-size", "16", "32", "32"]
    argv += ["--device", "cpu", "--steps", "2", "--repeats", "1", "--warmup", "1"]
    assert train_step.main([*argv, "--compare-memory-format"]) == 0
    table = rows(capsys.readouterr().out, [["contig"], ["chlast"]])
    assert list(table) == ["contig", "chlast"] and " 1.00x " in table["contig"]


def test_train_step_compares_precisions_side_by_side(tmp_path, capsys):
    config = tmp_path / "bench.yaml"
    config.write_text("f_maps: 4\ndepth: 3\nbatch_size: 2\npatch_size: [16, 32, 32]\n")
    argv = ["--config", config, "--device", "cpu", "--steps", "2", "--repeats", "1"]
    argv += ["--warmup", "1", "--compare-precision", "--memory-format", "channels_last"]
    assert train_step.main([str(a) for a in argv]) == 0
    out = capsys.readouterr().out
    assert "--memory-format channels_last" in out and "interleaved" in out
    table = rows(out, [["O0"], ["O1"], ["O3"]])
    assert list(table) == ["O0", "O1", "O3"]
    assert " 1.00x " in table["O0"] and "bfloat16" in table["O1"]
    assert all(re.search(r" \d+\.\d\dx ", row) for row in table.values())


def test_train_step_shows_every_auto_candidate_and_its_pick(monkeypatch, capsys):
    from app.precision import auto as autotune
    from app.precision.hardware import Capabilities

    amx = Capabilities("cpu", "Xeon", "AVX512", native_bf16=True, native_fp16=False, amx=True)
    monkeypatch.setattr(train_step, "detect", lambda device: amx)
    argv = ["--f-maps", "4", "--depth", "3", "--batch-size", "2", "--patch-size", "16", "32", "32"]
    argv += ["--device", "cpu", "--steps", "1", "--repeats", "1", "--warmup", "1"]
    assert train_step.main([*argv, "--compare-auto", "--include-excluded"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^auto probe: measured per step: ", out, re.M)
    labels = [c.label for c in autotune.candidates(autotune.Config(), amx)[0]]
    table = [line for line in out.splitlines() if line.split(",")[0] in ("fp32", "bf16 autocast")]
    assert [line[: len(lab)] for line, lab in zip(table, labels)] == labels
    assert sum("<- auto picks" in line for line in table) == 1
    assert any(
        line.startswith("fp16 autocast") and "(left out)" in line for line in out.splitlines()
    )


def test_train_step_refuses_to_compare_apex_levels(capsys):
    argv = [*TINY, "--device", "cpu", "--amp-backend", "apex", "--compare-precision"]
    assert train_step.main(argv) == 2
    assert "--compare-precision needs --amp-backend native" in capsys.readouterr().err


def test_bench_scripts_report_bad_settings_without_a_traceback(tmp_path, capsys):
    assert train_step.main(["--patch-size", "2", "2", "2", "--device", "cpu"]) == 2
    assert "error: --patch-size must be at least 8" in capsys.readouterr().err
    assert data_pipeline.main(["--data-root", str(tmp_path / "missing")]) == 2
    assert "data root is missing" in capsys.readouterr().err
    # the trainer plans at start; a benchmark that took --plan auto would time the defaults
    for bench in (train_step, utilisation):
        assert bench.main([*TINY, "--device", "cpu", "--plan", "auto"]) == 2
        assert "--plan auto: the benchmark times the model its flags" in capsys.readouterr().err


def test_data_pipeline_generates_data_and_compares_augmentation(capsys):
    argv = ["--patch-size", "16", "32", "32", "--batch-size", "2", "--num-workers", "0"]
    argv += ["--samples-per-volume", "2", "--gen-volumes", "2", "--repeats", "1"]
    assert data_pipeline.main(argv) == 0
    out = capsys.readouterr().out
    assert "generated by datasets/make_synthetic.py" in out
    assert "4 patches per epoch (2 volumes x 2)" in out
    table = rows(out, [[m] for m in AUGMENT_MODES])
    assert list(table) == AUGMENT_MODES and table["off"].endswith("1.00x")


def test_data_pipeline_reads_a_given_data_root_with_workers(dataset, capsys):
    argv = [*TINY, "--data-root", str(dataset), "--num-workers", "1", "--repeats", "1"]
    assert data_pipeline.main(argv) == 0
    out = capsys.readouterr().out
    assert f"data: {dataset}" in out and "1 workers" in out
    assert list(rows(out, [[m] for m in AUGMENT_MODES])) == AUGMENT_MODES


def test_data_pipeline_fits_dataset_normalisation_and_leaves_rot90_out_of_oblong_patches(capsys):
    # the plan's MNI152 settings: one intensity scale fitted on train, a 16x48x32 patch
    argv = ["--patch-size", "16", "48", "32", "--batch-size", "2", "--num-workers", "0"]
    argv += ["--samples-per-volume", "2", "--gen-volumes", "2", "--repeats", "1"]
    assert data_pipeline.main([*argv, "--normalization", "dataset"]) == 0
    out = capsys.readouterr().out
    assert "rot90 left out (it needs a patch with H == W)" in out
    assert list(rows(out, [[m] for m in AUGMENT_MODES])) == [
        m for m in AUGMENT_MODES if m != "rot90"
    ]


def run_gpu_check(*args, python=sys.executable, timeout=120):
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env.update(PYTHON=str(python), OMP_NUM_THREADS="1")
    return subprocess.run(
        ["bash", "bench/gpu_check.sh", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU mode of a CPU-only host")
def test_gpu_check_cpu_mode_passes_or_skips_each_check():
    # the in-process checks; ddp-syncbn and train-resume spawn training processes (about 30 s
    # more on 2 cores): `bash bench/gpu_check.sh --allow-cpu` runs them all
    only = ["versions", "native", "scaler", "channels", "nccl", "apex", "launch"]
    done = run_gpu_check("--allow-cpu", "--only", *only)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    verdicts = [line for line in done.stdout.splitlines() if VERDICT.match(line)]
    status = {line.split()[1].rstrip(":"): line.split()[0] for line in verdicts}
    assert status == {
        "versions": "PASS",
        "native-O0": "PASS",
        "native-O1-fp16": "PASS",
        "native-O1-bf16": "PASS",
        "native-O3": "PASS",
        "o1-speedup": "SKIP",
        "scaler-checkpoint": "PASS",
        "channels-last-3d": "PASS",
        "memory-format-speed": "PASS",
        "nccl-init": "SKIP",
        "apex-O1": "SKIP",
        "apex-O2": "SKIP",
        "launch-2gpu-nccl": "SKIP",
    }
    assert "samples/s" in next(line for line in verdicts if "native-O1-bf16" in line)
    assert re.search(r"scale 32768\.0, tracker 3", done.stdout)
    summary = r"^gpu_check: 8 PASS, 0 FAIL, 5 SKIP, 0 WARN; elapsed [\d.]+ s$"
    assert re.search(summary, done.stdout, re.M)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU mode of a CPU-only host")
def test_gpu_check_multiclass_keeps_softmax_and_loss_float32_under_fp16():
    done = run_gpu_check("--allow-cpu", "--only", "multiclass")
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    line = next(line for line in done.stdout.splitlines() if "multiclass-fp16" in line)
    assert line.startswith("PASS") and "the softmax float32, the loss float32" in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a host without CUDA")
def test_gpu_check_fails_without_cuda_unless_cpu_is_allowed(capsys):
    assert gpu_check.main([]) == 1
    out = capsys.readouterr().out
    assert out.startswith("FAIL cuda: CUDA is not available") and "--allow-cpu" in out


def test_gpu_check_setup_failure_is_a_fail_line(tmp_path):
    fake = tmp_path / "python"  # torch imports, monai does not, and pip has no network
    fake.write_text(
        "#!/usr/bin/env bash\n"
        "if [[ $1 == -c ]]; then\n"
        "  echo \"ModuleNotFoundError: No module named 'monai'\"; exit 4\n"
        "fi\n"
        "echo 'ERROR: No matching distribution found for monai==1.6.1' >&2; exit 1\n"
    )
    fake.chmod(0o755)
    done = run_gpu_check(python=fake, timeout=30)
    assert done.returncode == 1
    assert "FAIL setup: pip install -r requirements.txt failed" in done.stdout
    assert "No matching distribution found" in done.stdout and "elapsed" in done.stdout


def test_gpu_check_apex_functions_with_the_recording_standin(monkeypatch, tmp_path):
    """The apex check's code path on CPU, against the stand-in (the real apex runs on a GPU)."""
    calls = apex_recording_standin.install(monkeypatch)
    path, cpu, sizes = tmp_path / "apex.pt", torch.device("cpu"), gpu_check.CPU_SIZES
    trained = gpu_check.apex_train_and_save("O1", path, cpu, sizes)
    resumed = gpu_check.apex_load_and_compare("O1", path, cpu, sizes)
    assert math.isfinite(trained["loss"]) and math.isfinite(resumed["loss"])
    assert trained["amp"] == resumed["saved"] == resumed["restored"]
    assert "apex O1" in trained["describe"]
    names = [c[0] for c in calls]
    assert names.count("amp.initialize") == 2 and "amp.load_state_dict" in names
    assert names.count("amp.scale_loss") == 4  # 3 steps, then 1 after the restore


def test_grains_bench_scales_and_sweeps(capsys):
    bench_grains = load("bench_grains", "bench/grains.py")
    argv = ["scale", "--shape", "16", "48", "48", "--cubes", "40", "--repeats", "1"]
    assert bench_grains.main(argv) == 0
    out = capsys.readouterr().out
    assert "grains scale:" in out and rows(out, [["16x48x48"], ["40^3"]]).keys() == {
        "16x48x48",
        "40^3",
    }
    argv = ["params", "--shape", "16", "48", "48", "--n", "1", "--h", "0.2", "--smooth", "1"]
    assert bench_grains.main(argv) == 0
    out = capsys.readouterr().out
    assert "components only" in out and "<- default" in out


def test_grains_bench_scores_the_clean_ups_of_a_run(tmp_path, capsys):
    from helpers import train_tiny, write_dataset

    bench_grains = load("bench_grains", "bench/grains.py")
    run = train_tiny(write_dataset(tmp_path / "data", n_train=2, n_val=1), tmp_path / "run")
    capsys.readouterr()
    assert bench_grains.main(["postprocess", "--run", str(run), "--min-sizes", "0", "10"]) == 0
    out = capsys.readouterr().out
    assert "true grains: watershed of the labels" in out
    table = rows(out, [["min"]])
    assert len(out.splitlines()) >= 6 and table  # 2 sizes x fill holes or not
    assert re.search(r"min 10 \+ fill holes +[01]\.\d{4} +[01]\.\d{4}", out)


def test_checkpoint_overhead_times_the_three_variants_side_by_side():
    argv = [*TINY, "--opt-level", "O1", "--amp-dtype", "bfloat16", "--memory-format"]
    argv += ["channels_last", "--stop-check-every", "2", "--steps", "4", "--repeats", "1"]
    done = subprocess.run(
        [sys.executable, "bench/checkpoint_overhead.py", *argv, "--period-s", "0.001"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "checkpoint_overhead: torch" in out and "2 gloo ranks" in out
    table = rows(out, [["off"], ["agree"], ["checkpoints"]])
    assert list(table) == ["off", "agree", "checkpoints"] and "1.0000x of off" in table["off"]
    assert re.search(r"^\d+ checkpoints of [\d.]+ MB", out, re.M)
    assert "--checkpoint-every-min 30: projected cost" in out and "one agreement alone" in out


@pytest.mark.slow
def test_large_data_prints_rss_and_rate_for_each_access(tmp_path):
    work = tmp_path / "work"
    argv = ["--work", work, "--volumes", 1, "--shape", 64, 64, 64, "--small-volumes", 1]
    argv += ["--small-shape", 64, 64, 64, "--epochs", 1, "--samples-per-volume", 2]
    done = subprocess.run(
        [sys.executable, "bench/large_data.py", *map(str, argv)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=400,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    table = [line for line in done.stdout.splitlines() if line.startswith(("small,", "large,"))]
    assert [line.split("  ")[0].strip() for line in table] == [
        "small, memory",
        "small, mmap",
        "large, mmap",
    ]
    assert all(float(line.split()[3]) > 100 for line in table)  # a peak RSS was read, in MiB
    assert "large_data: torch" in done.stdout and not work.exists()


def test_conv_layout_times_both_layouts_per_precision(capsys):
    conv_layout = load("bench_conv_layout", "bench/conv_layout.py")
    argv = ["--convs", "2:4", "--shape", "4", "8", "8", "--repeats", "1"]
    assert conv_layout.main(argv) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "->" in line]
    assert [line.split()[1] for line in lines] == ["bf16", "bf16-weights", "fp32"]
    assert all(line.split()[0] == "2->4" and "x  (" in line for line in lines)
    with pytest.raises(SystemExit):
        conv_layout.main(["--convs", "8"])
