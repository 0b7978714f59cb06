"""One 3x3x3 convolution, forward and both backward passes, in channels_last and contiguous layout.

    python bench/conv_layout.py                                  # the demo's full-resolution layers
    python bench/conv_layout.py --convs 8:8 16:8 --shape 32 64 64 --batch 2 --repeats 15

The demo model spends most of its step in its 8-channel full-resolution convolutions
(bench/README "ReLU under compile"). This times each such layer alone, per precision (``bf16``:
fp32 weights under bf16 autocast, as the trainer's O1; ``bf16-weights``: weights and activations
stored in bf16; ``fp32``), in both memory layouts. The layouts alternate run by run, so both see
the same machine load; the table gives medians and the contiguous / channels_last ratio.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Sequence

import torch
from torch import nn

PRECISIONS = ("bf16", "bf16-weights", "fp32")
LAYOUTS = {"channels_last": torch.channels_last_3d, "contiguous": torch.contiguous_format}


def layer(cin: int, cout: int, shape, batch: int, layout: str, precision: str):
    """A convolution and its input, in ``layout`` and ``precision``, seeded alike for both."""
    torch.manual_seed(0)
    conv = nn.Conv3d(cin, cout, 3, padding=1).to(memory_format=LAYOUTS[layout])
    x = torch.randn(batch, cin, *shape).contiguous(memory_format=LAYOUTS[layout])
    if precision == "bf16-weights":
        conv, x = conv.to(torch.bfloat16), x.to(torch.bfloat16)
    return conv, x.requires_grad_(True)


def timed_pass(conv: nn.Module, x: torch.Tensor, precision: str) -> float:
    started = time.perf_counter()
    with torch.autocast("cpu", torch.bfloat16, enabled=precision == "bf16"):
        y = conv(x)
    y.backward(torch.ones_like(y))
    return time.perf_counter() - started


def measure(cin, cout, shape, batch, precision, repeats, warmup=3) -> dict[str, float]:
    """Median seconds per layout, the layouts interleaved."""
    layers = {name: layer(cin, cout, shape, batch, name, precision) for name in LAYOUTS}
    times: dict[str, list[float]] = {name: [] for name in LAYOUTS}
    for i in range(warmup + repeats):
        for name, (conv, x) in layers.items():
            elapsed = timed_pass(conv, x, precision)
            if i >= warmup:
                times[name].append(elapsed)
    return {name: statistics.median(t) for name, t in times.items()}


def parse_conv(text: str) -> tuple[int, int]:
    try:
        cin, cout = (int(v) for v in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--convs {text!r}: expected IN:OUT, e.g. 8:8") from None
    if cin < 1 or cout < 1:
        raise argparse.ArgumentTypeError(f"--convs {text!r}: channels must be 1 or more")
    return cin, cout


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--convs", type=parse_conv, nargs="+", default=[(8, 8), (16, 8), (1, 8)])
    parser.add_argument("--shape", type=int, nargs=3, default=[32, 64, 64], metavar=("D", "H", "W"))
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--precisions", nargs="+", choices=PRECISIONS, default=list(PRECISIONS))
    parser.add_argument("--repeats", type=int, default=15, help="timed passes per layout")
    args = parser.parse_args(argv)
    if args.batch < 1 or args.repeats < 1 or min(args.shape) < 1:
        parser.error("--batch, --repeats and --shape must be 1 or more")
    print(f"conv_layout: torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"batch {args.batch}, {'x'.join(map(str, args.shape))}, medians of {args.repeats}")
    print(f"{'conv':>6} {'precision':<13} {'channels_last':>14} {'contiguous':>11} {'ratio':>6}")
    for cin, cout in args.convs:
        flop = 3 * 2 * cin * cout * 27 * args.batch * math.prod(args.shape)  # fwd + 2 backward
        for precision in args.precisions:
            t = measure(cin, cout, args.shape, args.batch, precision, args.repeats)
            last, contiguous = t["channels_last"], t["contiguous"]
            print(
                f"{cin:>3}->{cout:<2} {precision:<13} {last * 1e3:11.1f} ms "
                f"{contiguous * 1e3:8.1f} ms {contiguous / last:5.2f}x  "
                f"({flop / last / 1e9:.0f} GFLOP/s channels_last)"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
