#!/usr/bin/env bash
# Attention-kernel checks on a GPU machine (issues "Pallas ragged paged attention" and "GPU:
# attention kernel performance"): the `-m gpu` kernel tests, then benchmarks/kernels.py
# (decode ctx 512/2048/8192 + mixed prefill, vs JAX's paged_attention / decode_attention), and
# optionally a tile sweep. Everything lands under $OUT; a short table is printed last.
# Budget: about 6 minutes without the sweep on one H100.
#
#   OUT=/tmp/out tools/gpu_kernels.sh
#   SWEEP=1 SWEEP_S=240 OUT=/tmp/out tools/gpu_kernels.sh     # + sweep of tile parameters
#   BENCH_ARGS="--cases decode --ctx 2048" OUT=/tmp/out tools/gpu_kernels.sh
#
# Expects jax (0.10.2 or 0.11.x) with its CUDA plugin, pytest, hypothesis, numpy, matplotlib,
# tqdm; wheels in .whl/ (if any) are installed into /tmp/site first (tools/gpu_env.sh). The
# "triton" backend also needs `triton` and `jax_triton` (pure-python jax-triton wheel + the
# triton wheel matching the machine's Python in .whl/); without them its tests skip and the
# benchmark records the backend's error next to the others' numbers.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/gpu_out}
RES=$OUT/results
mkdir -p "$RES"
LOG=$OUT/gpu_kernels.log
exec > >(tee -a "$LOG") 2>&1
. "$ROOT/tools/gpu_env.sh" jax jaxlib numpy pytest hypothesis matplotlib tqdm triton jax_triton

STATUS=()
stage() {  # stage NAME CAP_SECONDS CMD...
  local name=$1 cap=$2; shift 2
  echo "== $name (cap ${cap}s): $*"
  local t0=$(date +%s)
  timeout -k 10 "$cap" "$@" > "$OUT/$name.log" 2>&1
  local rc=$? dt=$(( $(date +%s) - t0 ))
  tail -n 30 "$OUT/$name.log"
  if (( rc == 124 || rc == 137 )); then STATUS+=("$name: TIMEOUT after ${dt}s")
  elif (( rc != 0 )); then STATUS+=("$name: FAILED rc=$rc (${dt}s)")
  else STATUS+=("$name: ok (${dt}s)"); fi
}

stage pytest_gpu "${T_PYTEST:-240}" $PY -m pytest -m gpu -q -p no:cacheprovider \
  --junitxml="$OUT/pytest_gpu.xml" \
  tests/kernels/test_ragged_paged_attention.py tests/worker/test_kv_write.py \
  tests/kernels/test_mosaic_gpu_attention.py tests/kernels/test_triton_attention.py

# shellcheck disable=SC2086
stage bench "${T_BENCH:-300}" $PY benchmarks/kernels.py --result-dir "$RES" --disable-tqdm \
  ${BENCH_ARGS:-}

if [[ "${SWEEP:-0}" == 1 ]]; then
  stage sweep "$(( ${SWEEP_S:-240} + 90 ))" $PY benchmarks/kernels.py --result-dir "$RES" \
    --disable-tqdm --sweep --sweep-budget-s "${SWEEP_S:-240}" --no-baseline --iters 10 \
    --cases decode,mixed --ctx 2048
fi

cp "$RES"/*.json "$RES"/*.png "$OUT"/ 2>/dev/null
echo
echo "== files in $OUT:"; ls -1 "$OUT"
echo
echo "== summary"
grep -E "passed|failed|error|skipped" "$OUT/pytest_gpu.log" | tail -n 1
sed -n '/^copy bandwidth/,$p' "$OUT/bench.log"
sed -n '/^case .*pallas ms/,/^default backend/p' "$OUT/bench.log"
[[ -f "$OUT/sweep.log" ]] && grep -E "^sweep " "$OUT/sweep.log"
printf '  %s\n' "${STATUS[@]}"
