# Sourced by the GPU scripts (scripts/gpu_check.sh, docs/comparison/run_gpu_comparison.sh).
# The GPU machine has no network: Python packages it lacks travel as wheels in the
# checkout's ignored .whl/ folder (gpu_env_fetch, docs/gpu.md "Preparing a call") and are
# installed into /tmp/site, which goes on PYTHONPATH. Packages already present are kept.

# What the GPU machine lacks, one version each (tests/launch/test_gpu_wheels.py installs them into an
# environment that has only what the machine has). DeepSpeed needs nothing built: its optimizer here is
# torch's fused AdamW (pretrain/training/engine/ds_config.py). typing_extensions: pydantic 2.13 needs >= 4.14.1,
# newer than the machine's may be.
GPU_WHEELS="deepspeed==0.19.8 hjson==3.1.0 pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0
typing-inspection==0.4.2 typing-extensions==4.15.0 webdataset==1.0.2 braceexpand==0.1.7 zstandard==0.25.0"

# gpu_env_fetch DIR [PYTHON_VERSION]: the wheels of GPU_WHEELS into DIR, for the GPU machine's Python
# (3.12) unless told another. DeepSpeed ships as a source archive: built here, pure Python.
gpu_env_fetch() {
  local dir=$1 py=${2:-3.12} spec
  mkdir -p "$dir" || return 1
  for spec in $GPU_WHEELS; do
    if [ "${spec%%==*}" = deepspeed ]; then
      DS_BUILD_OPS=0 python3 -m pip wheel -q --no-deps -w "$dir" "$spec" || return 1
    else
      python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$py" --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$dir" "$spec" || return 1
    fi
  done
}

# gpu_env_install [FILE]: the wheels of .whl/ installed into /tmp/site (put on PYTHONPATH) unless deepspeed,
# webdataset and zstandard import. FILE: the environment also recorded there (gpu_env_record) by the Python
# that tries those imports: torch and DeepSpeed, seconds to import, are imported once a call, not twice
gpu_env_install() {
  local record=${1:-}
  # deepspeed imports pydantic (and so typing_extensions): an import that fails for a version too old counts
  if [ -n "$record" ]; then
    gpu_env_record "$record" && return 0
  else
    python3 -c "import deepspeed, webdataset, zstandard" 2>/dev/null && return 0
  fi
  if ! ls .whl/*.whl >/dev/null 2>&1; then
    echo "gpu_env: deepspeed, webdataset or zstandard does not import, and there are no wheels in .whl/ (see docs/gpu.md)" >&2
    return 1
  fi
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "gpu_env: installing the wheels in .whl/ failed" >&2; return 1; }
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
  [ -z "$record" ] || gpu_env_record "$record" || true  # recorded as installed; the rows' logs say what fails
}

# gpu_env_record FILE: the machine a call ran on (GPU, driver, CUDA, compiler, Python and its packages);
# its status: whether deepspeed, webdataset and zstandard import
gpu_env_record() {
  local imports
  {
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
    nvidia-smi 2>/dev/null | grep -o 'CUDA Version: [0-9.]*'
    command -v nvcc >/dev/null && nvcc --version | tail -1
    python3 - <<'EOF'
import importlib, platform, sys

print("python", platform.python_version(), sys.executable)
failed = set()
for name in ("torch", "triton", "deepspeed", "pydantic", "typing_extensions", "webdataset", "zstandard"):
    try:
        module = importlib.import_module(name)
        print(name, getattr(module, "__version__", "?"), getattr(module, "__file__", ""))
    except Exception as error:  # the file says what failed; the rows show what it costs
        print(name, "not importable:", error)
        failed.add(name)
import torch

print("torch.version.cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version(), "gpu",
      torch.cuda.get_device_name() if torch.cuda.is_available() else "none")
sys.exit(1 if failed & {"deepspeed", "webdataset", "zstandard"} else 0)
EOF
    imports=$?
    echo "## python3 -m pip list"
    python3 -m pip list --format=freeze 2>&1
  } > "$1" 2>&1
  return "$imports"
}
