"""Whole-volume prediction: seamless tiling, the predict CLI, its errors, and its sharding."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import tifffile
import torch
from helpers import BF16, ROOT, blob_volume, train_tiny, write_dataset
from torch import nn

from app.analysis import predict as predict_cli
from app.config import Config
from app.data.dataset import normalize
from app.data.volume_io import VolumeMeta, read_volume, write_volume
from app.engine.checkpoint import save_checkpoint
from app.engine.inference import gaussian_weights, predict_logits
from app.model import UNet3d
from app.precision.amp import build_precision

WINDOW = (16, 32, 32)


def fp32():
    return build_precision(Config(opt_level="O0"), torch.device("cpu"))


def make_checkpoint(path: Path, seed: int = 0, **config) -> Path:
    """A checkpoint of this trainer's format with a tiny random UNet3d (eval-mode BatchNorm
    running stats made non-trivial so that they matter)."""
    torch.manual_seed(seed)
    model = UNet3d(1, 1, f_maps=4, depth=3)
    for module in model.modules():
        if isinstance(module, nn.BatchNorm3d):
            module.running_mean.uniform_(-0.1, 0.1)
            module.running_var.uniform_(0.5, 1.5)
    settings = {"patch_size": WINDOW, "f_maps": 4, "depth": 3, "opt_level": "O0", **config}
    state = {
        "format_version": 1,
        "model": model.state_dict(),
        "optimizer": {},
        "scheduler": {},
        "precision": {},
        "epoch": 1,
        "best_dice": 0.0,
        "metrics": {},
        "config": Config(**settings).to_dict(),
        "rng": {},
    }
    save_checkpoint(path, state)
    return path


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    return make_checkpoint(tmp_path / "model.pt")


def write_inputs(
    folder: Path, shapes, ext: str = ".nii.gz", seed: int = 0, affine=None
) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    paths = []
    for i, shape in enumerate(shapes):
        image, _ = blob_volume(shape, rng)
        path = folder / f"vol_{i:02d}{ext}"
        write_volume(path, image * 100 + 1000, VolumeMeta(ext, affine=affine))
        paths.append(path)
    return paths


def run(capsys, *argv) -> tuple[int, str, str]:
    code = predict_cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


# ----------------------------------------------------------------------------- tiling
def test_tiling_is_exact_for_a_pointwise_model():
    """A model with a 1-voxel receptive field has no window-border effects: any tiling, any
    overlap, must reproduce the whole-volume output to float rounding."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv3d(1, 2, 1), nn.Tanh(), nn.Conv3d(2, 1, 1)).eval()
    volume = torch.randn(21, 45, 50)
    with torch.no_grad():
        whole = model(volume[None, None])
    for window, overlap in (((16, 32, 32), 0.5), ((8, 16, 24), 0.25), ((9, 17, 23), 0.6)):
        tiled = predict_logits(model, volume, window, fp32(), overlap, sw_batch_size=3)
        assert tiled.shape == whole.shape
        torch.testing.assert_close(tiled, whole, atol=1e-6, rtol=0)


def test_tiling_is_seamless_for_a_convolution():
    """A 3x3x3 convolution is translation-equivariant but wrong on each window's outer voxels
    (zero padding). Gaussian blending gives those voxels so little weight that two different
    tilings, and the untiled convolution, agree within 0.02 in probability (0.001 on average),
    where MONAI's built-in map (floored at 1e-3) is off by up to 0.11."""
    torch.manual_seed(0)
    model = nn.Conv3d(1, 1, 3, padding=1).eval()
    volume = torch.randn(24, 48, 52)
    with torch.no_grad():
        whole = torch.sigmoid(model(volume[None, None]))
    tilings = [
        torch.sigmoid(predict_logits(model, volume, w, fp32(), 0.5, 2))
        for w in ((16, 32, 32), (12, 24, 20), (9, 17, 23))
    ]
    for probs in tilings:
        assert float((probs - whole).abs().max()) < 0.02
        assert float((probs - whole).abs().mean()) < 1e-3
    assert float((tilings[0] - tilings[1]).abs().max()) < 0.02


