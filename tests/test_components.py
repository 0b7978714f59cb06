"""Model, loss, metrics, the precision backends and the order inside prepare()."""

import copy
import sys

import apex_recording_standin
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from app.config import Config, ConfigError
from app.distributed import DistEnv, prepare
from app.losses import BCEDiceLoss
from app.metrics import confusion_counts, dice_iou
from app.model import UNet3d
from app.precision import amp as amp_ops
from app.precision.amp import ApexPrecision, NativePrecision, build_precision

CPU = torch.device("cpu")


@pytest.mark.parametrize("shape", [(16, 32, 32), (74, 20, 24), (9, 17, 23)])
def test_unet_returns_the_input_shape(shape):
    model = UNet3d(f_maps=2, depth=4)
    assert model(torch.randn(1, 1, *shape)).shape == (1, 1, *shape)


def test_unet_rejects_too_small_inputs():
    with pytest.raises(ValueError, match="smaller than 8 voxels"):
        UNet3d(f_maps=2, depth=4)(torch.randn(1, 1, 4, 16, 16))


def test_unet_uses_batchnorm_for_syncbn_to_convert():
    model = UNet3d(f_maps=2, depth=3)
    assert any(isinstance(m, nn.BatchNorm3d) for m in model.modules())
    synced = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    assert not any(type(m) is nn.BatchNorm3d for m in synced.modules())


def test_bce_dice_formula():
    logits = torch.randn(2, 1, 4, 5, 6)
    target = (torch.rand(2, 1, 4, 5, 6) > 0.5).float()
    p = torch.sigmoid(logits).flatten(1)
    g = target.flatten(1)
    dice = (2 * (p * g).sum(1) + 1) / (p.sum(1) + g.sum(1) + 1)
    expected = F.binary_cross_entropy_with_logits(logits, target) * 0.3 + 0.7 * (1 - dice.mean())
    assert torch.allclose(BCEDiceLoss(0.3, 0.7)(logits, target), expected, atol=1e-6)


def test_batch_dice_is_one_dice_over_the_batch():
    torch.manual_seed(0)
    logits = torch.randn(2, 1, 4, 5, 6).to(memory_format=torch.channels_last_3d)
    target = torch.zeros(2, 1, 4, 5, 6)
    target[0, :, :2] = 1  # half the first patch; one voxel of the second
    target[1, 0, 0, 0, 0] = 1
    p, g = torch.sigmoid(logits), target
    dice = (2 * (p * g).sum() + 1) / (p.sum() + g.sum() + 1)
    expected = F.binary_cross_entropy_with_logits(logits, target) + 1 - dice
    got = BCEDiceLoss(batch_dice=True)(logits, target)
    assert torch.allclose(got, expected, atol=1e-6)
    # per patch, the one-voxel patch weighs as much as the half-full one: a different loss
    assert not torch.allclose(BCEDiceLoss()(logits, target), got, atol=1e-3)


def test_loss_of_a_perfect_empty_prediction_is_small():
    logits = torch.full((1, 1, 4, 4, 4), -20.0)
    assert BCEDiceLoss()(logits, torch.zeros_like(logits)) < 1e-6


def test_fp32_ops_under_cpu_bf16_autocast():
    x = torch.randn(2, 3, 8, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert amp_ops.sigmoid(x).dtype == torch.float32
        assert amp_ops.softmax(x, dim=1).dtype == torch.float32
        # without the registry the same call stays in bf16 under autocast
        assert torch.sigmoid(x).dtype == torch.bfloat16


def test_loss_under_autocast_is_computed_in_fp32():
    """Same logits: the loss inside bf16 autocast equals the fp32 loss to 1e-6."""
    logits = torch.randn(2, 1, 8, 8, 8)
    target = (torch.rand_like(logits) > 0.6).float()
    reference = BCEDiceLoss()(logits, target)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = BCEDiceLoss()(logits, target)
    assert mixed.dtype == torch.float32
    assert torch.allclose(mixed, reference, atol=1e-6)


def test_model_loss_under_autocast_close_to_fp32():
    """End to end, bf16 convolutions: the loss stays within 2e-2 of the fp32 loss."""
    torch.manual_seed(0)
    model = UNet3d(f_maps=4, depth=3).eval()
    x = torch.randn(1, 1, 8, 16, 16)
    target = (x > 0).float()
    reference = BCEDiceLoss()(model(x), target)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = BCEDiceLoss()(model(x), target)
    assert abs(mixed.item() - reference.item()) < 2e-2


def test_unknown_fp32_op_is_refused():
    with pytest.raises(ConfigError, match="--fp32-ops"):
        amp_ops.configure_fp32_ops(["sigmoid", "not_an_op"])


def test_metrics_from_counts():
    logits = torch.tensor([5.0, 5.0, -5.0, -5.0, 5.0])
    target = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0])
    counts = confusion_counts(logits, target)
    assert counts.tolist() == [2, 1, 1]
    dice, iou = dice_iou(counts)
    assert dice.item() == pytest.approx(4 / 6) and iou.item() == pytest.approx(2 / 4)


