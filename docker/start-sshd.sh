#!/bin/bash
# `grt-sshd`: run sshd in the foreground as this (non-root) user, so that the deepspeed runner
# (pdsh over ssh) on one container can start ranks in the others:
#   docker run -d --gpus all --network host --ipc host \
#       -v /path/to/secret:/run/secrets/grt_ssh:ro grt:latest grt-sshd
# The secret directory holds the job's key pair, id_ed25519 and id_ed25519.pub (made once with
# `ssh-keygen -t ed25519 -N "" -f id_ed25519`); its public key is the one key allowed in.
set -euo pipefail
secret=${GRT_SSH_SECRET:-/run/secrets/grt_ssh}
for f in id_ed25519 id_ed25519.pub; do
    if [ ! -r "$secret/$f" ]; then
        echo "grt-sshd: $secret/$f is missing: mount a secret directory with the job's key pair there" >&2
        exit 2
    fi
done
install -d -m 700 "$HOME/.ssh"
install -m 600 "$secret/id_ed25519" "$HOME/.ssh/id_ed25519"
install -m 644 "$secret/id_ed25519.pub" "$HOME/.ssh/authorized_keys"
if [ ! -f "$HOME/.ssh/ssh_host_ed25519_key" ]; then
    ssh-keygen -q -t ed25519 -N "" -f "$HOME/.ssh/ssh_host_ed25519_key"
fi
# a login through ssh gets this container's environment, not sshd's bare one
env | grep -E '^(PATH|LD_LIBRARY_PATH|LIBRARY_PATH|CUDA_[A-Z_]*|NVIDIA_[A-Z_]*|NCCL_[A-Z_]*|PYTHONPATH|PIP_CONSTRAINT|PDSH_RCMD_TYPE|TORCH_CUDA_ARCH_LIST)=' \
    > "$HOME/.ssh/environment" || true
exec /usr/sbin/sshd -D -e -f /etc/grt/sshd_config -h "$HOME/.ssh/ssh_host_ed25519_key"
