"""Data: volume I/O with geometry (``volume_io``: NIfTI, TIFF, NPY, zarr), pairing, checks,
normalisation and patch sampling (``dataset``), augmentation (``augment``), and volumes read
lazily from disk (``lazy``, ``--data-access mmap``). Labels are read through ``app.labels``."""