def test_tiling_unet_windows_agree():
    """A random UNet3d's receptive field exceeds the window, so tilings differ, but little."""
    model = UNet3d(1, 1, f_maps=4, depth=3).eval()
    volume = torch.randn(20, 48, 40)
    a = torch.sigmoid(predict_logits(model, volume, (16, 32, 32), fp32(), 0.5, 2))
    b = torch.sigmoid(predict_logits(model, volume, (16, 24, 24), fp32(), 0.5, 2))
    assert float((a - b).abs().max()) < 0.01


def test_blending_a_constant_model_is_exactly_constant():
    """No seam from the weights themselves: blending a constant is that constant everywhere,
    including in window corners, at the volume's edges and with padding."""

    class Constant(nn.Module):
        def __init__(self):
            super().__init__()
            self.bias = nn.Parameter(torch.tensor(0.7))

        def forward(self, x):
            return torch.zeros_like(x) + self.bias

    volume = torch.randn(21, 45, 50)
    for window, overlap in (((16, 32, 32), 0.5), ((8, 16, 24), 0.25), ((32, 64, 64), 0.5)):
        out = predict_logits(Constant(), volume, window, fp32(), overlap, 2)
        assert out.shape == (1, 1, 21, 45, 50)
        assert float((out - 0.7).abs().max()) < 1e-6


def test_gaussian_weights_are_smooth_and_positive():
    w = gaussian_weights((16, 32, 33))
    assert w.shape == (16, 32, 33) and w.dtype == torch.float32
    assert float(w.max()) == pytest.approx(1.0) and float(w.min()) > 0
    # separable, symmetric, peaked in the middle, tails ~exp(-8) per axis at the window edge
    torch.testing.assert_close(w, w.flip(0).flip(1).flip(2))
    assert float(w[0, 16, 16] / w[8, 16, 16]) < 1e-3
    # every window edge carries < 1e-3 of the peak weight: a window's border is a soft seam
    for edge in (w[0], w[-1], w[:, 0], w[:, -1], w[:, :, 0], w[:, :, -1]):
        assert float(edge.max()) < 1e-3
    # smooth: no step larger than a Gaussian's steepest slope, 1 / (sigma sqrt(e))
    for axis, size in enumerate(w.shape):
        steps = (w.narrow(axis, 1, size - 1) - w.narrow(axis, 0, size - 1)).abs()
        assert float(steps.max()) <= 1.02 / (0.125 * size * np.exp(0.5))


