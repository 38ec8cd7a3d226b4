#!/usr/bin/env bash
# Installs what the project needs on a fresh Debian machine (run as root or with sudo).
#   bash scripts/install.sh           everything for the tests: Debian's slurm-wlm, munge, OpenMPI, sshd and pdsh
#                                     (for the launcher tests and mpi4py), then the package with [dev]
#                                     (the test-only packages and every extra's: wandb for tests/training/test_wandb.py, ...)
#   GRT_MINIMAL=1 bash scripts/install.sh   only what training needs (the main job)
# CPU torch is pinned: an unpinned `torch` would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
if [ "${GRT_MINIMAL:-0}" != 1 ] && command -v apt-get >/dev/null; then
  need=""
  for tool in sbatch:slurm-wlm munged:munge mpirun:openmpi-bin mpicc:libopenmpi-dev gcc:build-essential \
              sshd:openssh-server ssh:openssh-client pdsh:pdsh ip:iproute2 nsenter:util-linux nginx:nginx \
              openssl:openssl; do
    command -v "${tool%%:*}" >/dev/null || need="$need ${tool#*:}"
  done
  if [ -n "$need" ]; then
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq $need >/dev/null
  fi
fi
python3 -m pip install -q "torch==${GRT_TORCH_VERSION:-2.13.0}"
if [ "${GRT_MINIMAL:-0}" = 1 ]; then
  python3 -m pip install -q -e .
else
  python3 -m pip install -q -e ".[dev]"
fi
