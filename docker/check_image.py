"""Build-time check of the image (Dockerfile, Apptainer %test): everything the trainer would
otherwise fall back from is there. flash-attn imports (the packed-document attention, docs/gpu.md
"flash-attn"), and DeepSpeed's CUDA ops were compiled at install time (a missing one would be
JIT-compiled on every node at the first step). Imports only: it runs without a GPU (DeepSpeed is
told the accelerator is CUDA, which it cannot detect then). apex is not checked: no module
imports it. Prints one line per problem, exits 1."""

import importlib
import os
import sys
from collections.abc import Iterator

os.environ.setdefault("DS_ACCELERATOR", "cuda")

MODULES = ("flash_attn", "deepspeed", "mpi4py", "webdataset", "sentencepiece", "pretrain.cli")
# the DS_BUILD_* ops of the Dockerfile, by their op_builder class
PREBUILT_OPS = ("FusedAdamBuilder", "FusedLambBuilder", "CPUAdamBuilder", "AsyncIOBuilder")


def problems() -> Iterator[str]:
    for name in MODULES:
        try:
            importlib.import_module(name)
        except Exception as err:  # an ImportError, or a broken extension module
            yield f"import {name} failed: {type(err).__name__}: {err}"
    from deepspeed.git_version_info import installed_ops
    from deepspeed.ops import op_builder

    for cls in PREBUILT_OPS:
        builder = getattr(op_builder, cls)()
        if not installed_ops.get(builder.name):
            yield f"DeepSpeed op {builder.name} was not prebuilt (set DS_BUILD_* when installing deepspeed)"
            continue
        try:
            builder.load(verbose=False)
        except Exception as err:
            yield f"DeepSpeed op {builder.name} is prebuilt but does not load: {type(err).__name__}: {err}"


def main() -> int:
    found = list(problems())
    for line in found:
        print(f"image check: {line}", file=sys.stderr)
    if not found:
        print("image check: flash_attn, the project and the prebuilt DeepSpeed ops are all usable")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
