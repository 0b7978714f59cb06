#!/usr/bin/env bash
# pip install [--lock FILE] ARGS... into the base image's Python without replacing its CUDA
# build of torch. Used by ../Dockerfile and Dockerfile.apex.
#
# The official pytorch/pytorch images ship torch (+cuXXX), triton and the nvidia-* CUDA wheels.
# requirements.txt has no torch, but a dependency that asks for another torch (monai needs
# torch>=2.8.0) would make pip download a different build. Every one of those packages is pinned
# here to the version already installed, so pip either keeps them or fails with a resolver
# error; the build never swaps torch silently. The check at the end makes that explicit.
#
# --lock FILE: FILE (requirements.lock) constrains every version pip picks, and afterwards every
# package the install added or changed must be pinned there at the version installed: the image
# runs the versions CI tested, and a dependency the lock lacks (one the image's Python pulls in
# and CI's does not) fails the build by name.
#
# Since torch 2.10 the images install torch into Ubuntu's system Python, marked externally
# managed (PEP 668). This image runs one application, so the install goes into that Python on
# purpose (PIP_BREAK_SYSTEM_PACKAGES, for these installs only); the older conda-based images
# ignore it.
set -euo pipefail

lock=""
if [[ ${1:-} == --lock ]]; then
    lock=$2
    shift 2
fi

torch_info() {
    python3 -c 'import torch; print(torch.__version__, torch.version.cuda)'
}
installed() {
    python3 -m pip list --format=freeze 2>/dev/null | sort
}

before="$(torch_info)"
installed >/tmp/pip-before.txt
constraints="$(mktemp --suffix=.txt)"
grep -E '^(torch|torchvision|torchaudio|triton|pytorch-triton|nvidia-[A-Za-z0-9._-]+)==' \
    /tmp/pip-before.txt >"${constraints}" || true
echo "pip constraints (from the base image):"
sed 's/^/  /' "${constraints}"

PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install --no-cache-dir --constraint "${constraints}" \
    ${lock:+--constraint "$lock"} "$@"
rm -f "${constraints}"

after="$(torch_info)"
if [[ "${before}" != "${after}" ]]; then
    echo "error: pip replaced the base image's torch: before '${before}', after '${after}'" >&2
    exit 1
fi
if [[ -n $lock ]]; then
    installed | comm -13 /tmp/pip-before.txt - | python3 -c '
import re, sys
def norm(name): return re.sub(r"[-_.]+", "-", name).lower()
locked = {}
for line in open(sys.argv[1]):
    line = line.split("#")[0].strip()
    if "==" in line:
        name, version = line.split("==", 1)
        locked[norm(name)] = version.strip()
bad = []
for line in sys.stdin:
    name, version = line.strip().split("==", 1)
    pinned = locked.get(norm(name), "not pinned")
    if pinned != version:
        bad.append(f"{name}=={version} (lock: {pinned})")
if bad:
    sys.exit(f"error: {sys.argv[1]} does not pin what pip installed: " + ", ".join(bad))
print(f"every package installed is pinned in {sys.argv[1]}")
' "$lock"
fi
rm -f /tmp/pip-before.txt
python3 - <<'PY'
import sys

import torch

if sys.version_info < (3, 11):
    sys.exit(f"error: Python {sys.version.split()[0]} < 3.11; requirements.txt needs 3.11+")
cudnn = torch.backends.cudnn.version()
print(f"torch {torch.__version__} unchanged (CUDA {torch.version.cuda}, cuDNN {cudnn})")
release = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
if torch.__version__.startswith("2.9.0"):
    sys.exit("error: torch 2.9.0 routes fp16/bf16 3D convolutions away from cuDNN (slow AMP)")
if torch.version.cuda and release >= (2, 9) and (cudnn or 0) < 91500:
    sys.exit(
        f"error: torch {torch.__version__} runs fp16/bf16 3D convolutions on cuDNN only from "
        f"cuDNN 9.15, this base has {cudnn}: choose a CUDA 13 tag (pytorch#166122)"
    )
PY
