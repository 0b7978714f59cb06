"""Mixed precision behind one interface: native ``torch.amp`` or legacy NVIDIA apex.

The flags are resolved once, by :func:`build_precision`, into an object with
``autocast() / initialize() / backward() / step() / state_dict() / load_state_dict()``; the
training loop calls those and never asks which backend it has.

=========  ============================================  =========================================
opt level  native (torch.amp)                            apex (apex.amp, tags <= 25.05 only)
=========  ============================================  =========================================
O0         fp32                                          fp32
O1         autocast: fp16 + dynamic GradScaler,          patched functions, dynamic loss scale
           or bf16 without a scaler
O2         not offered: a clear error                    fp16 model, fp32 BN and master weights
O3         pure half model, no scaling (speed baseline)  pure fp16
=========  ============================================  =========================================

The fp32 op registry (``--fp32-ops``, default sigmoid and softmax, ``app.precision.ops``): with apex
each op is registered with ``amp.register_float_function`` before ``amp.initialize``; natively
the loss, metrics and prediction call them through ``sigmoid`` / ``softmax``, which leave
autocast and compute in float32.

Non-finite steps: ``step()`` returns a flag on the device, 1 when the step's gradients held NaN
or Inf and the step was skipped (:class:`NonFiniteGuard`), so such a step never reaches the
weights, the optimizer state or the BatchNorm statistics, and the loop counts skipped steps
without a host sync. ``--opt-level auto`` and ``--amp-dtype auto`` are decided by
``app.precision.auto`` before this module builds anything.
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Any

import torch

from app.config import Config, ConfigError
from app.precision import ops as fp32_ops
from app.precision.ops import call_op, sigmoid, softmax  # noqa: F401  (the registry's ops, here too)

FP16_MIN_EPS = 1e-4  # smallest optimizer eps that stays well inside float16's normal range
HALF_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


# ----------------------------------------------------------------------------- fp32 op registry
def configure_fp32_ops(names: list[str]) -> None:
    """``app.precision.ops.configure_fp32_ops``, its error a configuration error."""
    try:
        fp32_ops.configure_fp32_ops(names)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc


# ----------------------------------------------------------------------------- non-finite steps
class NonFiniteGuard:
    """Skips optimizer steps whose gradients are not finite, without a host sync.

    ``check`` runs GradScaler's own test (``torch._amp_foreach_non_finite_check_and_unscale_``
    with a scale of 1) over the gradients and leaves a 0/1 flag on the device. A fused Adam takes
    that flag as ``found_inf`` and, when it is 1, leaves parameters, moments and step count as they
    were; any other optimizer costs one host sync per step to skip. Under DDP the gradients are
    all-reduced before the test, so every rank reaches the same verdict with no collective of its
    own. BatchNorm running statistics, which the skipped step's forward already updated, go back to
    a snapshot that a forward pre-hook takes in training mode.
    """

    def __init__(self, model: torch.nn.Module):
        self.buffers = [b for b in model.buffers() if b.numel()]
        self.saved = [b.detach().clone() for b in self.buffers]
        model.register_forward_pre_hook(self._snapshot)

    def _snapshot(self, module: torch.nn.Module, args: tuple) -> None:
        if module.training and torch.is_grad_enabled() and self.buffers:
            torch._foreach_copy_(self.saved, self.buffers)

    @staticmethod
    def check(optimizer: torch.optim.Optimizer) -> torch.Tensor:
        """A 0-dim float tensor (GradScaler's ``found_inf``): 1 if a gradient holds NaN or Inf."""
        grads: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    grads.setdefault((p.grad.device, p.grad.dtype), []).append(p.grad)
        device = next(iter(grads))[0] if grads else torch.device("cpu")
        found = torch.zeros((), device=device)
        for (grad_device, _), tensors in grads.items():
            found_here = torch.zeros((), device=grad_device)
            one = torch.ones((), device=grad_device)
            torch._amp_foreach_non_finite_check_and_unscale_(tensors, found_here, one)
            found += found_here.to(device)
        return found.clamp_(max=1)

    @staticmethod
    def step(optimizer: torch.optim.Optimizer, found: torch.Tensor) -> None:
        """``optimizer.step()`` unless ``found``; on the device when the optimizer allows it."""
        if getattr(optimizer, "_step_supports_amp_scaling", False):  # fused Adam
            optimizer.grad_scale, optimizer.found_inf = None, found
            optimizer.step()
        elif not found.item():
            optimizer.step()

    def restore_buffers(self, found: torch.Tensor) -> None:
        """Put back the statistics that a skipped step's forward changed (none if not found)."""
        skip = found.bool()
        for buffer, saved in zip(self.buffers, self.saved):
            buffer.copy_(torch.where(skip, saved, buffer))


def clip_gradients(params, max_norm: float) -> None:
    """Scale the gradients down to a global L2 norm of ``max_norm`` when it is above (0: off).

    On the device, no host sync: a non-finite norm turns the gradients non-finite, and the step
    is skipped as any non-finite step is. Under DDP the gradients are already all-reduced, so
    every rank scales by the same factor.
    """
    if max_norm > 0:
        grads = [p for p in params if p.grad is not None]
        torch.nn.utils.clip_grad_norm_(grads, max_norm, foreach=True)


def optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


NOT_INITIALIZED = "precision.step() before precision.initialize(model, optimizer)"


# ----------------------------------------------------------------------------- backends
class NativePrecision:
    """torch.amp: an autocast context and a GradScaler that is enabled for fp16 O1 only.
    ``grad_clip``: the gradients' largest global norm (0: unclipped), applied after unscaling."""

    backend = "native"

    def __init__(
        self, opt_level: str, dtype: torch.dtype, device_type: str, grad_clip: float = 0.0
    ):
        self.opt_level, self.dtype, self.device_type = opt_level, dtype, device_type
        self.grad_clip = grad_clip
        self.scaler = torch.amp.GradScaler(
            device_type, enabled=opt_level == "O1" and dtype == torch.float16
        )
        self.guard: NonFiniteGuard | None = None

    @property
    def dtype_name(self) -> str:
        return "float32" if self.opt_level == "O0" else str(self.dtype).removeprefix("torch.")

    def describe(self) -> str:
        scaler = "dynamic GradScaler" if self.scaler.is_enabled() else "no loss scaling"
        mode = {"O0": "fp32", "O1": "autocast", "O3": "pure half model"}[self.opt_level]
        return f"native {self.opt_level} ({mode}, {self.dtype_name}, {scaler})"

    def autocast(self) -> contextlib.AbstractContextManager:
        return torch.autocast(self.device_type, dtype=self.dtype, enabled=self.opt_level == "O1")

    def initialize(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None):
        """Cast for O3 and arm the non-finite guard (training only: ``optimizer`` is given)."""
        if self.opt_level == "O3":
            model.to(self.dtype)
            model.register_forward_pre_hook(_cast_inputs_hook(self.dtype))
            if self.dtype == torch.float16 and optimizer is not None:
                # Adam's state lives in the parameters' dtype: an eps of 1e-8 is 0 in float16,
                # and an underflowed second moment then divides by zero after the first step
                for group in optimizer.param_groups:
                    if "eps" in group:
                        group["eps"] = max(group["eps"], FP16_MIN_EPS)
        if optimizer is not None:
            self.guard = NonFiniteGuard(model)
        return model, optimizer

    def backward(self, loss: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
        self.scaler.scale(loss).backward()

    def step(self, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        """One optimizer step unless a gradient is NaN/Inf; returns that flag as a 0-dim float
        tensor on the device (1: skipped)."""
        if self.guard is None:
            raise RuntimeError(NOT_INITIALIZED)
        found = self.guard.check(optimizer)  # scaled gradients: Inf there is Inf unscaled too
        if self.grad_clip:
            if self.scaler.is_enabled():
                self.scaler.unscale_(optimizer)  # clip the true gradients; step() won't rescale
            clip_gradients(optimizer_params(optimizer), self.grad_clip)
        if self.scaler.is_enabled():
            self.scaler.step(optimizer)  # skips the same steps, and lowers the scale
            self.scaler.update()
        else:
            self.guard.step(optimizer, found)
        self.guard.restore_buffers(found)
        return found

    def state_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "opt_level": self.opt_level,
            "dtype": self.dtype_name,
            "scaler": self.scaler.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_same_precision(state, self.state_dict())
        if state["scaler"]:
            self.scaler.load_state_dict(state["scaler"])


class ApexPrecision:
    """apex.amp (tags <= 25.05): patched functions, ``amp.scale_loss``, ``amp.state_dict``."""

    backend = "apex"
    dtype = torch.float16
    device_type = "cuda"

    def __init__(self, opt_level: str, fp32_op_names: list[str], grad_clip: float = 0.0):
        self.opt_level = opt_level
        self.grad_clip = grad_clip
        self.fp32_op_names = list(fp32_op_names)
        self.amp = import_apex("apex.amp")
        self.guard: NonFiniteGuard | None = None

    @property
    def dtype_name(self) -> str:
        return "float32" if self.opt_level == "O0" else "float16"

    def describe(self) -> str:
        return f"apex {self.opt_level} ({self.dtype_name}, fp32 ops: {self.fp32_op_names})"

    def autocast(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()  # apex patched the functions in initialize()

    def initialize(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        for name in self.fp32_op_names:  # must precede amp.initialize
            self.amp.register_float_function(torch, name)
        model, optimizer = self.amp.initialize(
            model, optimizer, opt_level=self.opt_level, verbosity=0
        )
        if optimizer is not None:
            self.guard = NonFiniteGuard(model)
        return model, optimizer

    def backward(self, loss: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
        with self.amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()

    def step(self, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        """O1/O2: apex's dynamic loss scale skips overflowing steps inside ``optimizer.step``
        (which must be called: apex patched it for one call); O0/O3 have no dynamic scale, so
        the guard skips them, with a host sync, as apex itself syncs every step."""
        if self.guard is None:
            raise RuntimeError(NOT_INITIALIZED)
        found = self.guard.check(optimizer)
        if self.grad_clip:  # apex unscaled them when scale_loss exited; O2: fp32 master copies
            clip_gradients(list(self.amp.master_params(optimizer)), self.grad_clip)
        if self.opt_level in ("O1", "O2"):
            optimizer.step()
        else:
            NonFiniteGuard.step(optimizer, found)
        self.guard.restore_buffers(found)
        return found

    def state_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "opt_level": self.opt_level,
            "dtype": self.dtype_name,
            "amp": dict(self.amp.state_dict()),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Call after :meth:`initialize`, as apex requires."""
        check_same_precision(state, self.state_dict())
        self.amp.load_state_dict(state["amp"])


Precision = NativePrecision | ApexPrecision


def _cast_inputs_hook(dtype: torch.dtype):
    def hook(module: torch.nn.Module, args: tuple) -> tuple:
        return tuple(
            a.to(dtype) if torch.is_tensor(a) and a.is_floating_point() else a for a in args
        )

    return hook


def check_same_precision(saved: dict[str, Any], current: dict[str, Any]) -> None:
    keys = ("backend", "opt_level", "dtype")
    if any(saved.get(k) != current[k] for k in keys):
        was = " ".join(str(saved.get(k)) for k in keys)
        now = " ".join(str(current[k]) for k in keys)
        raise ConfigError(
            f"the checkpoint was trained with mixed precision '{was}' but this run asks for "
            f"'{now}'; resume with --amp-backend {saved.get('backend')} --opt-level "
            f"{saved.get('opt_level')} (and the same --amp-dtype), or start a new run dir"
        )


APEX_HELP = (
    "NVIDIA apex is not on PyPI (the PyPI package named 'apex' is unrelated), and apex removed "
    "apex.amp and apex.parallel in its 25.07 tag; 25.05 is the last tag that has them. Use the "
    "apex image (docker/Dockerfile.apex) or --amp-backend native."
)


def import_apex(module: str):
    """Import an apex module only when the apex backend is chosen, with a useful error."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError(
            f"--amp-backend apex: cannot import {module} ({exc}). {APEX_HELP}"
        ) from exc


def resolve_dtype(cfg: Config, device_type: str) -> torch.dtype:
    """The half dtype; ``auto`` reaching here (a checkpoint from before ``app.precision.auto``, or a
    dtype an O0 run never uses) means what it meant then: float16 on CUDA, bfloat16 on CPU."""
    if cfg.amp_dtype == "auto":
        return torch.float16 if device_type == "cuda" else torch.bfloat16
    return HALF_DTYPES[cfg.amp_dtype]


def build_precision(cfg: Config, device: torch.device) -> Precision:
    """Validate the precision flags for this device and build the backend object.

    ``--opt-level auto`` must have been resolved (``app.precision.auto.decide``)."""
    if cfg.opt_level == "auto":
        raise ValueError("--opt-level auto must be resolved first, by app.precision.auto.decide")
    configure_fp32_ops(cfg.fp32_ops)
    if cfg.amp_backend == "apex":
        if device.type != "cuda":
            raise ConfigError(
                "--amp-backend apex needs CUDA; on CPU use --amp-backend native "
                "(bf16 autocast with --opt-level O1)"
            )
        if cfg.amp_dtype != "auto" and cfg.amp_dtype != "float16":
            raise ConfigError(
                f"--amp-dtype {cfg.amp_dtype} is for --amp-backend native only; "
                "apex computes in float16"
            )
        return ApexPrecision(cfg.opt_level, cfg.fp32_ops, cfg.grad_clip)
    if cfg.opt_level == "O2":
        raise ConfigError(
            "--opt-level O2 (fp16 model with fp32 master weights) is not offered by "
            "--amp-backend native; use --opt-level O1 (autocast) or --amp-backend apex"
        )
    dtype = resolve_dtype(cfg, device.type)
    if dtype == torch.bfloat16 and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError("--amp-dtype bfloat16: this GPU does not support bfloat16; use float16")
    return NativePrecision(cfg.opt_level, dtype, device.type, cfg.grad_clip)
