# GRT pretraining image: NVIDIA's PyTorch container (CUDA, NCCL, apex, flash-attn, HPC-X
# OpenMPI) + DeepSpeed with its CUDA ops prebuilt + this project + pdsh/ssh for multi-node.
# Built on a machine with Docker (see docs/launching.md):
#   docker build -t grt:latest .
#   docker build -t grt:latest --build-arg GRT_UID=$(id -u) .     # run as a non-root user
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:25.10-py3
FROM ${BASE_IMAGE}

ARG DEEPSPEED_VERSION=0.19.8
# GPU architectures the DeepSpeed ops are compiled for (A100 = 8.0, H100/H200 = 9.0)
ARG TORCH_CUDA_ARCH_LIST="8.0 9.0"
# GRT_UID other than 0 runs the image as a non-root user (named GRT_USER) with that uid
ARG GRT_UID=0
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
    && mkdir -p /run/sshd

# pip must never replace NVIDIA's own torch build (its version, e.g. 2.x.0a0+nv, is pinned)
RUN python -c "import torch; print('torch==' + torch.__version__)" > /etc/pip-keep-torch.txt
ENV PIP_CONSTRAINT=/etc/pip-keep-torch.txt

# DeepSpeed with the CUDA ops the trainer uses compiled now instead of JIT-compiled at the
# first step on every node (FusedAdam/Lamb, CPU Adam for offload, async I/O, utils)
RUN DS_BUILD_FUSED_ADAM=1 DS_BUILD_FUSED_LAMB=1 DS_BUILD_CPU_ADAM=1 DS_BUILD_AIO=1 DS_BUILD_UTILS=1 \
    pip install --no-build-isolation "deepspeed==${DEEPSPEED_VERSION}" \
    && ds_report

WORKDIR /workspace/grt
# dependencies first (a layer that survives source edits), then the source
COPY setup.py ./
COPY pretrain/__init__.py pretrain/
COPY data_pipeline/__init__.py data_pipeline/
COPY launcher/__init__.py launcher/
RUN pip install -e ".[mpi]"
COPY pretrain/ pretrain/
COPY data_pipeline/ data_pipeline/
COPY launcher/ launcher/
COPY ds_configs/ ds_configs/
COPY scripts/ scripts/
COPY docs/ docs/
COPY examples/ examples/

RUN if [ "${GRT_UID}" != 0 ]; then \
        useradd --create-home --uid "${GRT_UID}" --shell /bin/bash "${GRT_USER}" \
        && chown -R "${GRT_UID}" /workspace/grt; \
    fi \
    && grt --help \
    && grt launch --launcher slurm --nodes 2 --gpus-per-node 8 --dry-run --no-resolve --run-dir /tmp/grt-check >/dev/null

USER ${GRT_UID}
CMD ["grt", "--help"]