def test_empty_prediction_and_label_score_one():
    dice, iou = dice_iou(torch.zeros(3, dtype=torch.float64))
    assert dice.item() == 1.0 and iou.item() == 1.0
    dice, iou = dice_iou(torch.tensor([0.0, 0.0, 5.0], dtype=torch.float64))
    assert dice.item() == 0.0 and iou.item() == 0.0


# ----------------------------------------------------------------------------- precision
def cfg(**kwargs):
    """A config at O1, the level these tests are about (``auto`` is resolved before here)."""
    return Config(**{"opt_level": "O1", **kwargs})


def test_auto_must_be_resolved_before_building_a_precision():
    with pytest.raises(ValueError, match=r"app\.precision\.auto"):
        build_precision(Config(), CPU)


def test_native_defaults_per_device():
    cpu = build_precision(cfg(), CPU)
    assert isinstance(cpu, NativePrecision) and cpu.dtype == torch.bfloat16
    assert not cpu.scaler.is_enabled()
    fp16 = build_precision(cfg(amp_dtype="float16"), CPU)
    assert fp16.scaler.is_enabled()
    assert not build_precision(cfg(opt_level="O0"), CPU).scaler.is_enabled()


@pytest.mark.parametrize(
    ("settings", "device", "message"),
    [
        ({"opt_level": "O2"}, CPU, "--opt-level O2 .* not offered by --amp-backend native"),
        ({"amp_backend": "apex"}, CPU, "--amp-backend apex needs CUDA"),
        (
            {"amp_backend": "apex", "amp_dtype": "bfloat16"},
            torch.device("cuda", 0),
            "--amp-dtype bfloat16 is for --amp-backend native only",
        ),
    ],
)
def test_unsupported_combinations_fail_early(settings, device, message):
    with pytest.raises(ConfigError, match=message):
        build_precision(cfg(**settings), device)


def test_missing_apex_says_how_to_get_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "apex", None)  # makes `import apex` fail
    monkeypatch.setitem(sys.modules, "apex.amp", None)
    with pytest.raises(ConfigError) as err:
        build_precision(cfg(amp_backend="apex"), torch.device("cuda", 0))
    text = str(err.value)
    assert "cannot import apex.amp" in text and "not on PyPI" in text and "25.05" in text
    assert "docker/Dockerfile.apex" in text


def test_apex_is_imported_only_when_chosen():
    code = (
        "import sys; from app.config import Config; from app.precision.amp import "
        "build_precision; import torch; "
        "build_precision(Config(opt_level='O1'), torch.device('cpu')); "
        "import app.train; assert not any(m.startswith('apex') for m in sys.modules)"
    )
    import subprocess

    subprocess.run([sys.executable, "-c", code], check=True)


def test_o3_runs_a_pure_half_model():
    model = UNet3d(f_maps=2, depth=3)
    optimizer = torch.optim.Adam(model.parameters())
    half = build_precision(cfg(opt_level="O3"), CPU)
    model, optimizer = half.initialize(model, optimizer)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    out = model(torch.randn(1, 1, 8, 16, 16))  # float32 input is cast by the forward hook
    loss = BCEDiceLoss()(out, torch.zeros_like(out, dtype=torch.float32))
    half.backward(loss, optimizer)
    half.step(optimizer)
    assert torch.isfinite(loss)


def test_precision_state_must_match_on_resume():
    saved = build_precision(cfg(amp_dtype="float16"), CPU).state_dict()
    with pytest.raises(ConfigError, match="trained with mixed precision 'native O1 float16'"):
        build_precision(cfg(), CPU).load_state_dict(saved)
    scaler_state = dict(saved, scaler={**saved["scaler"], "scale": 1024.0})
    restored = build_precision(cfg(amp_dtype="float16"), CPU)
    restored.load_state_dict(scaler_state)
    assert restored.scaler.get_scale() == 1024.0


# ----------------------------------------------------------------------------- prepare()
FAKE_CUDA_ENV = DistEnv(rank=0, local_rank=0, world_size=2, device=torch.device("cuda", 0))


