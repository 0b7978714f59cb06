import os

# albumentations asks PyPI for a newer version at import, in every DataLoader worker; set before
# any app module imports it
os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")
