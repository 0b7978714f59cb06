"""3D U-Net for binary (or multi-class) segmentation of CT volumes."""

from __future__ import annotations

import itertools
import math

import torch
from torch import nn
from torch.nn import functional as F

NORMS = ("batch", "instance", "group", "none")
ACTIVATIONS = ("relu", "leaky_relu")
LEAKY_SLOPE = 0.01  # nnU-Net's
INITS = ("pytorch", "he")
Kernel = tuple[int, int, int]


def pool_kernels(depth: int, flat: list[int] | tuple[int, ...] = ()) -> list[Kernel]:
    """The pooling of axes D H W at each of the ``depth - 1`` levels: ``flat`` (three 1-or-2
    entries per level, as the config stores them), or 2 on every axis when it is empty."""
    if not flat:
        return [(2, 2, 2)] * (depth - 1)
    if len(flat) != 3 * (depth - 1) or any(k not in (1, 2) for k in flat):
        raise ValueError(
            f"pool kernels {list(flat)}: need 3 x (depth - 1) = {3 * (depth - 1)} entries of 1 or 2"
        )
    return [tuple(flat[i : i + 3]) for i in range(0, len(flat), 3)]  # type: ignore[misc]


def min_sizes(kernels: list[Kernel]) -> Kernel:
    """Smallest input per axis: every pooling level needs at least 2 voxels along the axes it
    pools, so an axis needs the product of its kernels."""
    return tuple(math.prod(k[axis] for k in kernels) for axis in range(3))  # type: ignore[return-value]


GROUP_CHANNELS = 8  # channels per GroupNorm group: our narrowest level has 8
BLOCKS = ("plain", "residual")


def norm_layer(norm: str, channels: int) -> nn.Module:
    """The normalisation after each convolution.

    ``batch`` (default) is what SyncBatchNorm converts under DDP; its statistics come from the
    batch, so with 2 patches per process they are noisy and the running averages used at
    validation lag the weights. ``instance`` and ``group`` normalise each sample on its own (the
    same in training and inference, nothing for SyncBN to convert; InstanceNorm is affine, as in
    nnU-Net); but then every feature is rescaled by its own patch's content, so a boundary
    between two tissues moves with the patch's tissue mix. ``none`` (convolutions with a bias)
    has neither problem; with Adam it trains this U-Net's small CPU widths well (README).
    """
    if norm == "batch":
        return nn.BatchNorm3d(channels)
    if norm == "instance":
        return nn.InstanceNorm3d(channels, affine=True)
    if norm == "group":
        return nn.GroupNorm(max(1, channels // GROUP_CHANNELS), channels)
    if norm == "none":
        return nn.Identity()
    raise ValueError(f"unknown norm {norm!r}; choose one of {', '.join(NORMS)}")


class _ReLUFromItsOutput(torch.autograd.Function):
    """ReLU whose backward multiplies by ``sign(output)`` (1 where it fired, else 0): the same
    gradient as ``threshold_backward``, with no boolean mask in the graph."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        out = x.clamp_min(0)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (out,) = ctx.saved_tensors
        return grad * out.sign()


class ReLU(nn.ReLU):
    """``nn.ReLU`` (same module, no state), except when ``torch.compile`` traces it on a CPU.

    There, inductor saves ReLU's backward mask as a bool tensor, and its CPU code converts each
    vector of comparisons to bools through a generic, element-wise path: in torch 2.13 on Zen 4
    a compiled ``x <= 0`` over 1M bf16 voxels took 8.6 ms against 1.2 ms eager, and one such
    kernel was 17 ms of the real-data plan's 115 ms compiled step. :class:`_ReLUFromItsOutput`
    gives the partitioner only bf16/fp32 tensors to save (bench/README "ReLU under compile").
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling() and x.device.type == "cpu":
            return _ReLUFromItsOutput.apply(x)
        return super().forward(x)


def initialise(model: nn.Module, init: str) -> nn.Module:
    """``pytorch`` leaves every layer's default: Kaiming uniform with a=sqrt(5), a variance of
    1/(3 fan_in), which with no norm layer shrinks the signal's second moment about sixfold per
    convolution and ReLU, until the random biases decide which units fire (the plan's U-Net at
    initialisation: logits with a std of 0.014). ``he`` is nnU-Net's InitWeights_He: Kaiming
    normal for a leaky ReLU of slope 0.01 and zero biases, so the signal keeps its scale."""
    if init == "pytorch":
        return model
    if init != "he":
        raise ValueError(f"unknown init {init!r}; choose one of {', '.join(INITS)}")
    for module in model.modules():
        if isinstance(module, nn.Conv3d | nn.ConvTranspose3d):
            nn.init.kaiming_normal_(module.weight, a=LEAKY_SLOPE)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
    return model


def activation_layer(activation: str) -> nn.Module:
    """The nonlinearity after each norm. ``leaky_relu`` (nnU-Net's) keeps a small gradient for
    negative inputs: with no norm layer to re-centre them, a ReLU unit whose inputs all turn
    negative gets no gradient again and stays dead (on the MNI152 slabs 36-58% of the channels
    of the plan's U-Net never fired on the training slabs in the best checkpoints of 15-minute
    runs at Adam 3e-3, 13% at initialisation)."""
    if activation == "relu":
        return ReLU(inplace=True)
    if activation == "leaky_relu":
        return nn.LeakyReLU(LEAKY_SLOPE, inplace=True)
    raise ValueError(f"unknown activation {activation!r}; choose one of {', '.join(ACTIVATIONS)}")


class DoubleConv(nn.Sequential):
    """(Conv3d 3x3x3 -> norm -> activation) twice; ``stem``: no norm after the first
    convolution."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        norm: str = "batch",
        stem: bool = False,
        activation: str = "relu",
    ):
        super().__init__(
            nn.Conv3d(in_channels, out_channels, 3, padding=1, bias=stem or norm == "none"),
            nn.Identity() if stem else norm_layer(norm, out_channels),
            activation_layer(activation),
            nn.Conv3d(out_channels, out_channels, 3, padding=1, bias=norm == "none"),
            norm_layer(norm, out_channels),
            activation_layer(activation),
        )


class ResidualBlock(nn.Module):
    """DoubleConv's two convolutions as the branch of a residual block: ReLU(branch(x) +
    shortcut(x)), with a 1x1x1 convolution (and norm) as the shortcut where the width changes
    (He et al. 2016). One per encoder level, as in nnU-Net's residual-encoder U-Net: the
    shortcut gives the deeper levels a direct gradient path, the decoder stays plain.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        norm: str = "batch",
        stem: bool = False,
        activation: str = "relu",
    ):
        super().__init__()
        # DoubleConv without its last activation, which comes after the sum
        double = DoubleConv(in_channels, out_channels, norm, stem, activation)
        self.branch = nn.Sequential(*list(double)[:-1])
        self.shortcut = (
            nn.Identity()
            if in_channels == out_channels
            else nn.Sequential(
                nn.Conv3d(in_channels, out_channels, 1, bias=stem or norm == "none"),
                nn.Identity() if stem else norm_layer(norm, out_channels),
            )
        )
        self.act = activation_layer(activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.branch(x) + self.shortcut(x))


