"""MONAI's sliding-window inference (what ``app.engine.inference.predict_logits`` runs) against a
small hand-written Gaussian-blended sliding window, on the same model and volume, side by side.

    python bench/sliding_window.py                      # CPU defaults, a few minutes at most
    python bench/sliding_window.py --device cuda --shape 74 320 320 --window 32 160 160 --f-maps 32
    python bench/sliding_window.py --checkpoint runs/demo/checkpoints/best.pt \
        --input datasets/IronGrain/demo/val_patches/images/NAME.nii.gz --window 32 96 96

Prints the largest absolute difference between the two outputs (logits and probabilities) and
the median time of each over ``--runs`` interleaved runs, with their ratio. The reference uses
the same window grid (start every ``int(window * (1 - overlap))`` voxels, the last window flush
with the far edge), the same Gaussian (sigma = window / 8, centred on the window), the same
padding of small volumes (with the volume's minimum) and the same batching, so the two should
agree to float rounding: a larger difference would be a bug in one of them. For the record it
also prints how far MONAI's built-in importance map (every weight floored at 1e-3) moves the
result.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.config import Config
from app.data.dataset import Normalization
from app.engine.inference import predict_logits
from app.model import UNet3d
from app.precision.amp import build_precision


def window_starts(size: int, window: int, step: int) -> list[int]:
    """Starts every ``step`` voxels; the last window ends exactly at ``size``."""
    if size <= window:
        return [0]
    return [*range(0, size - window, step), size - window]


def gaussian_weights(window: tuple[int, int, int], sigma_scale: float = 0.125) -> torch.Tensor:
    """Separable Gaussian centred on the window (no floor: see ``app.engine.inference``)."""
    axes = []
    for w in window:
        x = torch.arange(w, dtype=torch.float64) - (w - 1) / 2
        axes.append(torch.exp(-(x**2) / (2 * (sigma_scale * w) ** 2)))
    return (axes[0][:, None, None] * axes[1][None, :, None] * axes[2][None, None, :]).float()


def reference_sliding_window(
    forward, volume: torch.Tensor, window: tuple[int, int, int], overlap: float, batch: int
) -> torch.Tensor:
    """Gaussian-weighted average of ``forward`` over overlapping windows of a (1, 1, D, H, W)
    volume; returns (1, C, D, H, W)."""
    shape = volume.shape[2:]
    pads = [max(w - s, 0) for s, w in zip(shape, window)]
    if any(pads):  # F.pad takes the last axis first
        pad_arg = [p for axis in reversed(pads) for p in (axis // 2, axis - axis // 2)]
        volume = torch.nn.functional.pad(volume, pad_arg, value=float(volume.min()))
    padded = volume.shape[2:]
    steps = [max(int(w * (1 - overlap)), 1) if w != s else w for s, w in zip(padded, window)]
    grids = [window_starts(s, w, st) for s, w, st in zip(padded, window, steps)]
    corners = [(z, y, x) for z in grids[0] for y in grids[1] for x in grids[2]]
    weights = gaussian_weights(window).to(volume.device)
    total = norm = None
    for i in range(0, len(corners), batch):
        group = corners[i : i + batch]
        boxes = [tuple(slice(c, c + w) for c, w in zip(corner, window)) for corner in group]
        out = forward(torch.cat([volume[(0, slice(None), *box)][None] for box in boxes]))
        if total is None:
            total = torch.zeros((1, out.shape[1], *padded), device=volume.device)
            norm = torch.zeros((1, 1, *padded), device=volume.device)
        for k, box in enumerate(boxes):
            total[(0, slice(None), *box)] += out[k] * weights
            norm[(0, 0, *box)] += weights
    result = total / norm
    crop = tuple(slice(p // 2, p // 2 + s) for p, s in zip(pads, shape))
    return result[(slice(None), slice(None), *crop)]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--shape", type=int, nargs=3, default=[40, 128, 128])
    parser.add_argument("--window", type=int, nargs=3, default=[32, 64, 64])
    parser.add_argument("--overlap", type=float, default=0.5)
    parser.add_argument("--sw-batch-size", type=int, default=2)
    parser.add_argument("--f-maps", type=int, default=8)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--opt-level", default="O0", choices=["O0", "O1"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument(
        "--checkpoint",
        help="a trained checkpoint instead of a random UNet3d "
        "(its model and precision; --f-maps, --depth, --opt-level ignored)",
    )
    parser.add_argument(
        "--input",
        help="a volume file instead of random noise (normalised as "
        "the checkpoint says, z-score otherwise; --shape ignored)",
    )
    args = parser.parse_args()

    device = torch.device(args.device)
    torch.manual_seed(0)
    if args.checkpoint:
        from app.analysis.predict import load_predictor

        predictor = load_predictor(args.checkpoint, device)
        model, precision = predictor.model, predictor.precision
        normalize = predictor.normalization
        args.f_maps, args.depth = predictor.cfg.f_maps, predictor.cfg.depth
        args.opt_level = predictor.cfg.opt_level
    else:
        model = UNet3d(1, 1, args.f_maps, args.depth).to(device).eval()
        precision = build_precision(Config(opt_level=args.opt_level), device)
        normalize = Normalization("zscore")
    if args.input:
        from app.data.volume_io import read_volume

        image = normalize(read_volume(args.input)[0])
        volume = torch.as_tensor(image, device=device)
        args.shape = list(image.shape)
    else:
        volume = torch.randn(args.shape, device=device)
    window = tuple(args.window)

    def forward(x: torch.Tensor) -> torch.Tensor:
        with precision.autocast():
            return model(x).float()

    def monai() -> torch.Tensor:
        return predict_logits(model, volume, window, precision, args.overlap, args.sw_batch_size)

    def reference() -> torch.Tensor:
        with torch.inference_mode():
            return reference_sliding_window(
                forward, volume[None, None], window, args.overlap, args.sw_batch_size
            )

    def timed(fn) -> tuple[float, torch.Tensor]:
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start, out

    monai(), reference()  # warm-up: MONAI import, kernels, allocator
    times: dict[str, list[float]] = {"monai": [], "reference": []}
    for _ in range(args.runs):  # interleaved, so both see the same machine load
        t, a = timed(monai)
        times["monai"].append(t)
        t, b = timed(reference)
        times["reference"].append(t)

    with torch.inference_mode():
        from monai.inferers import sliding_window_inference

        builtin = sliding_window_inference(
            volume[None, None],
            window,
            args.sw_batch_size,
            forward,
            args.overlap,
            "gaussian",
            0.125,
            padding_mode="constant",
            cval=float(volume.min()),
        )
    builtin_diff = float((torch.sigmoid(builtin) - torch.sigmoid(b)).abs().max())
    logits_diff = float((a - b).abs().max())
    probs_diff = float((torch.sigmoid(a) - torch.sigmoid(b)).abs().max())
    masks_differ = int(((a > 0) != (b > 0)).sum())
    med = {k: statistics.median(v) for k, v in times.items()}
    print(
        f"torch {torch.__version__}, device {device}, threads {torch.get_num_threads()}, "
        f"{args.opt_level}; UNet3d(f_maps={args.f_maps}, depth={args.depth}); volume "
        f"{tuple(args.shape)}, window {window}, overlap {args.overlap}, sw batch "
        f"{args.sw_batch_size}, {args.runs} runs each"
    )
    print(
        f"max |logits difference|        {logits_diff:.3g}  (logits span "
        f"{float(a.min()):.3g} .. {float(a.max()):.3g})"
    )
    print(f"max |probability difference|   {probs_diff:.3g}")
    print(f"mask voxels that differ        {masks_differ} of {a.numel()}")
    print(
        f"(MONAI's built-in map, floored at 1e-3: max |probability difference| {builtin_diff:.3g})"
    )
    print(
        f"median time: MONAI {med['monai']:.3f} s, reference {med['reference']:.3f} s, "
        f"MONAI / reference = {med['monai'] / med['reference']:.3f}"
    )


if __name__ == "__main__":
    main()
