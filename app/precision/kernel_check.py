"""Do the convolution kernels of a mixed-precision candidate compute the right answer at this
model and patch?

A fast kernel is worth nothing if its answer is wrong, and half-precision convolution kernels are
sometimes wrong for particular shapes only. With torch 2.13 on an AVX512-BF16 CPU (AMD EPYC, Zen
4), oneDNN's bf16 weight gradient of a 3x3x3 convolution with 16 or more channels is garbage (50%
to 10^19 relative error, sometimes NaN) whenever its input is 2 voxels deep, which is what a
16-voxel-deep patch leaves at the bottom of a 4-level U-Net. The forward pass is right and the
loss looks sane; only the deepest layers stop learning, and now and then a step is skipped for a
NaN. cuDNN 9.10-9.14 has a bf16 3D bug of its own (``app.precision.auto.CUDNN_BF16_CONV3D_BUG``).

:func:`check_convolutions` runs one training forward and backward pass of the real model under
the candidate's autocast, on a random batch at the configured patch and batch size, and records
every convolution's input, weights, output and output gradient as the candidate computed them.
It then recomputes each convolution's output and weight gradient in float32 from those same
(already rounded) tensors. What remains is the rounding of one kernel's result (measured at most
0.4% in bf16 on the EPYC), so the comparison isolates the kernel: a model-level comparison
would mix in the rounding of every layer before it, which through BatchNorm at initialisation
reaches 30-40% at healthy shapes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from app.config import Config
from app.labels import build_loss
from app.model import build_model

TOLERANCE = 0.05  # relative error of one kernel's result against float32 from the same inputs
CONVOLUTIONS = (nn.Conv3d, nn.ConvTranspose3d)


@dataclass(frozen=True)
class KernelError:
    worst: float  # the largest relative error (inf: not finite)
    where: str  # "encoders.3.3 weight gradient", or "" when nothing was compared

    @property
    def ok(self) -> bool:
        return self.worst <= TOLERANCE

    def describe(self) -> str:
        size = "not finite" if self.worst == float("inf") else f"{self.worst:.1%} off"
        return f"{self.where} {size} against fp32"


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    if not torch.isfinite(got).all():
        return float("inf")
    return ((got.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def float32_forward(conv: nn.Module, x: torch.Tensor, weight, bias) -> torch.Tensor:
    """The convolution's own op, called directly (the module's hooks are not run)."""
    if isinstance(conv, nn.ConvTranspose3d):
        return F.conv_transpose3d(
            x,
            weight,
            bias,
            conv.stride,
            conv.padding,
            conv.output_padding,
            conv.groups,
            conv.dilation,
        )
    return F.conv3d(x, weight, bias, conv.stride, conv.padding, conv.dilation, conv.groups)


def check_convolutions(cfg: Config, device: torch.device) -> KernelError:
    """The worst relative error of any convolution's output or weight gradient under ``cfg``'s
    autocast (native O1), against float32 from the same inputs. Leaves the RNG as it was."""
    from app.engine.steps import synthetic_batch

    dtype = getattr(torch, cfg.amp_dtype)
    seen: dict[str, dict[str, torch.Tensor]] = {}

    def record(name: str):
        def hook(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
            # a clone: an in-place ReLU overwrites the output next (the gradient hook still gets
            # the gradient of the values before it)
            seen[name] = {"input": args[0].detach().to(dtype), "output": out.detach().clone()}
            out.register_hook(lambda grad: seen[name].__setitem__("grad", grad.detach()))

        return hook

    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(cfg.seed)
        model = build_model(cfg, device).train()
        images, labels = synthetic_batch(cfg, device)
    convs = {name: m for name, m in model.named_modules() if isinstance(m, CONVOLUTIONS)}
    hooks = [m.register_forward_hook(record(name)) for name, m in convs.items()]
    if cfg.memory_format == "channels_last":
        images = images.contiguous(memory_format=torch.channels_last_3d)
    try:
        with torch.autocast(device.type, dtype=dtype):
            logits = model(images)
        build_loss(cfg)(logits.float(), labels).backward()
    finally:
        for hook in hooks:
            hook.remove()

    worst = KernelError(0.0, "")
    for name, conv in convs.items():
        record_ = seen[name]
        weight = conv.weight.detach().to(dtype).float().requires_grad_()
        bias = None if conv.bias is None else conv.bias.detach().to(dtype).float()
        out = float32_forward(conv, record_["input"].float(), weight, bias)
        (grad,) = torch.autograd.grad(out, weight, record_["grad"].float())
        for what, got, ref in (
            ("output", record_["output"], out.detach()),
            ("weight gradient", conv.weight.grad, grad),
        ):
            error = relative_error(got, ref)
            if error > worst.worst:
                worst = KernelError(error, f"{name} {what}")
    return worst