def encoder_block(block: str):
    """The encoder level's module class for ``--block``."""
    if block == "plain":
        return DoubleConv
    if block == "residual":
        return ResidualBlock
    raise ValueError(f"unknown block {block!r}; choose one of {', '.join(BLOCKS)}")


class Up(nn.Module):
    """Transposed-conv upsampling to the skip connection's exact size, concat, DoubleConv.

    ``output_size`` resolves the odd sizes that floor pooling leaves (74 -> 37 -> 18 -> 37 -> 74),
    so any input size works without padding or cropping.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        norm: str = "batch",
        kernel: Kernel = (2, 2, 2),
        activation: str = "relu",
    ):
        super().__init__()
        self.up = nn.ConvTranspose3d(in_channels, out_channels, kernel_size=kernel, stride=kernel)
        self.conv = DoubleConv(2 * out_channels, out_channels, norm, activation=activation)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        x = self.up(x, output_size=skip.shape[-3:])
        return self.conv(torch.cat([skip, x], dim=1))


class UNet3d(nn.Module):
    """Encoder of ``depth`` levels (``f_maps * 2**i`` channels; ``block`` plain or residual),
    decoder with skip connections. ``pools``: each level's pooling of axes D H W (default 2 on
    every axis; an axis of thick slices is left unpooled at the first levels, as nnU-Net does,
    so that the bottleneck sees a roughly isotropic field).

    Returns logits with the input's spatial shape; the sigmoid lives in the loss, metrics and
    prediction, where it is computed in float32.
    """

    def __init__(
        self,
        n_channels: int = 1,
        n_classes: int = 1,
        f_maps: int = 32,
        depth: int = 4,
        norm: str = "batch",
        block: str = "plain",
        pools: list[Kernel] | None = None,
        activation: str = "relu",
        init: str = "pytorch",
    ):
        super().__init__()
        encoder = encoder_block(block)
        activation_layer(activation)  # an unknown name fails here, before any layer is built
        if depth < 2:
            raise ValueError(f"depth must be at least 2, got {depth}")
        self.pools = pool_kernels(depth) if pools is None else list(pools)
        if len(self.pools) != depth - 1:
            raise ValueError(f"{len(self.pools)} pool kernels for depth {depth}")
        self._min_size = min_sizes(self.pools)
        widths = [f_maps * 2**i for i in range(depth)]
        # With a per-sample norm (instance, group) the first convolution (with a bias) feeds its
        # ReLU directly: normalising there would rescale the raw intensities by each patch's own
        # statistics, and an intensity would no longer mean one tissue. Measured on MNI152 slabs
        # (bench/real_data.py, README "Quality on real data"): val Dice 0.876 against 0.836
        # after 110 s of training. BatchNorm keeps it: at inference its running statistics are
        # one affine map for every volume.
        stem = norm != "batch"
        self.encoders = nn.ModuleList([encoder(n_channels, widths[0], norm, stem, activation)])
        self.encoders.extend(
            encoder(a, b, norm, activation=activation) for a, b in itertools.pairwise(widths)
        )
        self.decoders = nn.ModuleList(
            Up(a, b, norm, k, activation)
            for a, b, k in zip(widths[::-1], widths[-2::-1], reversed(self.pools))
        )
        self.head = nn.Conv3d(widths[0], n_classes, kernel_size=1)
        initialise(self, init)

    @property
    def min_size(self) -> Kernel:
        """Smallest spatial size per axis (see :func:`min_sizes`)."""
        return self._min_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        need = self.min_size
        # a list, not a generator: torch.compile traces this whole forward only without one
        if any([s < m for s, m in zip(x.shape[-3:], need)]):
            least = need[0] if len(set(need)) == 1 else need
            raise ValueError(
                f"input {tuple(x.shape[-3:])} is smaller than {least} voxels on an axis; "
                f"this depth and pooling need at least {least}"
            )
        skips = []
        for i, encoder in enumerate(self.encoders):
            x = encoder(x if i == 0 else F.max_pool3d(x, self.pools[i - 1]))
            skips.append(x)
        for decoder, skip in zip(self.decoders, reversed(skips[:-1])):
            x = decoder(x, skip)
        return self.head(x)


def use_channels_last(model: nn.Module, restride_gradients: bool = True) -> nn.Module:
    """Keep weights and activations in ``channels_last_3d`` (NDHWC) memory format.

    Inputs are converted by a forward pre-hook, so callers pass ordinary tensors. Whether it is
    faster depends on the device and precision: ``--memory-format auto`` measures it.
    ``restride_gradients=False`` leaves out the fix for DDP's stride warning (its benchmark,
    ``bench/ddp_strides.py``, times both).
    """
    model.to(memory_format=torch.channels_last_3d)
    model.register_forward_pre_hook(_to_channels_last)
    for param in model.parameters() if restride_gradients else ():
        if _layout_is_ambiguous(param):
            param.register_hook(_gradient_like(param))
    return model


def _layout_is_ambiguous(param: torch.Tensor) -> bool:
    """A 5-D tensor that is contiguous in both formats (size-1 channel or spatial axes, as the
    1x1x1 head and a 1-channel first conv have): its strides name one format, its bytes fit both.
    """
    return (
        param.dim() == 5
        and param.is_contiguous()
        and param.is_contiguous(memory_format=torch.channels_last_3d)
    )


def _gradient_like(param: torch.Tensor):
    """Give a gradient the parameter's own strides when only the strides of size-1 axes differ.

    The CPU convolution backward returns such a weight's gradient with contiguous strides. Autograd
    accepts it (strides of size-1 axes do not matter), but DDP's reducer compares strides
    literally and warns "Grad strides do not match bucket view strides" on every run (pytorch
    #47163, #157862). Same bytes, restrided: a view, no copy.
    """
    strides = param.stride()

    def hook(grad: torch.Tensor) -> torch.Tensor:
        if grad.stride() == strides or not _layout_is_ambiguous(grad):
            return grad
        return grad.as_strided(grad.shape, strides)

    return hook


def _to_channels_last(module: nn.Module, args: tuple) -> tuple:
    return tuple(
        a.contiguous(memory_format=torch.channels_last_3d)
        if torch.is_tensor(a) and a.dim() == 5
        else a
        for a in args
    )


def resolve_memory_format(setting: str, device: torch.device) -> str:
    """``auto`` where nothing measured it (prediction, an old checkpoint): channels_last on CPU,
    measured faster on AVX2 and AMX CPUs; contiguous on CUDA. Training measures it instead
    (``app.precision.auto``)."""
    if setting == "auto":
        return "channels_last" if device.type == "cpu" else "contiguous"
    return setting


def build_model(cfg, device: torch.device) -> UNet3d:
    """The configured UNet3d on ``device``, in the configured memory format."""
    pools = pool_kernels(cfg.depth, cfg.pool_kernels)
    model = UNet3d(
        1,
        cfg.labels.head_channels,
        cfg.f_maps,
        cfg.depth,
        cfg.norm,
        cfg.block,
        pools,
        cfg.activation,
        cfg.init,
    )
    model = model.to(device)
    if resolve_memory_format(cfg.memory_format, device) == "channels_last":
        use_channels_last(model)
    return model