def test_native_prepare_order_syncbn_then_amp_then_ddp(monkeypatch):
    calls = []
    real_convert = nn.SyncBatchNorm.convert_sync_batchnorm

    def convert(module, process_group=None):
        if isinstance(module, UNet3d):  # the classmethod recurses into children through here
            calls.append(("syncbn", type(module).__name__))
        return real_convert(module, process_group)

    def initialize(self, model, optimizer):
        has_syncbn = any(isinstance(m, nn.SyncBatchNorm) for m in model.modules())
        calls.append(("amp", has_syncbn))
        return model, optimizer

    class RecordingDDP(nn.Module):
        def __init__(self, module, device_ids=None):
            super().__init__()
            calls.append(("ddp", type(module).__name__, device_ids))
            self.module = module

    monkeypatch.setattr(nn.SyncBatchNorm, "convert_sync_batchnorm", staticmethod(convert))
    monkeypatch.setattr(NativePrecision, "initialize", initialize)
    monkeypatch.setattr(nn.parallel, "DistributedDataParallel", RecordingDDP)
    model = UNet3d(f_maps=2, depth=3)
    optimizer = torch.optim.Adam(model.parameters())
    wrapped, _ = prepare(
        model, optimizer, NativePrecision("O1", torch.bfloat16, "cuda"), FAKE_CUDA_ENV
    )
    assert calls == [("syncbn", "UNet3d"), ("amp", True), ("ddp", "UNet3d", [0])]
    assert isinstance(wrapped, RecordingDDP)
    assert any(isinstance(m, nn.SyncBatchNorm) for m in wrapped.module.modules())


def test_apex_prepare_order_with_the_recording_standin(monkeypatch):
    calls = apex_recording_standin.install(monkeypatch)
    apex = ApexPrecision("O2", ["sigmoid", "softmax"])
    model = UNet3d(f_maps=2, depth=3)
    optimizer = torch.optim.Adam(model.parameters())
    wrapped, _ = prepare(model, optimizer, apex, FAKE_CUDA_ENV)
    assert calls == [
        ("parallel.convert_syncbn_model", "UNet3d"),
        ("amp.register_float_function", "torch", "sigmoid"),
        ("amp.register_float_function", "torch", "softmax"),
        ("amp.initialize", "UNet3d", "O2", {"verbosity": 0}),
        ("parallel.DistributedDataParallel", "UNet3d", {"delay_allreduce": True}),
    ]
    assert isinstance(wrapped, apex_recording_standin.RecordingDDP)
    # the loop's calls go through amp.scale_loss; state round-trips through amp.state_dict
    loss = torch.tensor(2.0, requires_grad=True)
    apex.backward(loss, optimizer)
    assert calls[-1] == ("amp.scale_loss",) and loss.grad.item() == 65536.0
    state = apex.state_dict()
    assert state["backend"] == "apex" and state["opt_level"] == "O2"
    apex.load_state_dict(state)
    assert calls[-1][0] == "amp.load_state_dict"


def test_single_process_prepare_leaves_the_model_bare():
    model = UNet3d(f_maps=2, depth=3)
    env = DistEnv(rank=0, local_rank=0, world_size=1, device=CPU)
    wrapped, _ = prepare(
        model,
        torch.optim.Adam(model.parameters()),
        NativePrecision("O1", torch.bfloat16, "cpu"),
        env,
    )
    assert wrapped is model


