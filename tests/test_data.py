import gzip
import shutil

import numpy as np
import pytest
import torch
from helpers import blob_volume, write_dataset

from app.data.dataset import Augment, DataError, PatchDataset, load_split, normalize
from app.data.volume_io import VolumeMeta, read_volume, write_volume


def replace_file(path, array, ext=".nii.gz"):
    """New voxels on the replaced file's grid (write_dataset's 0.5 mm)."""
    path.unlink()
    write_volume(path, array, VolumeMeta(ext, affine=np.diag([0.5, 0.5, 0.5, 1.0])))


@pytest.mark.parametrize("ext", [".nii.gz", ".nii", ".tif", ".tiff", ".npy"])
def test_every_format_reads_back_as_float32_volumes(tmp_path, ext):
    root = write_dataset(tmp_path / "d", n_train=2, n_val=1, ext=ext)
    volumes = load_split(root, "train", "zscore")
    assert [v.name for v in volumes] == ["vol_00", "vol_01"]
    for vol in volumes:
        assert vol.image.dtype == np.float32 and vol.image.shape == (16, 32, 32)
        assert vol.label.dtype == np.uint8 and set(np.unique(vol.label)) <= {0, 1}
        assert abs(float(vol.image.mean())) < 1e-4 and abs(float(vol.image.std()) - 1) < 1e-3


def test_integer_images_become_float32(tmp_path):
    root = write_dataset(tmp_path / "d", n_train=1, n_val=1)
    image_path = root / "train_patches/images/vol_00.nii.gz"
    replace_file(
        image_path, (np.random.default_rng(0).random((16, 32, 32)) * 4000).astype(np.uint16)
    )
    assert load_split(root, "train", "percentile")[0].image.dtype == np.float32


def expect_error(root, *fragments):
    with pytest.raises(DataError) as err:
        load_split(root, "train", "zscore")
    for fragment in fragments:
        assert fragment in str(err.value)
    return str(err.value)


def test_missing_label_names_the_image(tmp_path):
    root = write_dataset(tmp_path / "d", n_train=2, n_val=1)
    (root / "train_patches/labels/vol_01.nii.gz").unlink()
    expect_error(root, "images/vol_01.nii.gz", "no label named vol_01")


def test_extra_label_names_the_label(tmp_path):
    root = write_dataset(tmp_path / "d", n_train=2, n_val=1)
    (root / "train_patches/images/vol_00.nii.gz").unlink()
    expect_error(root, "labels/vol_00.nii.gz", "label without an image")


def test_shape_mismatch_names_both_files(tmp_path):
    root = write_dataset(tmp_path / "d", n_train=1, n_val=1)
    replace_file(root / "train_patches/labels/vol_00.nii.gz", np.zeros((16, 32, 30), np.uint8))
    expect_error(root, "images/vol_00.nii.gz", "labels/vol_00.nii.gz", "(16, 32, 30)")


def test_empty_and_missing_folders(tmp_path):
    root = write_dataset(tmp_path / "d", n_train=1, n_val=1)
    for f in (root / "train_patches/images").iterdir():
        f.unlink()
    expect_error(root, "train_patches/images", "no volumes")
    shutil.rmtree(root / "train_patches/labels")
    expect_error(root, "train_patches/labels", "missing")
    with pytest.raises(DataError, match="data root is missing"):
        load_split(tmp_path / "nowhere", "train", "zscore")


@pytest.mark.parametrize("ext", [".nii.gz", ".tif", ".npy"])
def test_truncated_file_is_named(tmp_path, ext):
    root = write_dataset(tmp_path / "d", n_train=2, n_val=1, ext=ext)
    path = root / f"train_patches/images/vol_01{ext}"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    expect_error(root, f"vol_01{ext}", "corrupt or truncated")


def test_corrupt_gzip_is_named(tmp_path):
    root = write_dataset(tmp_path / "d", n_train=1, n_val=1)
    path = root / "train_patches/labels/vol_00.nii.gz"
    path.write_bytes(gzip.compress(b"not a nifti file at all" * 20))
    expect_error(root, "labels/vol_00.nii.gz", "cannot read")


def test_non_3d_array_is_named(tmp_path):
    root = write_dataset(tmp_path / "d", n_train=1, n_val=1)
    replace_file(root / "train_patches/images/vol_00.nii.gz", np.zeros((16, 32), np.float32))
    expect_error(root, "images/vol_00.nii.gz", "expected a 3D array", "(16, 32)")


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nan_and_inf_voxels_are_named(tmp_path, bad):
    root = write_dataset(tmp_path / "d", n_train=1, n_val=1)
    image = np.zeros((16, 32, 32), np.float32)
    image[3, 4, 5] = bad
    image[0, 0, 0] = bad
    replace_file(root / "train_patches/images/vol_00.nii.gz", image)
    expect_error(root, "images/vol_00.nii.gz", "2 NaN/Inf voxel(s)")


def test_non_binary_labels_report_values_found(tmp_path):
    root = write_dataset(tmp_path / "d", n_train=1, n_val=1)
    label = np.zeros((16, 32, 32), np.uint8)
    label[0, 0, :3] = [1, 2, 7]
    replace_file(root / "train_patches/labels/vol_00.nii.gz", label)
    expect_error(root, "labels/vol_00.nii.gz", "must be binary", "found 4 values: 0, 1, 2, 7")


