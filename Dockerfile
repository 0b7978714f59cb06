# syntax=docker/dockerfile:1
#
# IronGrain trainer, default image: native mixed precision (torch.amp) on the official PyTorch
# CUDA runtime image. The apex image is docker/Dockerfile.apex; both are described in
# README.md ("Containers and Kubernetes").
#
#   docker build -t irongrain:0.1.0 .
#   docker run --rm --gpus all --ipc=host -v "$PWD/data:/data" -v "$PWD/runs:/runs" irongrain:0.1.0
#
# Base image: torch 2.8.0 + CUDA 12.8 + cuDNN 9 (9.10.2), Python 3.11.
#   * Not torch 2.9.x: 2.9.0 turned cuDNN off for fp16/bf16 3D convolutions, about 4x slower AMP
#     for a 3D U-Net (pytorch/pytorch#166122). 2.9.1 turns it back on only with cuDNN >= 9.15,
#     which no 2.9.x build ships.
#   * 2.8.0 is the release that #166122 measured as fast. monai 1.6.1 (requirements.txt) needs
#     torch >= 2.8.0. CUDA 12.8 covers Volta to Blackwell. It wants an NVIDIA driver >= 570;
#     older R525+ drivers work through CUDA minor-version compatibility.
#   * Known cuDNN 9.10.2 caveat: bf16 3D convolutions on very large tensors can give wrong
#     results (pytorch/pytorch#163539). The default AMP dtype is float16. For bf16, prefer the
#     2.10.0-cuda13.0-cudnn9-runtime tag (cuDNN 9.15, needs driver >= 580).
# To change it, pass --build-arg PYTORCH_IMAGE=pytorch/pytorch:<ver>-cuda<x>-cudnn9-runtime.
# tests/test_container.py rejects an unpinned tag and torch 2.9.x.
ARG PYTORCH_IMAGE=pytorch/pytorch:2.8.0-cuda12.8-cudnn9-runtime

FROM ${PYTORCH_IMAGE}

ARG PYTORCH_IMAGE
ARG VERSION=0.1.0
ARG VCS_REF=unknown
ARG BUILD_DATE=unknown
LABEL org.opencontainers.image.title="irongrain" \
      org.opencontainers.image.description="Distributed mixed-precision 3D U-Net trainer for iron ore grain segmentation in CT volumes (native torch.amp)" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${VCS_REF}" \
      org.opencontainers.image.created="${BUILD_DATE}" \
      org.opencontainers.image.licenses="MIT" \
      org.opencontainers.image.base.name="${PYTORCH_IMAGE}"

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# NO_ALBUMENTATIONS_UPDATE: albumentations would otherwise query PyPI at import, from every
# DataLoader worker of every pod. HOME: a writable home for uid 1000 (torch and matplotlib caches).
ENV NO_ALBUMENTATIONS_UPDATE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/home/irongrain

# Dependencies before code, so a code change reuses this layer. torch stays the base image's
# CUDA build: pip-install-keep-torch.sh pins it and fails the build if it would change.
COPY requirements.txt docker/pip-install-keep-torch.sh /tmp/build/
RUN bash /tmp/build/pip-install-keep-torch.sh --requirement /tmp/build/requirements.txt \
    && rm -rf /tmp/build

# A numeric non-root user (uid/gid 1000, as in the k8s securityContext). /data (mounted data),
# /runs (run dirs: TensorBoard, metrics, checkpoints) and HOME are writable by it; mode 1777
# also lets `docker run --user $(id -u):$(id -g)` write there.
RUN if ! getent group 1000 >/dev/null; then groupadd --gid 1000 irongrain; fi \
    && if ! getent passwd 1000 >/dev/null; then \
         useradd --uid 1000 --gid 1000 --no-create-home --home-dir /home/irongrain \
                 --shell /bin/bash irongrain; \
       fi \
    && mkdir -p /data /runs /home/irongrain \
    && chown 1000:1000 /data /runs /home/irongrain \
    && chmod 1777 /data /runs /home/irongrain

WORKDIR /workspace
# Code only: datasets/ holds the generator script and the layout README, never data
# (see .dockerignore).
COPY launch.sh ./
COPY configs/ ./configs/
COPY bench/ ./bench/
COPY datasets/README.md datasets/*.py ./datasets/
COPY app/ ./app/
RUN python -m compileall -q app

USER 1000:1000

# No ENTRYPOINT: `docker run IMAGE bash launch.sh ...` runs the launcher exactly once, and
# `docker run IMAGE` runs it with the defaults below.
CMD ["bash", "launch.sh", "--data-root", "/data", "--output-dir", "/runs/irongrain"]
