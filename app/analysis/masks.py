"""Binary mask clean-up shared by ``app.analysis.predict`` (``--min-object-size``,
``--fill-holes``) and the grain analysis (``app.analysis.grains``), so that neither command imports
the other."""

from __future__ import annotations

import numpy as np
from scipy import ndimage
from skimage.measure import label as label_components

FACE = 1  # connectivity: grains touching only along an edge or a corner are two grains


def clean_mask(mask: np.ndarray, min_object_size: int = 0, fill_holes: bool = False) -> np.ndarray:
    """The mask without connected objects under ``min_object_size`` voxels (face
    connectivity), and with its enclosed cavities filled when ``fill_holes``."""
    mask = np.asarray(mask, dtype=bool)
    if min_object_size > 1:
        objects = label_components(mask, connectivity=FACE)
        mask = (np.bincount(objects.ravel()) >= min_object_size)[objects] & mask
    if fill_holes:
        mask = ndimage.binary_fill_holes(mask)
    return mask
