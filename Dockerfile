# GRT pretraining image: NVIDIA's PyTorch container (CUDA, NCCL, flash-attn, HPC-X
# OpenMPI) + DeepSpeed with its CUDA ops prebuilt + this project + pdsh/sshd for multi-node.
# Built on a machine with Docker (see docs/launching.md):
#   docker build -t grt:latest .
#   docker build -t grt:latest --build-arg GRT_UID=$(id -u) .     # your uid, for bind mounts
# Apptainer/Singularity: Apptainer.def builds grt.sif from this image.
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:25.10-py3
FROM ${BASE_IMAGE}

ARG DEEPSPEED_VERSION=0.19.8
# GPU architectures the DeepSpeed ops are compiled for (A100 = 8.0, H100/H200 = 9.0)
ARG TORCH_CUDA_ARCH_LIST="8.0 9.0"
# the image runs as this non-root user (GRT_UID=0 runs it as root)
ARG GRT_UID=1000
ARG GRT_USER=grt

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    PDSH_RCMD_TYPE=ssh \
    TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST}

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# multi-node launch tools: pdsh + ssh (deepspeed runner), OpenMPI (the base image's HPC-X,
# else Ubuntu's), libaio for DeepSpeed's async I/O op
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends pdsh openssh-client openssh-server libaio-dev \
    && if ! command -v mpirun >/dev/null; then apt-get install -y --no-install-recommends openmpi-bin libopenmpi-dev; fi \
    && rm -rf /var/lib/apt/lists/* \
    && mkdir -p /run/sshd /etc/grt

# Every Python package is pinned: the project's dependencies by docker/constraints.txt, and
# the base image's own torch and numpy builds (e.g. 2.x.0a0+nv) so that pip never replaces them
COPY docker/constraints.txt /etc/grt/constraints.txt
RUN python -c "import torch, numpy; print(f'torch=={torch.__version__}\nnumpy=={numpy.__version__}')" \
        >> /etc/grt/constraints.txt
ENV PIP_CONSTRAINT=/etc/grt/constraints.txt

# DeepSpeed with the CUDA ops the trainer uses compiled now
# instead of JIT-compiled at the first step on every node (FusedAdam/Lamb, CPU Adam for
# offload, async I/O, utils); the build has no GPU for DeepSpeed to detect CUDA from
RUN DS_ACCELERATOR=cuda DS_BUILD_FUSED_ADAM=1 DS_BUILD_FUSED_LAMB=1 DS_BUILD_CPU_ADAM=1 DS_BUILD_AIO=1 DS_BUILD_UTILS=1 \
    pip install --no-build-isolation "deepspeed==${DEEPSPEED_VERSION}" \
    && DS_ACCELERATOR=cuda ds_report

# sshd for the deepspeed runner across containers (docker/start-sshd.sh, run as `grt-sshd`)
COPY docker/sshd_config /etc/grt/sshd_config
COPY docker/ssh_config /etc/ssh/ssh_config.d/grt.conf
COPY docker/start-sshd.sh /usr/local/bin/grt-sshd

WORKDIR /workspace/grt
# dependencies first (a layer that survives source edits), then the source
COPY setup.py ./
COPY pretrain/__init__.py pretrain/
COPY data_pipeline/__init__.py data_pipeline/
COPY launcher/__init__.py launcher/
COPY grt_common/__init__.py grt_common/
RUN pip install -e ".[mpi]"
COPY pretrain/ pretrain/
COPY data_pipeline/ data_pipeline/
COPY launcher/ launcher/
COPY grt_common/ grt_common/
COPY ds_configs/ ds_configs/
COPY docker/ docker/
COPY scripts/ scripts/
COPY docs/ docs/
COPY examples/ examples/

# fails the build when flash-attn or a prebuilt DeepSpeed op is missing (the trainer would fall
# back to slower paths; apex is not needed: nothing imports it)
RUN python docker/check_image.py \
    && grt --help \
    && grt launch --launcher slurm --nodes 2 --gpus-per-node 8 --dry-run --no-resolve --run-dir /tmp/grt-check >/dev/null

# the base image's own user with that uid (Ubuntu 24.04 images: `ubuntu`, 1000) makes way
RUN if [ "${GRT_UID}" != 0 ]; then \
        if getent passwd "${GRT_UID}" >/dev/null; then userdel --remove "$(getent passwd "${GRT_UID}" | cut -d: -f1)"; fi \
        && useradd --create-home --uid "${GRT_UID}" --shell /bin/bash "${GRT_USER}" \
        && chown -R "${GRT_UID}" /workspace/grt; \
    fi

USER ${GRT_UID}
CMD ["grt", "--help"]
