"""Thick slices: the plan pools each axis by its voxel spacing (nnU-Net's rule), the U-Net and
app.predict take per-level pooling kernels, and isotropic data keeps the plan it had."""

import dataclasses

import numpy as np
import pytest
import torch
from helpers import train_tiny, write_dataset
from test_plan import CPU, CT, SLABS

from app import predict as predict_cli
from app.config import Config, ConfigError, validate
from app.data.volume_io import VolumeMeta, read_volume, write_volume
from app.model import UNet3d, min_sizes, pool_kernels
from app.plan import MIN_BOTTOM, apply_plan, depth_for, make_plan, pooling_for

THICK = dataclasses.replace(CT, train_shapes=[(24, 96, 96)] * 8, spacing=(0.03, 0.01, 0.01))


def test_isotropic_voxels_keep_the_plan_they_had():
    for data in (SLABS, CT, dataclasses.replace(CT, spacing=(1.5, 1.0, 1.0))):
        assert pooling_for((16, 64, 64), data.spacing) == []
        plan = make_plan(data, CPU, budget_s=300)
        assert "pool_kernels" not in plan.values
        assert plan.values["depth"] == depth_for(tuple(plan.values["patch_size"]))


def test_thick_slices_are_pooled_in_plane_until_the_voxels_are_near_cubic():
    assert pooling_for((16, 64, 64), (3.0, 1.0, 1.0)) == [(1, 2, 2), (2, 2, 2), (2, 2, 2)]
    assert pooling_for((16, 64, 64), (5.0, 1.0, 1.0)) == [(1, 2, 2), (1, 2, 2), (2, 2, 2)]
    # the slice axis is never pooled below MIN_BOTTOM voxels, the others go on
    assert pooling_for((8, 64, 64), (3.0, 1.0, 1.0)) == [(1, 2, 2), (2, 2, 2), (1, 2, 2)]
    for patch, spacing in (((8, 64, 64), (3, 1, 1)), ((24, 40, 200), (1, 4, 1))):
        pools = pooling_for(patch, spacing)
        bottom = [n // m for n, m in zip(patch, min_sizes(pools))]
        assert min(bottom) >= MIN_BOTTOM, (patch, pools)


def test_the_plan_explains_its_anisotropic_pooling():
    plan = make_plan(THICK, CPU, budget_s=300)
    flat = plan.values["pool_kernels"]
    pools = pool_kernels(plan.values["depth"], flat)
    assert pools[0] == (1, 2, 2) and pools == pooling_for(
        tuple(plan.values["patch_size"]), THICK.spacing
    )
    assert "anisotropic voxels (0.03x0.01x0.01)" in plan.reasons["depth"]
    assert "1x2x2" in plan.reasons["pool_kernels"]
    cfg = apply_plan(Config(), set(), plan)
    assert cfg.pool_kernels == flat
    # a depth the user gave keeps the isotropic pooling of that depth
    given = apply_plan(dataclasses.replace(Config(), depth=3), {"depth"}, plan)
    assert given.depth == 3 and given.pool_kernels == []


def test_pool_kernels_are_validated_by_flag():
    with pytest.raises(ConfigError, match=r"--pool-kernels .*3 x \(depth - 1\) = 6"):
        validate(Config(depth=3, pool_kernels=[1, 2, 2]))
    with pytest.raises(ConfigError, match=r"--pool-kernels .*1 or 2"):
        validate(Config(depth=2, pool_kernels=[3, 2, 2]))
    with pytest.raises(ConfigError, match="--patch-size must be at least 2 8 8"):
        validate(Config(depth=4, pool_kernels=[1, 2, 2, 1, 2, 2, 2, 2, 2], patch_size=(2, 4, 64)))
    validate(Config(depth=4, pool_kernels=[1, 2, 2, 1, 2, 2, 2, 2, 2], patch_size=(2, 8, 8)))


def test_the_unet_pools_each_axis_by_its_kernel():
    pools = [(1, 2, 2), (2, 2, 2)]
    model = UNet3d(f_maps=2, depth=3, pools=pools)
    assert model.min_size == (2, 4, 4)
    assert model(torch.randn(1, 1, 3, 9, 13)).shape == (1, 1, 3, 9, 13)
    with pytest.raises(ValueError, match=r"smaller than \(2, 4, 4\) voxels"):
        model(torch.randn(1, 1, 1, 16, 16))
    isotropic = UNet3d(f_maps=2, depth=3)
    assert isotropic.state_dict().keys() == model.state_dict().keys()  # kernels live in the config


@pytest.mark.slow
def test_a_run_with_pool_kernels_checkpoints_and_predicts(tmp_path, capsys):
    data = write_dataset(tmp_path / "data", n_train=2, n_val=1)
    run = train_tiny(
        data, tmp_path / "run", "--pool-kernels", "1", "2", "2", "2", "2", "2", epochs=1
    )
    state = torch.load(run / "checkpoints/best.pt", weights_only=True)
    assert state["config"]["pool_kernels"] == [1, 2, 2, 2, 2, 2]
    assert tuple(state["model"]["decoders.1.up.weight"].shape[-3:]) == (1, 2, 2)
    image = data / "val_patches/images/vol_00.nii.gz"
    code = predict_cli.main(
        ["--checkpoint", str(run / "checkpoints/best.pt"), "--input", str(image),
         "--output", str(tmp_path / "pred"), "--window", "4", "16", "16"]
    )  # fmt: skip
    assert code == 0, capsys.readouterr().err
    mask, _ = read_volume(tmp_path / "pred/vol_00_mask.nii.gz")
    assert mask.shape == read_volume(image)[0].shape
    code = predict_cli.main(
        ["--checkpoint", str(run / "checkpoints/best.pt"), "--input", str(image),
         "--output", str(tmp_path / "pred2"), "--window", "1", "16", "16"]
    )  # fmt: skip
    assert code == 2 and "at least 2 4 4" in capsys.readouterr().err


def test_old_checkpoints_without_pool_kernels_load_isotropic(tmp_path):
    from test_predict import make_checkpoint

    path = make_checkpoint(tmp_path / "old.pt")
    state = torch.load(path, weights_only=True)
    state["config"].pop("pool_kernels", None)
    torch.save(state, path)
    image = tmp_path / "in.nii.gz"
    write_volume(image, np.zeros((16, 24, 24), np.float32), VolumeMeta(".nii.gz", affine=np.eye(4)))
    out = tmp_path / "out"
    assert (
        predict_cli.main(["--checkpoint", str(path), "--input", str(image), "--output", str(out)])
        == 0
    )
