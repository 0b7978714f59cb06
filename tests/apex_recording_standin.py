"""A RECORDING STAND-IN for NVIDIA apex, for tests only: it is not apex and computes nothing.

apex cannot be installed on CI machines (it is not on PyPI, and ``apex.amp``/``apex.parallel``
exist only in tags <= 25.05, built against CUDA). These modules record the calls the trainer
makes, in order and with their arguments, so the orchestration can be tested; the real apex
path runs in the apex image and in ``bench/gpu_check.sh``.
"""

from __future__ import annotations

import contextlib
import sys
import types

CALLS: list[tuple] = []


class RecordingDDP:
    def __init__(self, module, **kwargs):
        CALLS.append(("parallel.DistributedDataParallel", type(module).__name__, kwargs))
        self.module = module


def install(monkeypatch) -> list[tuple]:
    """Put ``apex``, ``apex.amp`` and ``apex.parallel`` stand-ins in ``sys.modules``."""
    CALLS.clear()
    apex = types.ModuleType("apex")
    amp = types.ModuleType("apex.amp")
    parallel = types.ModuleType("apex.parallel")
    state = {"loss_scaler0": {"loss_scale": 65536.0, "unskipped": 0}}

    def register_float_function(module, name):
        CALLS.append(("amp.register_float_function", module.__name__, name))

    def initialize(model, optimizer, opt_level, **kwargs):
        CALLS.append(("amp.initialize", type(model).__name__, opt_level, kwargs))
        return model, optimizer

    @contextlib.contextmanager
    def scale_loss(loss, optimizer):
        CALLS.append(("amp.scale_loss",))
        yield loss * state["loss_scaler0"]["loss_scale"]

    def state_dict():
        return dict(state)

    def load_state_dict(new_state):
        CALLS.append(("amp.load_state_dict", new_state))
        state.update(new_state)

    def master_params(optimizer):
        CALLS.append(("amp.master_params",))
        for group in optimizer.param_groups:
            yield from group["params"]

    def convert_syncbn_model(model):
        CALLS.append(("parallel.convert_syncbn_model", type(model).__name__))
        return model

    amp.register_float_function = register_float_function
    amp.initialize = initialize
    amp.scale_loss = scale_loss
    amp.state_dict = state_dict
    amp.load_state_dict = load_state_dict
    amp.master_params = master_params
    parallel.convert_syncbn_model = convert_syncbn_model
    parallel.DistributedDataParallel = RecordingDDP
    apex.amp, apex.parallel = amp, parallel
    for name, module in (("apex", apex), ("apex.amp", amp), ("apex.parallel", parallel)):
        monkeypatch.setitem(sys.modules, name, module)
    return CALLS
