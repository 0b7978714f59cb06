"""The model that the training step runs, compiled by ``torch.compile`` for one batch size
(``--compile``; whether to compile is ``app.engine.compiling``'s decision)."""

from __future__ import annotations

import torch
from torch import nn

from app.config import Config


class CompiledModel(nn.Module):
    """``model`` compiled for batches of ``batch_size``; other batch sizes run it eager.

    ``.module`` is ``model`` (what ``app.distributed.unwrap`` peels), and the compiled wrapper is
    kept out of the module tree so that ``state_dict`` holds each weight once, under its own key.
    """

    def __init__(self, model: nn.Module, batch_size: int):
        super().__init__()
        self.module = model
        self.batch_size = batch_size
        object.__setattr__(self, "compiled", torch.compile(model, dynamic=False))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if images.shape[0] == self.batch_size:
            return self.compiled(images)
        return self.module(images)


def compile_model(model: nn.Module, cfg: Config) -> nn.Module:
    return CompiledModel(model, cfg.batch_size)
