#!/usr/bin/env bash
# pip install "$@" into the base image's Python without replacing its CUDA build of torch.
#
# The official pytorch/pytorch images ship torch (+cuXXX), triton and the nvidia-* CUDA wheels.
# requirements.txt has no torch, but a dependency that asks for another torch (monai needs
# torch>=2.8.0) would make pip download a different build. Every one of those packages is pinned
# here to the version already installed, so pip either keeps them or fails with a resolver
# error; the build never swaps torch silently. The check at the end makes that explicit.
# Used by ../Dockerfile and Dockerfile.apex.
set -euo pipefail

torch_info() {
    python -c 'import torch; print(torch.__version__, torch.version.cuda)'
}

before="$(torch_info)"
constraints="$(mktemp --suffix=.txt)"
python -m pip list --format=freeze \
    | grep -E '^(torch|torchvision|torchaudio|triton|pytorch-triton|nvidia-[A-Za-z0-9._-]+)==' \
    > "${constraints}"
echo "pip constraints (from the base image):"
sed 's/^/  /' "${constraints}"

python -m pip install --no-cache-dir --constraint "${constraints}" "$@"
rm -f "${constraints}"

after="$(torch_info)"
if [[ "${before}" != "${after}" ]]; then
    echo "error: pip replaced the base image's torch: before '${before}', after '${after}'" >&2
    exit 1
fi
python - <<'PY'
import sys

import torch

if sys.version_info < (3, 11):
    sys.exit(f"error: Python {sys.version.split()[0]} < 3.11; requirements.txt needs 3.11+")
cudnn = torch.backends.cudnn.version()
print(f"torch {torch.__version__} unchanged (CUDA {torch.version.cuda}, cuDNN {cudnn})")
if torch.__version__.startswith("2.9."):
    sys.exit("error: torch 2.9.x routes fp16/bf16 3D convolutions away from cuDNN (slow AMP)")
PY
