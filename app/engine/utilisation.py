"""How close a run is to the machine: the model's FLOPs per step against a practical peak.

- **FLOPs per step**: the convolutions (and any matmul) of one forward and backward pass at the
  configured model, patch and batch, counted by ``torch.utils.flop_counter`` on the meta device
  (no memory, no compute). Norms, activations, the loss and the optimizer do few FLOPs and are
  not counted: their time is what the ratio shows as lost.
- **Practical peak**: what this process gets from one large 3x3x3 convolution (64 -> 64
  channels) in the run's precision and memory format, forward and both backward passes, timed
  on the device that trains (all processes measure at once, sharing the machine as they will
  when training). It is the fastest that this layer type runs here, not the vendor's figure:
  the best of about a second of rounds, so that a neighbour on a shared machine does not make
  it a low figure. Where the device has no native arithmetic for the run's half precision
  (bf16 on an AVX2 CPU), the peak is fp32's: the ratio then shows what emulation wastes.
  Cached per device, torch version, threads, processes per node and precision (``app.cache``),
  so only a machine's first run pays that second.
- **Utilisation**: achieved FLOP/s (FLOPs per step x steps / training seconds, per process)
  over the peak. The trainer logs it at start-up from the precision probe's step time and writes
  it with every epoch's record (``gflop_per_s``, ``peak_gflop_per_s``, ``utilisation`` in
  ``metrics.jsonl``); the first epoch's figure includes the loader's start and, when compiling,
  the compile time.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from app import cache
from app.config import Config
from app.model import build_model
from app.precision.hardware import detect

# batch, channels, D, H, W of the peak's convolution: large enough for the fastest kernels, and
# about 0.2 s of work per round on one CPU core (a few ms on a GPU)
PEAK_INPUT = {"cpu": (1, 64, 16, 32, 32), "cuda": (4, 128, 32, 64, 64)}
# Best of the rounds that fit in PEAK_SECONDS: on a shared 2-core VM (AMD EPYC Zen 3) the best of 3
# rounds ranged 78-140 GFLOP/s across processes, the best of 12 (about a second) 110-140
PEAK_SECONDS = 1.0
PEAK_MIN_ROUNDS = 5
PEAK_MAX_ROUNDS = 100
PEAK_CACHE_VERSION = 2


def step_flops(cfg: Config) -> float:
    """FLOPs of one training step's forward and backward pass (per process)."""
    meta = torch.device("meta")
    with meta:
        model = build_model(cfg, meta)
        images = torch.empty(cfg.batch_size, 1, *cfg.patch_size)
    with FlopCounterMode(display=False) as counter:
        model(images).sum().backward()
    return float(counter.get_total_flops())


def autocast_dtype(cfg: Config) -> torch.dtype | None:
    """The dtype the convolutions compute in: None for fp32 (O0)."""
    return None if cfg.opt_level == "O0" else getattr(torch, cfg.amp_dtype)


def peak_dtype(device: torch.device, dtype: torch.dtype | None) -> torch.dtype | None:
    """The precision the peak is measured in: the run's, unless this device computes it in
    software (bf16 on an AVX2 CPU ran at about 1 GFLOP/s, a round of the peak's convolution took
    15 s); then fp32, the best the machine does, against which an emulated run shows its waste."""
    caps = detect(device)
    native = {torch.bfloat16: caps.native_bf16, torch.float16: caps.native_fp16}
    return None if dtype is not None and not native.get(dtype, True) else dtype


def measure_peak(device: torch.device, dtype: torch.dtype | None, channels_last: bool) -> float:
    """FLOP/s of the peak convolution here: the best round after one warm-up, of at least
    ``PEAK_MIN_ROUNDS`` rounds and ``PEAK_SECONDS`` (a few hundred rounds' worth on a GPU is
    capped at ``PEAK_MAX_ROUNDS``)."""
    batch, channels, *spatial = PEAK_INPUT[device.type]
    layout = torch.channels_last_3d if channels_last else torch.contiguous_format
    # forward, gradient of the input and gradient of the weights: 3 convolutions' worth
    flops = 3 * 2 * channels * channels * 27 * batch * math.prod(spatial)
    seconds = []
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        conv = nn.Conv3d(channels, channels, 3, padding=1, bias=False)
        conv = conv.to(device, memory_format=layout)
        images = torch.randn(batch, channels, *spatial, device=device)
        images = images.to(memory_format=layout).requires_grad_()
        while len(seconds) <= PEAK_MAX_ROUNDS and (
            len(seconds) <= PEAK_MIN_ROUNDS or sum(seconds[1:]) < PEAK_SECONDS
        ):
            synchronize(device)
            started = time.perf_counter()
            with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                out = conv(images)
            out.backward(torch.ones_like(out))
            synchronize(device)
            seconds.append(time.perf_counter() - started)
    return flops / min(seconds[1:])


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_facts(device: torch.device, dtype: torch.dtype | None, channels_last: bool) -> dict:
    caps = detect(device)
    return {
        "version": PEAK_CACHE_VERSION,
        "device": caps.fingerprint(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads() if device.type == "cpu" else None,
        "processes_per_node": int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1),
        "dtype": str(dtype or torch.float32),
        "channels_last": channels_last,
        "input": list(PEAK_INPUT[device.type]),
    }


@dataclass(frozen=True)
class Utilisation:
    """One run's FLOPs per step and practical peak (per process), and the ratio of a rate."""

    step_flop: float
    peak_flop_per_s: float
    precision: str  # e.g. "bf16 autocast, channels_last"
    peak_source: str  # "measured" or "cached in PATH"
    emulated: bool = False  # the run's precision is software here: the peak is fp32's

    @classmethod
    def for_run(cls, cfg: Config, device: torch.device, precision: str) -> Utilisation:
        """Count the step and measure (or read) the peak; call on every process at once."""
        dtype = peak_dtype(device, autocast_dtype(cfg))
        channels_last = cfg.memory_format == "channels_last"
        facts = peak_facts(device, dtype, channels_last)
        path = cache.cache_file("peak", facts)
        peak = cache.load(path, facts, "flop_per_s")
        source = f"cached in {path}"
        if peak is None:
            peak, source = measure_peak(device, dtype, channels_last), "measured"
            cache.store(path, facts, "flop_per_s", peak)
        emulated = dtype != autocast_dtype(cfg)
        return cls(step_flops(cfg), float(peak), precision, source, emulated)

    def figures(self, steps: float, seconds: float) -> dict[str, float]:
        """The record fields for ``steps`` steps of this process in ``seconds``."""
        achieved = self.step_flop * steps / seconds if seconds > 0 else 0.0
        return {
            "gflop_per_s": achieved / 1e9,
            "peak_gflop_per_s": self.peak_flop_per_s / 1e9,
            "utilisation": achieved / self.peak_flop_per_s,
        }

    def describe(self, step_s: float | None = None) -> str:
        peak_in = (
            f"is fp32's (this device has no native {self.precision.split()[0]}):"
            if self.emulated
            else f"in {self.precision} is"
        )
        line = (
            f"one step is {self.step_flop / 1e9:.1f} GFLOP (convolutions, forward and backward); "
            f"this process's practical peak {peak_in} "
            f"{self.peak_flop_per_s / 1e9:.0f} GFLOP/s (a 64->64 3x3x3 convolution, "
            f"{self.peak_source})"
        )
        if step_s:
            figures = self.figures(1, step_s)
            line += (
                f"; the probe's {step_s * 1000:.0f} ms step runs at "
                f"{figures['gflop_per_s']:.0f} GFLOP/s, {figures['utilisation']:.0%} of it"
            )
        return line
