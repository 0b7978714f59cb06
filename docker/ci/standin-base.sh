#!/usr/bin/env bash
# Build (or find cached) a stand-in for the Dockerfile's base image, from Debian packages, for
# machines that can reach no container registry (CI): `bash docker/ci/standin-base.sh` prints
# the image name to pass as --build-arg PYTORCH_IMAGE=...
#
# It mirrors the official pytorch/pytorch:<torch>-cuda*-cudnn9-runtime images (2.10 and newer)
# where the Dockerfile depends on them:
#   - torch installed by pip into the system Python's dist-packages (/usr/local/lib/python3.X),
#     at the version CI tests (requirements-cpu.txt), with `python` and `pip` on PATH;
#   - that Python marked externally managed (PEP 668), so a plain `pip install` fails there too;
#   - a user with uid 1000 already present (Ubuntu 24.04 ships `ubuntu`), WORKDIR /workspace.
# What it cannot mirror: the real base is Ubuntu 24.04 with Python 3.12 and a CUDA build of
# torch with cuDNN and NCCL; the only torch wheel this machine has is the CPU build for Python
# 3.11, so the stand-in is Debian 12 (bookworm) with its Python 3.11. CUDA, cuDNN, NCCL and the
# real base's own files are checked by bench/gpu_check.sh on a GPU machine only.
#
# The image is tagged by a hash of this script and the torch pin, so it is rebuilt only when
# either changes (buildah keeps it in /var/lib/containers between runs). Needs root, buildah
# and debootstrap.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

torch_version=$(sed -n 's/^torch==\([0-9][0-9.]*\).*/\1/p' requirements-cpu.txt)
[[ -n $torch_version ]] || { echo "standin-base.sh: no torch==X pin in requirements-cpu.txt" >&2; exit 2; }
recipe_hash=$(cat "${BASH_SOURCE[0]}" requirements-cpu.txt | sha256sum | cut -c1-12)
image="localhost/irongrain-standin-base:torch${torch_version}-${recipe_hash}"

if buildah inspect --type image "$image" >/dev/null 2>&1; then
  echo "$image"
  exit 0
fi

log() { echo "standin-base.sh: $*" >&2; }
# The Debian mirror this machine's apt already uses (deb822 or one-line sources).
mirror=$(sed -n 's/^URIs: *\([^ ]*\).*/\1/p' /etc/apt/sources.list.d/*.sources 2>/dev/null \
  | grep -v -- '-security' | head -1 || true)
if [[ -z $mirror ]]; then
  mirror=$(awk '$1 == "deb" && $2 !~ /^\[/ {print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)
fi
[[ -n $mirror ]] || { echo "standin-base.sh: no Debian mirror found in /etc/apt" >&2; exit 2; }

work=$(mktemp -d)
ctr=""
cleanup() {
  [[ -n $ctr ]] && buildah rm "$ctr" >/dev/null 2>&1
  rm -rf "$work"
}
trap cleanup EXIT

# torch from this machine's pip configuration: the pinned CPU wheel (no multi-GB CUDA build).
log "fetching the torch==$torch_version wheel"
python3 -m pip download --quiet --no-deps --only-binary=:all: --dest "$work/wheels" \
  "torch==$torch_version" >&2

ctr=$(buildah from scratch)
root=$(buildah mount "$ctr")
log "debootstrap bookworm from $mirror into the stand-in"
debootstrap --variant=minbase \
  --include=python3,python3-pip,python-is-python3,ca-certificates \
  bookworm "$root" "$mirror" >"$work/debootstrap.log" 2>&1 \
  || { tail -20 "$work/debootstrap.log" >&2; exit 1; }

# pip reaches PyPI here only with this machine's CA bundle: it stands in for the stand-in's own
# bundle during the install and is put back after. A clean environment keeps this machine's
# pip settings (find-links, constraints) out of the stand-in.
ca=etc/ssl/certs/ca-certificates.crt
cp "$root/$ca" "$work/own-ca.crt"
cp /etc/ssl/certs/ca-certificates.crt "$root/$ca"
wheel=$(basename "$work"/wheels/torch-*.whl)
cp "$work/wheels/$wheel" "$root/tmp/"
log "installing $wheel into the system Python"
chroot "$root" /usr/bin/env -i PATH=/usr/local/bin:/usr/bin:/bin HOME=/root \
  python3 -m pip install --quiet --no-cache-dir --break-system-packages "/tmp/$wheel" >&2
cp "$work/own-ca.crt" "$root/$ca"
rm -f "$root/tmp/$wheel"
chroot "$root" useradd --uid 1000 --create-home --shell /bin/bash ubuntu
mkdir -p "$root/workspace"
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
test -f "$root"/usr/lib/python3*/EXTERNALLY-MANAGED \
  || { echo "standin-base.sh: the stand-in's Python is not marked externally managed" >&2; exit 1; }
buildah umount "$ctr" >/dev/null

buildah config --workingdir /workspace --cmd /bin/bash \
  --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  --env PYTORCH_VERSION="$torch_version" \
  --label org.opencontainers.image.description="stand-in for pytorch/pytorch:${torch_version}-cuda*-runtime (CPU torch, Debian bookworm)" \
  "$ctr"
buildah commit --quiet "$ctr" "$image" >/dev/null
log "built $image"
echo "$image"
