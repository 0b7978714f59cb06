"""What this machine can do: native half-precision arithmetic, its name, one line that says so.

A CPU "has native bf16" when its instructions compute bf16 (AVX512-BF16, AMX-BF16, or Arm's
BF16 extension) *and* the oneDNN that torch ships will use them. oneDNN also accepts bf16 on a
plain AVX-512 CPU by converting to fp32 and back; that is emulation, several times slower than
fp32, and on an AVX2-only CPU (most laptops, CI runners, older AMD servers) bf16 autocast was
measured 62x slower than fp32. So capability comes from both the CPU's flags and oneDNN, and
``ONEDNN_MAX_CPU_ISA`` / ``ATEN_CPU_CAPABILITY`` (which cap what the libraries use) are honoured.

On CUDA, bf16 is native from compute capability 8.0 (Ampere) and fp16 has tensor cores from 7.0.
"""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass
from pathlib import Path

import torch

# x86 /proc/cpuinfo flags, and Arm "Features", that mean the arithmetic itself is native
BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})
FP16_FLAGS = frozenset({"avx512_fp16", "amx_fp16", "fphp", "asimdhp"})
AMX_FLAGS = frozenset({"amx_tile", "amx_bf16"})


@dataclass(frozen=True)
class Capabilities:
    """Half-precision facts about one device, as the auto rules need them."""

    device_type: str  # "cpu" or "cuda"
    name: str  # "AMD EPYC 9654" / "NVIDIA H100 80GB HBM3"
    isa: str  # CPU: torch's kernel level (AVX2, AVX512, ...); CUDA: "sm_90"
    native_bf16: bool
    native_fp16: bool
    amx: bool = False
    cudnn: int | None = None  # torch.backends.cudnn.version() on CUDA

    def features(self) -> str:
        """``AVX512, native bf16, no native fp16, no AMX``: the facts behind a decision."""
        parts = [self.isa]
        parts.append("native bf16" if self.native_bf16 else "no native bf16")
        parts.append("native fp16" if self.native_fp16 else "no native fp16")
        if self.device_type == "cpu":
            parts.append("AMX" if self.amx else "no AMX")
        if self.cudnn:
            parts.append(f"cuDNN {self.cudnn}")
        return ", ".join(parts)

    def describe(self) -> str:
        return f"{self.name} ({self.features()})"

    def fingerprint(self) -> dict[str, object]:
        """What a cached decision must match (see ``app.precision.auto``)."""
        return {
            "device_type": self.device_type,
            "name": self.name,
            "isa": self.isa,
            "native_bf16": self.native_bf16,
            "native_fp16": self.native_fp16,
            "amx": self.amx,
            "cudnn": self.cudnn,
        }


@functools.cache
def cpu_info() -> tuple[str, frozenset[str]]:
    """The CPU's model name and feature flags from ``/proc/cpuinfo`` (Linux); elsewhere the
    platform's processor name and no flags."""
    fields: dict[str, str] = {}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip().lower(), value.strip())
    name = fields.get("model name") or fields.get("hardware") or fields.get("cpu model", "")
    name = name or platform.processor() or platform.machine() or "unknown CPU"
    if "cpu family" in fields and "model" in fields:  # virtual CPUs are often just "AMD EPYC"
        name += f" family {fields['cpu family']} model {fields['model']}"
    flags = frozenset((fields.get("flags") or fields.get("features", "")).split())
    return name, flags


def cpu_capabilities() -> Capabilities:
    name, flags = cpu_info()
    onednn_bf16 = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    onednn_fp16 = bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    # without /proc/cpuinfo (macOS) oneDNN's own answer is all there is
    known = bool(flags)
    return Capabilities(
        device_type="cpu",
        name=name,
        isa=torch.backends.cpu.get_cpu_capability(),
        native_bf16=onednn_bf16 and (not known or bool(flags & BF16_FLAGS)),
        native_fp16=onednn_fp16 and (not known or bool(flags & FP16_FLAGS)),
        amx=onednn_bf16 and bool(flags & AMX_FLAGS),
    )


def cuda_capabilities(device: torch.device) -> Capabilities:
    major, minor = torch.cuda.get_device_capability(device)
    return Capabilities(
        device_type="cuda",
        name=torch.cuda.get_device_name(device),
        isa=f"sm_{major}{minor}",
        native_bf16=major >= 8,
        native_fp16=major >= 7,
        cudnn=torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
    )


def detect(device: torch.device) -> Capabilities:
    return cuda_capabilities(device) if device.type == "cuda" else cpu_capabilities()


def machine_line(device: torch.device) -> str:
    """One line for logs and benchmark headers: the device, its features and the threads."""
    caps = detect(device)
    threads = f", {torch.get_num_threads()} threads" if device.type == "cpu" else ""
    return f"{caps.describe()}{threads}"
