"""Which variables of the launching environment reach the ranks."""

import re

# environment passed to every rank when present on the launching host
DEFAULT_EXPORT_PREFIXES = (
    "NCCL_",
    "UCX_",
    "FI_",
    "TORCH_NCCL_",
    "CUDA_DEVICE_MAX_CONNECTIONS",
    "OMP_NUM_THREADS",
    "GRT_",
    "HF_",
    "WANDB_",
    "TOKENIZERS_PARALLELISM",
    "PYTORCH_CUDA_ALLOC_CONF",
    "GLOO_SOCKET_IFNAME",
    "MLX5_",
    "HCOLL_",
    "SHARP_",
)
# never written into launch files unless given with --env: Slurm jobs inherit them from the
# submitting shell, mpirun gets them by name (-x NAME); with the deepspeed runner across
# nodes use --env or ~/.deepspeed_env
SECRET = re.compile(r"TOKEN|SECRET|PASSW|API_KEY|_KEY$|CREDENTIAL", re.I)
