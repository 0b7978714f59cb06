# syntax=docker/dockerfile:1
#
# IronGrain trainer, default image: native mixed precision (torch.amp) on the official PyTorch
# CUDA runtime image. The apex image is docker/Dockerfile.apex; both are described in
# README.md ("Containers and Kubernetes").
#
#   docker build -t irongrain:0.1.0 .
#   docker run --rm --gpus all --ipc=host -v "$PWD/data:/data" -v "$PWD/runs:/runs" irongrain:0.1.0
#
# Base image: torch 2.13.0 + CUDA 13.0 + cuDNN 9, the torch that CI tests (requirements-cpu.txt;
# tests/test_lock.py fails when the two differ).
#   * Since 2.10 the official images are Ubuntu 24.04 with torch pip-installed into the system
#     Python 3.12, which is marked externally managed (PEP 668; pytorch#169873, #170338): a plain
#     `pip install` fails there. docker/pip-install-keep-torch.sh installs into that Python on
#     purpose (one application per image) and fails the build if torch would change.
#   * CUDA 13.0 rather than a 12.x tag: since 2.10 the CUDA 13 builds ship cuDNN >= 9.15
#     (pytorch#171189), the release that fp16/bf16 3D convolutions need. 2.9.0 routed them away
#     from cuDNN (about 4x slower AMP for a 3D U-Net, pytorch#166122) and 2.9.1+ route them back
#     only with cuDNN >= 9.15; cuDNN 9.10.2 (the 12.x builds of 2.8) computes some large bf16 3D
#     convolutions wrongly (pytorch#163539). The build fails on a CUDA torch >= 2.9 with an older
#     cuDNN (pip-install-keep-torch.sh), and the trainer logs the cuDNN version at start.
#   * CUDA 13 needs an NVIDIA driver >= 580. For an older driver pass a 2.13.0-cuda12.x tag and
#     check the cuDNN line the build prints.
#   * Not built here: CI has no registry and no GPU. It builds this Dockerfile on a stand-in
#     base (docker/ci/standin-base.sh: Debian's Python 3.11, the CPU wheel of the same torch,
#     the same marker, user and paths) and runs it (docker/ci/image-check.sh).
# To change it, pass --build-arg PYTORCH_IMAGE=pytorch/pytorch:<ver>-cuda<x>-cudnn9-runtime.
ARG PYTORCH_IMAGE=pytorch/pytorch:2.13.0-cuda13.0-cudnn9-runtime

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

# A C++ compiler and Python's headers for --compile: inductor builds its CPU kernels with them,
# and Triton its GPU launchers. The runtime base has neither, and without them --compile auto
# stays off and --compile on is refused.
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ python3-dev \
    && rm -rf /var/lib/apt/lists/*

# Dependencies before code, so a code change reuses this layer. Every version comes from
# requirements.lock, the lock CI and make install from. torch stays the base image's CUDA
# build: pip-install-keep-torch.sh pins it and fails the build if it would change.
COPY requirements.txt requirements.lock docker/pip-install-keep-torch.sh /tmp/build/
RUN bash /tmp/build/pip-install-keep-torch.sh --lock /tmp/build/requirements.lock \
        --requirement /tmp/build/requirements.txt \
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
RUN python3 -m compileall -q app

USER 1000:1000

# No ENTRYPOINT: `docker run IMAGE bash launch.sh ...` runs the launcher exactly once, and
# `docker run IMAGE` runs it with the defaults below.
CMD ["bash", "launch.sh", "--data-root", "/data", "--output-dir", "/runs/irongrain"]