@pytest.mark.parametrize(("opt_level", "dtype"), [("O0", torch.float32), ("O1", torch.float16)])
def test_grad_clip_bounds_the_true_gradient_norm(opt_level, dtype):
    """The clip applies to the unscaled gradients (fp16 O1 unscales first), and the step that
    follows uses them: one SGD step at lr 1 moves the weights by exactly the clipped gradient."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    start = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    precision = NativePrecision(opt_level, dtype, "cpu", grad_clip=0.5)
    if precision.scaler.is_enabled():  # a scale that this loss's fp16 gradients stay finite under
        precision.scaler = torch.amp.GradScaler("cpu", init_scale=16.0)
    model, optimizer = precision.initialize(model, optimizer)
    with precision.autocast():
        loss = 1000 * model(torch.randn(4, 8)).pow(2).mean()  # a gradient norm far above 0.5
    optimizer.zero_grad()
    precision.backward(loss, optimizer)
    assert precision.step(optimizer).item() == 0
    moved = torch.cat([(s - p.detach()).flatten() for s, p in zip(start, model.parameters())])
    assert moved.norm().item() == pytest.approx(0.5, rel=1e-3)
    # below the bound nothing changes
    small = torch.nn.Linear(8, 1)
    grads = [torch.full_like(p, 0.01) for p in small.parameters()]
    for p, g in zip(small.parameters(), grads):
        p.grad = g.clone()
    amp_ops.clip_gradients(list(small.parameters()), 0.5)
    assert all(torch.equal(p.grad, g) for p, g in zip(small.parameters(), grads))


def test_apex_clips_its_master_params_before_the_step(monkeypatch):
    calls = apex_recording_standin.install(monkeypatch)
    model = torch.nn.Linear(8, 1)
    start = [p.detach().clone() for p in model.parameters()]
    apex = ApexPrecision("O1", [], grad_clip=0.5)
    model, optimizer = apex.initialize(model, torch.optim.SGD(model.parameters(), lr=1.0))
    apex.backward(model(torch.randn(4, 8)).pow(2).mean(), optimizer)
    assert apex.step(optimizer).item() == 0
    assert calls[-1] == ("amp.master_params",)
    moved = torch.cat([(s - p.detach()).flatten() for s, p in zip(start, model.parameters())])
    assert moved.norm().item() == pytest.approx(0.5, rel=1e-3)


def test_grad_clip_leaves_a_non_finite_step_skipped():
    model = torch.nn.Linear(4, 1)
    start = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.Adam(model.parameters(), fused=True)
    precision = NativePrecision("O0", torch.float32, "cpu", grad_clip=1.0)
    model, optimizer = precision.initialize(model, optimizer)
    loss = model(torch.tensor([[float("inf"), 1.0, 1.0, 1.0]])).sum()
    optimizer.zero_grad()
    precision.backward(loss, optimizer)
    assert precision.step(optimizer).item() == 1
    assert all(torch.equal(s, p) for s, p in zip(start, model.parameters()))


def test_fp16_o3_keeps_adam_finite():
    torch.manual_seed(0)
    model = UNet3d(f_maps=2, depth=3)
    optimizer = torch.optim.Adam(model.parameters())
    half = NativePrecision("O3", torch.float16, "cpu")
    model, optimizer = half.initialize(model, optimizer)
    assert optimizer.param_groups[0]["eps"] == amp_ops.FP16_MIN_EPS
    for _ in range(3):
        loss = BCEDiceLoss()(model(torch.randn(2, 1, 8, 16, 16)), torch.zeros(2, 1, 8, 16, 16))
        optimizer.zero_grad()
        half.backward(loss, optimizer)
        half.step(optimizer)
        assert torch.isfinite(loss)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_channels_last_model_matches_contiguous_and_takes_plain_inputs():
    from app.model import build_model, resolve_memory_format, use_channels_last

    torch.manual_seed(0)
    model = UNet3d(f_maps=4, depth=3).eval()
    x = torch.randn(2, 1, 9, 17, 23)
    expected = model(x)
    fast = use_channels_last(copy.deepcopy(model))
    assert fast.encoders[0][0].weight.is_contiguous(memory_format=torch.channels_last_3d)
    out = fast(x)  # an ordinary tensor: the pre-hook converts it
    assert out.is_contiguous(memory_format=torch.channels_last_3d)
    assert torch.allclose(out, expected, atol=1e-5)
    assert resolve_memory_format("auto", CPU) == "channels_last"
    assert resolve_memory_format("auto", torch.device("cuda", 0)) == "contiguous"
    assert resolve_memory_format("contiguous", CPU) == "contiguous"
    built = build_model(Config(f_maps=2, depth=3, memory_format="contiguous"), CPU)
    assert built.encoders[0][0].weight.is_contiguous()


@pytest.mark.parametrize("decoupled", [False, True])
def test_weight_decay_modes(decoupled):
    """With no gradient, AdamW's decay shrinks each weight by lr x decay; Adam's L2 decay enters
    the gradient, which Adam normalises into a full step of about lr whatever the decay."""
    from app.engine.steps import build_optimizer

    layer = nn.Linear(4, 4)
    before = layer.weight.detach().clone()
    cfg = Config(lr=1e-2, weight_decay=0.5, decoupled_weight_decay=decoupled)
    optimizer = build_optimizer(layer, cfg, DistEnv(0, 0, 1, torch.device("cpu")), "native")
    for p in layer.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    expected = before * (1 - 1e-2 * 0.5) if decoupled else before - 1e-2 * before.sign()
    torch.testing.assert_close(layer.weight.detach(), expected, rtol=0, atol=1e-6)
