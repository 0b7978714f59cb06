"""The filter bank of the learned floor (:mod:`app.analysis.learned_floor`): each voxel described
by the image and 21 filters of it at several scales (scipy.ndimage), ilastik's pixel features."""

from __future__ import annotations

import itertools

import numpy as np
from scipy import ndimage

SMOOTHING_SIGMAS = (0.7, 1.0, 1.6, 2.5, 3.5, 5.0)  # voxels; ilastik's scales, and 2.5
EDGE_SIGMAS = (0.7, 1.6, 3.5)  # gradient magnitude and Laplacian of Gaussian
HESSIAN_SIGMAS = (1.0, 1.6, 3.5)  # eigenvalues of the Hessian of Gaussian: sheets, tubes, blobs
FILTERS_IN_WORDS = (
    f"the image; Gaussian at sigma {', '.join(map(str, SMOOTHING_SIGMAS))}; gradient magnitude "
    f"and Laplacian of Gaussian at {', '.join(map(str, EDGE_SIGMAS))}; Hessian eigenvalues at "
    f"{', '.join(map(str, HESSIAN_SIGMAS))}"
)


def filter_names() -> list[str]:
    return (
        ["image"]
        + [f"gaussian {s}" for s in SMOOTHING_SIGMAS]
        + [f"{name} {s}" for s in EDGE_SIGMAS for name in ("gradient", "laplacian")]
        + [f"hessian eigenvalue {k} {s}" for s in HESSIAN_SIGMAS for k in (1, 2, 3)]
    )


def hessian_eigenvalues(image: np.ndarray, sigma: float) -> np.ndarray:
    """(*shape, 3) eigenvalues, ascending, of the Hessian of ``image`` smoothed by ``sigma``."""
    hessian = np.empty((*image.shape, 3, 3), np.float32)
    for i, j in itertools.combinations_with_replacement(range(3), 2):
        order = [0, 0, 0]
        order[i] += 1
        order[j] += 1
        second = ndimage.gaussian_filter(image, sigma, order=order, mode="reflect")
        hessian[..., i, j] = hessian[..., j, i] = second
    return np.linalg.eigvalsh(hessian)


def filter_features(image: np.ndarray) -> np.ndarray:
    """(voxels, features) float32: the image and its filters at every scale, voxel by voxel.
    Borders are reflected, as a slab cut from a larger volume continues past its edge."""
    image = np.asarray(image, np.float32)
    columns = [image]
    columns += [ndimage.gaussian_filter(image, s, mode="reflect") for s in SMOOTHING_SIGMAS]
    for s in EDGE_SIGMAS:
        columns.append(ndimage.gaussian_gradient_magnitude(image, s, mode="reflect"))
        columns.append(ndimage.gaussian_laplace(image, s, mode="reflect"))
    for s in HESSIAN_SIGMAS:
        columns += list(np.moveaxis(hessian_eigenvalues(image, s), -1, 0))
    return np.stack([c.reshape(-1) for c in columns], axis=1)