@pytest.mark.parametrize(
    "label",
    [np.array([0, 255], np.uint8), np.array([False, True]), np.array([0.0, 1.0], np.float32)],
)
def test_accepted_label_encodings(tmp_path, label):
    root = write_dataset(tmp_path / "d", n_train=1, n_val=1, ext=".npy")
    full = np.resize(label, (16, 32, 32))
    path = root / "train_patches/labels/vol_00.npy"
    np.save(path, full)
    vol = load_split(root, "train", "zscore")[0]
    assert vol.label.dtype == np.uint8 and set(np.unique(vol.label)) == {0, 1}


def test_all_problems_reported_together(tmp_path):
    root = write_dataset(tmp_path / "d", n_train=2, n_val=1)
    replace_file(root / "train_patches/images/vol_00.nii.gz", np.zeros((4, 4), np.float32))
    replace_file(root / "train_patches/labels/vol_01.nii.gz", np.full((16, 32, 32), 3, np.uint8))
    message = expect_error(root, "vol_00", "vol_01")
    assert len(message.splitlines()) == 2


def test_normalisations():
    image = np.random.default_rng(0).normal(100, 20, (8, 8, 8)).astype(np.float32)
    z = normalize(image, "zscore")
    assert abs(z.mean()) < 1e-5 and abs(z.std() - 1) < 1e-4
    p = normalize(image, "percentile")
    assert p.min() == 0.0 and p.max() == 1.0


def make_patches(tmp_path, shape=(16, 32, 32), **kwargs):
    root = write_dataset(tmp_path / "d", n_train=2, n_val=1, shape=shape)
    volumes = load_split(root, "train", "zscore")
    options = dict(
        patch_size=(8, 16, 16), samples_per_volume=3, foreground_fraction=0.33, augment=True, seed=1
    )
    options.update(kwargs)
    return PatchDataset(volumes, **options)


def test_patches_have_the_patch_shape_and_are_reproducible(tmp_path):
    dataset = make_patches(tmp_path)
    assert len(dataset) == 6
    image, label = dataset[4]
    assert image.shape == label.shape == (1, 8, 16, 16) and image.dtype == torch.float32
    again = make_patches(tmp_path)
    assert torch.equal(again[4][0], image) and torch.equal(again[4][1], label)
    dataset.set_epoch(1)
    assert not torch.equal(dataset[4][0], image)  # a new epoch draws new patches


def test_foreground_oversampling(tmp_path):
    always = make_patches(tmp_path, foreground_fraction=1.0, augment=False, samples_per_volume=20)
    never = make_patches(tmp_path, foreground_fraction=0.0, augment=False, samples_per_volume=20)
    fg_always = np.mean([always[i][1].mean().item() > 0 for i in range(len(always))])
    assert fg_always == 1.0
    centre_hits = [never[i][1][0, 4, 8, 8].item() for i in range(len(never))]
    centre_always = [always[i][1][0, 4, 8, 8].item() for i in range(len(always))]
    assert np.mean(centre_always) > np.mean(centre_hits)


def test_small_volumes_are_padded_to_the_patch(tmp_path):
    dataset = make_patches(tmp_path, shape=(6, 12, 40), patch_size=(8, 16, 16))
    for i in range(len(dataset)):
        image, label = dataset[i]
        assert image.shape == label.shape == (1, 8, 16, 16)
    vol = dataset.volumes[0]
    assert vol.image.shape == (8, 16, 40)
    assert vol.image[0].min() == vol.image.min()  # padded with the volume's minimum
    assert vol.label[0].max() == 0  # padded label is background


def test_augmentation_keeps_shape_and_alignment():
    rng = np.random.default_rng(0)
    image, label = blob_volume((8, 12, 16), rng)
    # a label-derived image: any spatial misalignment would break the equality below
    image = label.astype(np.float32) * 2.0
    augment = Augment()
    flipped_somewhere = False
    for seed in range(40):
        out_image, out_label = augment(image, label, np.random.default_rng(seed))
        assert out_image.shape == image.shape and out_label.shape == label.shape
        assert out_image.dtype == np.float32 and out_label.dtype == label.dtype
        # intensity changes are monotonic per voxel on average: foreground stays brighter
        assert out_image[out_label == 1].mean() > out_image[out_label == 0].mean() + 1.0
        flipped_somewhere |= not np.array_equal(out_label, label)
        assert out_label.sum() == label.sum()
    assert flipped_somewhere


def test_each_flip_moves_image_and_label_together():
    image = np.arange(8 * 12 * 16, dtype=np.float32).reshape(8, 12, 16)
    label = (image % 7 == 0).astype(np.uint8)
    augment = Augment()
    for seed in range(60):
        out_image, out_label = augment(image, label, np.random.default_rng(seed))
        # undo the flips that happened, read from the image's ramp direction on each axis
        flips = [ax for ax in range(3) if _is_flipped(out_image, ax)]
        restored_label = np.flip(out_label, flips) if flips else out_label
        assert np.array_equal(restored_label, label)


def _is_flipped(image, axis):
    a = np.take(image, 0, axis=axis).mean()
    b = np.take(image, -1, axis=axis).mean()
    return a > b


def test_read_volume_rejects_unknown_extension(tmp_path):
    path = tmp_path / "x.mha"
    path.write_bytes(b"x")
    with pytest.raises(ValueError, match=r"x\.mha: unsupported file type"):
        read_volume(path)
