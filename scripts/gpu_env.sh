# Sourced by the GPU scripts (scripts/gpu_check.sh, docs/comparison/run_gpu_comparison.sh).
# The GPU machine has no network: Python packages it lacks travel as wheels in the
# checkout's ignored .whl/ folder (docs/gpu.md says how to download them) and are
# installed into /tmp/site, which goes on PYTHONPATH. Packages already present are kept.
gpu_env_install() {
  local missing=""
  for mod in deepspeed webdataset hjson pydantic zstandard braceexpand; do
    python3 -c "import $mod" 2>/dev/null || missing="$missing $mod"
  done
  [ -z "$missing" ] && return 0
  if ! ls .whl/*.whl >/dev/null 2>&1; then
    echo "gpu_env: missing Python packages:$missing, and no wheels in .whl/ (see docs/gpu.md)" >&2
    return 1
  fi
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "gpu_env: installing the wheels in .whl/ failed" >&2; return 1; }
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
}
