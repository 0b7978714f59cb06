"""The fp32 op registry (``--fp32-ops``, default sigmoid and softmax).

Natively, the loss, the metrics and prediction call these ops through :func:`sigmoid` /
:func:`softmax`, which leave autocast and compute in float32 when the op is registered; with apex
``app.precision.amp`` registers each op with ``amp.register_float_function`` instead. This module
imports nothing of the app, so that the label scheme, the loss and the metrics can use it without
importing the configuration.
"""

from __future__ import annotations

from typing import Any

import torch

_fp32_ops: frozenset[str] = frozenset({"sigmoid", "softmax"})


def configure_fp32_ops(names: list[str]) -> None:
    """Register ``names``; raises ValueError naming those that are not torch functions."""
    unknown = [n for n in names if not callable(getattr(torch, n, None))]
    if unknown:
        raise ValueError(f"--fp32-ops: {unknown} are not torch functions (e.g. sigmoid softmax)")
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