def test_monai_matches_the_handwritten_reference():
    """The app's MONAI path against the reference of bench/sliding_window.py: same windows, same
    weights, same padding, so the same logits (float rounding)."""
    spec = importlib.util.spec_from_file_location("bench_sw", ROOT / "bench" / "sliding_window.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    model = UNet3d(1, 1, f_maps=4, depth=3).eval()
    for shape, window in (((20, 40, 50), (16, 32, 32)), ((10, 20, 45), (16, 32, 32))):
        volume = torch.randn(shape)
        ours = predict_logits(model, volume, window, fp32(), 0.5, 2)
        with torch.inference_mode():
            ref = bench.reference_sliding_window(model, volume[None, None], window, 0.5, 2)
        torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------- the CLI
def test_nifti_keeps_affine_and_header_and_refuses_to_overwrite(tmp_path, checkpoint, capsys):
    affine = np.array(
        [[0.0, 0.4, 0.0, -10.0], [0.5, 0.0, 0.0, 5.0], [0.0, 0.0, 0.6, 2.5], [0.0, 0.0, 0.0, 1.0]]
    )
    (source,) = write_inputs(tmp_path / "in", [(18, 36, 40)], affine=affine)
    out = tmp_path / "out"
    code, stdout, _ = run(
        capsys, "--checkpoint", checkpoint, "--input", tmp_path / "in", "--output", out
    )
    assert code == 0 and "predicted 1 of 1 volume(s)" in stdout
    image = nib.load(str(source))
    probs = nib.load(str(out / "vol_00_probs.nii.gz"))
    mask = nib.load(str(out / "vol_00_mask.nii.gz"))
    for result, dtype in ((probs, np.float32), (mask, np.uint8)):
        np.testing.assert_allclose(result.affine, affine, atol=1e-6)
        np.testing.assert_allclose(result.header.get_zooms(), image.header.get_zooms())
        assert result.header.get_data_dtype() == dtype
        assert result.shape == image.shape
    p, m = np.asarray(probs.dataobj), np.asarray(mask.dataobj)
    assert p.min() >= 0 and p.max() <= 1
    np.testing.assert_array_equal(m, (p > 0.5).astype(np.uint8))

    # the same probabilities as the trainer's path: normalise, predict_logits, fp32 sigmoid
    predictor = predict_cli.load_predictor(checkpoint)
    raw, _ = read_volume(source)
    expected = torch.sigmoid(
        predict_logits(predictor.model, normalize(raw, "zscore"), WINDOW, fp32(), 0.5, 2)
    )[0, 0].numpy()
    np.testing.assert_allclose(p, expected, atol=1e-6)

    before = {f.name: f.read_bytes() for f in out.iterdir()}
    code, _, err = run(capsys, "--checkpoint", checkpoint, "--input", source, "--output", out)
    assert code == 2 and "already exist" in err and "vol_00_probs.nii.gz" in err
    assert {f.name: f.read_bytes() for f in out.iterdir()} == before  # untouched

    code, _, _ = run(
        capsys, "--checkpoint", checkpoint, "--input", source, "--output", out, "--overwrite"
    )
    assert code == 0
    np.testing.assert_array_equal(np.asarray(nib.load(str(out / "vol_00_probs.nii.gz")).dataobj), p)
    assert sorted(f.name for f in out.iterdir()) == sorted(before)  # no temporary left behind


@pytest.mark.parametrize("ext", [".tif", ".tiff", ".npy", ".nii", ".zarr"])
def test_format_in_is_format_out(tmp_path, checkpoint, capsys, ext):
    (source,) = write_inputs(tmp_path / "in", [(16, 32, 32)], ext=ext)
    code, _, _ = run(
        capsys,
        "--checkpoint",
        checkpoint,
        "--input",
        source if ext == ".zarr" else tmp_path / "in",  # one .zarr folder is one volume
        "--output",
        tmp_path / "out",
        "--save",
        "mask",
    )
    assert code == 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [f"vol_00_mask{ext}"]
    mask, _ = read_volume(tmp_path / "out" / f"vol_00_mask{ext}")
    assert mask.shape == (16, 32, 32) and mask.dtype == np.uint8
    if ext in (".tif", ".tiff"):
        assert tifffile.imread(tmp_path / "out" / f"vol_00_mask{ext}").shape == (16, 32, 32)


def test_any_size_and_save_modes(tmp_path, checkpoint, capsys):
    """Smaller than the window on every axis or some, non-multiples, larger: shape kept."""
    shapes = [(8, 20, 20), (19, 37, 41), (16, 12, 50), (33, 70, 65)]
    write_inputs(tmp_path / "in", shapes, ext=".npy")
    code, _, _ = run(
        capsys,
        "--checkpoint",
        checkpoint,
        "--input",
        tmp_path / "in",
        "--output",
        tmp_path / "probs",
        "--save",
        "probs",
        "--sw-batch-size",
        "4",
    )
    assert code == 0
    names = sorted(p.name for p in (tmp_path / "probs").iterdir())
    assert names == [f"vol_{i:02d}_probs.npy" for i in range(4)]
    for i, shape in enumerate(shapes):
        probs = np.load(tmp_path / "probs" / f"vol_{i:02d}_probs.npy")
        assert probs.shape == shape and probs.dtype == np.float32 and np.isfinite(probs).all()

    code, _, _ = run(
        capsys,
        "--checkpoint",
        checkpoint,
        "--input",
        tmp_path / "in" / "vol_00.npy",
        "--output",
        tmp_path / "both",
        "--window",
        "8",
        "16",
        "16",
        "--overlap",
        "0.25",
    )
    assert code == 0
    assert sorted(p.name for p in (tmp_path / "both").iterdir()) == [
        "vol_00_mask.npy",
        "vol_00_probs.npy",
    ]


def test_checkpoint_errors(tmp_path, capsys):
    write_inputs(tmp_path / "in", [(16, 32, 32)])
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint at all")
    foreign = tmp_path / "foreign.pt"
    torch.save({"state_dict": {}}, foreign)
    misfit = make_checkpoint(tmp_path / "misfit.pt")
    state = torch.load(misfit, weights_only=True)
    state["config"]["f_maps"] = 8
    save_checkpoint(misfit, state)
    cases = {
        tmp_path / "missing.pt": "not found",
        garbage: "corrupt or truncated",
        foreign: "not a checkpoint of this trainer",
        misfit: "weights do not fit",
    }
    for path, words in cases.items():
        code, _, err = run(
            capsys, "--checkpoint", path, "--input", tmp_path / "in", "--output", tmp_path / "out"
        )
        assert code == 2 and str(path) in err and words in err, err
    assert not any((tmp_path / "out").glob("*.nii.gz"))


def test_input_and_output_errors(tmp_path, checkpoint, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("no volumes here")
    code, _, err = run(
        capsys,
        "--checkpoint",
        checkpoint,
        "--input",
        tmp_path / "empty",
        "--output",
        tmp_path / "out",
    )
    assert code == 2 and "no volumes" in err and str(tmp_path / "empty") in err

    code, _, err = run(
        capsys,
        "--checkpoint",
        checkpoint,
        "--input",
        tmp_path / "nowhere",
        "--output",
        tmp_path / "out",
    )
    assert code == 2 and "--input" in err and "nowhere" in err

    write_inputs(tmp_path / "in", [(16, 32, 32)])
    blocker = tmp_path / "a_file"
    blocker.write_text("a file where a folder should be")
    code, _, err = run(
        capsys, "--checkpoint", checkpoint, "--input", tmp_path / "in", "--output", blocker / "out"
    )
    assert code == 2 and "--output" in err and "cannot write" in err

    code, _, err = run(
        capsys, "--checkpoint", checkpoint, "--input", tmp_path / "in", "--output", tmp_path / "in"
    )
    assert code == 2 and "input folder" in err

    code, _, err = run(
        capsys,
        "--checkpoint",
        checkpoint,
        "--input",
        tmp_path / "in",
        "--output",
        tmp_path / "out",
        "--window",
        "2",
        "32",
        "32",
    )
    assert code == 2 and "--window" in err
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_unreadable_volume_is_named_and_the_others_are_predicted(tmp_path, checkpoint, capsys):
    write_inputs(tmp_path / "in", [(16, 32, 32), (16, 32, 32)])
    bad = tmp_path / "in" / "vol_01.nii.gz"
    bad.write_bytes(bad.read_bytes()[:200])  # truncated
    nan = tmp_path / "in" / "vol_02.npy"
    np.save(nan, np.full((16, 32, 32), np.nan, np.float32))
    code, stdout, err = run(
        capsys, "--checkpoint", checkpoint, "--input", tmp_path / "in", "--output", tmp_path / "out"
    )
    assert code == 2
    assert str(bad) in err and str(nan) in err and "NaN" in err
    assert "predicted 1 of 3" in stdout
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "vol_00_mask.nii.gz",
        "vol_00_probs.nii.gz",
    ]


def test_help_is_clear():
    text = predict_cli.build_parser().format_help()
    for flag in (
        "--checkpoint",
        "--input",
        "--output",
        "--window",
        "--overlap",
        "--tta",
        "--save",
        "--overwrite",
        "--device",
        "--amp-backend",
        "--opt-level",
    ):
        assert flag in text


# ----------------------------------------------------------------------------- processes
def test_two_processes_predict_each_volume_once_and_match_one(tmp_path, checkpoint, capsys):
    write_inputs(tmp_path / "in", [(16, 32, 32), (12, 40, 30), (20, 32, 36)], ext=".nii.gz")
    code, _, _ = run(
        capsys, "--checkpoint", checkpoint, "--input", tmp_path / "in", "--output", tmp_path / "one"
    )
    assert code == 0
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NO_ALBUMENTATIONS_UPDATE": "1"}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "app.predict",
            "--checkpoint",
            str(checkpoint),
            "--input",
            str(tmp_path / "in"),
            "--output",
            str(tmp_path / "two"),
            "--device",
            "cpu",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "predicted 3 of 3 volume(s) on 2 process(es) (rank 0: 2, rank 1: 1)" in result.stdout
    assert result.stdout.count("predicted 3 of 3") == 1  # rank 0 alone prints the summary
    one = sorted(p.name for p in (tmp_path / "one").iterdir())
    assert one == sorted(p.name for p in (tmp_path / "two").iterdir()) and len(one) == 6
    for name in one:
        a, _ = read_volume(tmp_path / "one" / name)
        b, _ = read_volume(tmp_path / "two" / name)
        np.testing.assert_allclose(a, b, atol=1e-6)


# ----------------------------------------------------------------------------- vs. the trainer
def test_predicted_dice_equals_the_trainers_reported_dice(tmp_path, capsys):
    """Train 2 epochs, predict the val volumes with best.pt, evaluate: the global Dice must be the
    one the trainer reported for that checkpoint (same preprocessing, windows, blending,
    precision and threshold), well within the 0.02 the issue allows."""
    from app.analysis.evaluate import main as evaluate_main

    data = write_dataset(tmp_path / "data", n_train=3, n_val=3)
    run_dir = train_tiny(data, tmp_path / "run", *BF16)
    best = torch.load(run_dir / "checkpoints" / "best.pt", weights_only=True)
    assert best["config"]["opt_level"] == "O1"  # bf16 autocast on CPU: predict must follow it
    capsys.readouterr()

    code, _, err = run(
        capsys,
        "--checkpoint",
        run_dir / "checkpoints" / "best.pt",
        "--input",
        data / "val_patches" / "images",
        "--output",
        tmp_path / "pred",
    )
    assert code == 0, err
    assert (
        evaluate_main(
            [
                "--pred",
                str(tmp_path / "pred"),
                "--labels",
                str(data / "val_patches" / "labels"),
                "--out",
                str(tmp_path / "eval.json"),
            ]
        )
        == 0
    )
    summary = json.loads((tmp_path / "eval.json").read_text())
    assert abs(summary["global"]["dice"] - best["metrics"]["dice"]) < 0.02
    assert summary["global"]["dice"] == pytest.approx(best["metrics"]["dice"], abs=1e-9)
    assert summary["mean"]["dice"] == pytest.approx(
        best["metrics"]["dice_per_volume_mean"], abs=1e-9
    )


def test_precision_follows_the_checkpoint_and_the_flags(tmp_path, capsys):
    """Default: the checkpoint's precision; flags override it; an apex checkpoint predicted on
    CPU falls back to native autocast; half precision stays close to fp32."""
    write_inputs(tmp_path / "in", [(16, 32, 32)], ext=".npy")
    checkpoint = make_checkpoint(tmp_path / "bf16.pt", opt_level="O1", amp_dtype="bfloat16")
    predictor = predict_cli.load_predictor(checkpoint)
    assert predictor.precision.describe().startswith("native O1 (autocast, bfloat16")

    apex_cfg = Config(amp_backend="apex", opt_level="O2")
    cpu = torch.device("cpu")
    fallback = predict_cli.inference_config(apex_cfg, cpu)
    assert (fallback.amp_backend, fallback.opt_level) == ("native", "O1")

    results = {}
    for level in ("O0", "O1", "O3"):
        out = tmp_path / level
        code, _, err = run(
            capsys,
            "--checkpoint",
            checkpoint,
            "--input",
            tmp_path / "in",
            "--output",
            out,
            "--opt-level",
            level,
            "--save",
            "probs",
        )
        assert code == 0, err
        results[level] = np.load(out / "vol_00_probs.npy")
    for level in ("O1", "O3"):
        assert np.abs(results[level] - results["O0"]).max() < 0.05
    code, _, err = run(
        capsys,
        "--checkpoint",
        checkpoint,
        "--input",
        tmp_path / "in",
        "--output",
        tmp_path / "o2",
        "--opt-level",
        "O2",
    )
    assert code == 2 and "O2" in err


def test_mask_post_processing_is_opt_in(tmp_path, checkpoint, capsys):
    write_inputs(tmp_path / "in", [(16, 32, 32)], ext=".npy")
    args = ["--checkpoint", checkpoint, "--input", tmp_path / "in"]
    assert run(capsys, *args, "--output", tmp_path / "plain")[0] == 0
    code, _, _ = run(
        capsys, *args, "--output", tmp_path / "clean", "--min-object-size", 10**6, "--fill-holes"
    )
    assert code == 0
    plain_probs = np.load(tmp_path / "plain" / "vol_00_probs.npy")
    assert np.array_equal(np.load(tmp_path / "plain" / "vol_00_mask.npy"), plain_probs > 0.5)
    # every object is under 10**6 voxels: all removed; the probabilities are untouched
    assert not np.load(tmp_path / "clean" / "vol_00_mask.npy").any()
    assert np.array_equal(np.load(tmp_path / "clean" / "vol_00_probs.npy"), plain_probs)
    code, _, err = run(capsys, *args, "--output", tmp_path / "bad", "--min-object-size", -1)
    assert code == 2 and "--min-object-size" in err
