# Shared preamble of tools/gpu_run.sh and tools/gpu_kernels.sh; sourced (not run) by them once
# they have cd'd to the repo root, set ROOT and started their log:
#
#   GPU_ENV_TITLE="stages: $STAGES" . "$ROOT/tools/gpu_env.sh" jax jaxlib numpy ...
#
# Sets PY (python, $PYTHON overrides), targets the GPU rather than the CPU default of the dev
# machines, installs the wheels in .whl/ (a machine without network gets what it lacks from
# there) into /tmp/site first on PYTHONPATH, then prints a header: time, commit, GPU, and the
# version of each module named as an argument, plus jax's devices.
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
unset JAX_PLATFORMS  # the GPU, not the CPU default of the dev machines

if ls .whl/*.whl >/dev/null 2>&1; then
  echo "== installing $(ls .whl/*.whl | wc -l) wheels from .whl/ into /tmp/site"
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl || echo "WARNING: wheel install failed"
  export PYTHONPATH=/tmp/site:$ROOT${PYTHONPATH:+:$PYTHONPATH}
else
  export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
fi

echo "== $(date -u +%FT%TZ) $(git rev-parse --short HEAD 2>/dev/null)${GPU_ENV_TITLE:+ $GPU_ENV_TITLE}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
$PY - "$@" <<'PYEOF' 2>&1 | grep -v "^WARNING: All log"
import importlib
import sys

for m in sys.argv[1:]:
    try:
        print(f"  {m} {importlib.import_module(m).__version__}")
    except Exception as e:
        print(f"  {m} MISSING ({type(e).__name__})")
import jax
print("  jax devices:", jax.devices())
PYEOF
