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

The fp32 op registry (``--fp32-ops``, default sigmoid and softmax): with apex each op is
registered with ``amp.register_float_function`` before ``amp.initialize``; natively the loss,
metrics and prediction call them through :func:`sigmoid` / :func:`softmax`, which leave autocast
and compute in float32.
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Any

import torch

from app.config import Config, ConfigError

FP16_MIN_EPS = 1e-4  # smallest optimizer eps that stays well inside float16's normal range
HALF_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
_fp32_ops: frozenset[str] = frozenset({"sigmoid", "softmax"})


# ----------------------------------------------------------------------------- fp32 op registry
def configure_fp32_ops(names: list[str]) -> None:
    unknown = [n for n in names if not callable(getattr(torch, n, None))]
    if unknown:
        raise ConfigError(f"--fp32-ops: {unknown} are not torch functions (e.g. sigmoid softmax)")
    global _fp32_ops
    _fp32_ops = frozenset(names)


def call_op(name: str, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """``torch.<name>(x, ...)``, in float32 outside autocast when ``name`` is registered."""
    fn = getattr(torch, name)
    if name not in _fp32_ops:
        return fn(x, *args, **kwargs)
    with torch.autocast(x.device.type, enabled=False):
        return fn(x.float(), *args, **kwargs)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return call_op("sigmoid", x)


def softmax(x: torch.Tensor, dim: int) -> torch.Tensor:
    return call_op("softmax", x, dim=dim)


# ----------------------------------------------------------------------------- backends
class NativePrecision:
    """torch.amp: an autocast context and a GradScaler that is enabled for fp16 O1 only."""

    backend = "native"

    def __init__(self, opt_level: str, dtype: torch.dtype, device_type: str):
        self.opt_level, self.dtype, self.device_type = opt_level, dtype, device_type
        self.scaler = torch.amp.GradScaler(
            device_type, enabled=opt_level == "O1" and dtype == torch.float16
        )

    @property
    def dtype_name(self) -> str:
        return "float32" if self.opt_level == "O0" else str(self.dtype).removeprefix("torch.")

    def describe(self) -> str:
        scaler = "dynamic GradScaler" if self.scaler.is_enabled() else "no loss scaling"
        mode = {"O0": "fp32", "O1": "autocast", "O3": "pure half model"}[self.opt_level]
        return f"native {self.opt_level} ({mode}, {self.dtype_name}, {scaler})"

    def autocast(self) -> contextlib.AbstractContextManager:
        return torch.autocast(self.device_type, dtype=self.dtype, enabled=self.opt_level == "O1")

    def initialize(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        if self.opt_level == "O3":
            model.to(self.dtype)
            model.register_forward_pre_hook(_cast_inputs_hook(self.dtype))
            if self.dtype == torch.float16 and optimizer is not None:
                # Adam's state lives in the parameters' dtype: an eps of 1e-8 is 0 in float16,
                # and an underflowed second moment then divides by zero after the first step
                for group in optimizer.param_groups:
                    if "eps" in group:
                        group["eps"] = max(group["eps"], FP16_MIN_EPS)
        return model, optimizer

    def backward(self, loss: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
        self.scaler.scale(loss).backward()

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        self.scaler.step(optimizer)
        self.scaler.update()

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

    def __init__(self, opt_level: str, fp32_op_names: list[str]):
        self.opt_level = opt_level
        self.fp32_op_names = list(fp32_op_names)
        self.amp = import_apex("apex.amp")

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
        return self.amp.initialize(model, optimizer, opt_level=self.opt_level, verbosity=0)

    def backward(self, loss: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
        with self.amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()

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
    if cfg.amp_dtype == "auto":
        return torch.float16 if device_type == "cuda" else torch.bfloat16
    return HALF_DTYPES[cfg.amp_dtype]


def build_precision(cfg: Config, device: torch.device) -> Precision:
    """Validate the precision flags for this device and build the backend object."""
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
        return ApexPrecision(cfg.opt_level, cfg.fp32_ops)
    if cfg.opt_level == "O2":
        raise ConfigError(
            "--opt-level O2 (fp16 model with fp32 master weights) is not offered by "
            "--amp-backend native; use --opt-level O1 (autocast) or --amp-backend apex"
        )
    dtype = resolve_dtype(cfg, device.type)
    if dtype == torch.bfloat16 and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError("--amp-dtype bfloat16: this GPU does not support bfloat16; use float16")
    return NativePrecision(cfg.opt_level, dtype, device.type)
