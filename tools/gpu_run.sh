#!/usr/bin/env bash
# One command for a GPU machine: the GPU tests and the benchmarks of issue "GPU: end-to-end
# performance", everything written under $OUT, a table printed last. Budget: < 9 minutes on
# one H100 (each stage has a time cap, and no stage starts past the overall deadline).
# Seen on an H200 with jax 0.11.2 (2026-11-26, benchmarks/results/h200-2026-11-26): an engine's
# cold start compiles for ~100 s (the 1.1B shape, 26 programs) and HF's baselines take ~100 s,
# so a stage that starts an engine needs a cap of 150 s or more; with 15 minutes of device time
# a session, pick a few stages per call.
#
#   OUT=/tmp/out tools/gpu_run.sh                     # all stages
#   STAGES="tp11 serving" OUT=/tmp/out tools/gpu_run.sh
#
# Stages (run in the order STAGES gives; default): pytest  kernels  kernels2  gdnlora  host  tp11  tp8b  lora8b  serving  startup  dummyinit  spec  mtp  moe  gemma4  hybrid
#   pytest   pytest -m gpu (short; PYTEST_WORKERS xdist workers, default 4, when xdist is there)
#   kernels  benchmarks/kernels.py (when present)
#   kernels2 benchmarks/kernels.py with float8 pages (--kv-cache-dtype fp8), then head_dim 256 and
#            512 (Gemma 4's), every backend
#   gdnlora  benchmarks/kernels.py --cases gdn,lora: Gated DeltaNet against its state-traffic
#            bound and the XLA path; multi-LoRA projection against the base matmul
#   tp11     throughput, 1.1B shape (tinyllama-1.1b preset, dummy weights, bf16): 1024 prompts,
#            in 512, out 128, greedy, + HF generate, HF generate_batch and the decode roofline;
#            the host's time per step by phase, and a jax.profiler trace of 256 decodes summed
#            per op (the JSON's profile; the raw trace stays on the machine)
#   host     the persistent batch: 1.1B-shape throughput with host phases and a device profile,
#            this tree against the tree before it (BASELINE_DIR, default .baseline: see
#            stage_host), host_phases.json of both (issue "A persistent batch")
#   tp8b     throughput, Llama-3-8B shape (llama3-8b preset), + roofline
#   lora8b   benchmarks/lora.py on the Llama-3-8B shape: 0/1/4/8 random rank-16 adapters mixed
#            evenly vs the base engine (issue "Multi-LoRA serving"; target >= 0.9x of base)
#   serving  serving sweep on the 1.1B shape against a launched `jaxserve serve`
#   startup  `jaxserve serve` of the 1.1B shape (dummy weights) cold and cached (issue "Fast start")
#   dummyinit Qwen3.6-27B shape's dummy weights (bf16, op by op) and the one-jit init's compile
#            (DUMMY_SHAPE; "cpu": the tiny shape)
#   spec     benchmarks/latency.py --speculative-config (n-gram, k 4) vs plain decoding, batch 1
#            and 8, repeat-a-passage prompts (SPEC_MODEL, SPEC_CONFIG)
#   mtp      the same with method mtp on the Qwen3.6-27B shape (dummy head: drafting overhead)
#   moe      Mixtral-8x7B shape (8 layers) decode against its dense twin (issue "More model families")
#   gemma4   Gemma-4-31B shape (dummy weights, fp8 weights + fp8 KV, 32k context): the engine's
#            KV cache groups and "Maximum concurrency", beside the capacity arithmetic (issue 36)
#   hybrid   Qwen3.6-27B shape in fp8 (dummy weights): decode step time against context 1k -> 32k,
#            the hybrid (GDN + attention) against its all-attention twin (issue "Qwen 3.6");
#            two token buckets (16 and the budget), each a long compile at 64 layers
#   multimodal (not in the default list: STAGES=multimodal) Qwen3.6-27B-shaped VLM (dummy
#            weights, fp8, MM_LAYERS text layers, the real vision tower shape): images/s and TTFT
#            for 1 image (448 px) + 64 tokens -> 32 (benchmarks/multimodal.py; on CPU
#            "--shape dummy-cpu" runs the same path small)
#   offload  (not in the default STAGES: STAGES=offload) benchmarks/multi_turn.py: multi-turn chat
#            against a device pool of 25 % of the working set, the prefix cache's host tier
#            (--kv-offloading-size) on vs off: hit rate and TTFT p50/p90 per turn (issue 53);
#            OFFLOAD_ARGS (default a 1.1B-like random llama, 32 conversations x 8 turns);
#            OFFLOAD_ARGS="--hidden 64 --layers 2 --conversations 3 --turns 3 --first-tokens 64
#            --dtype float32" checks the stage on a CPU
#   research benchmarks/research.py on the 1.1B shape (dummy weights, bf16): update_weights from
#            placed arrays (target <= 20 ms), host arrays and a safetensors dir; sleep/wake levels
#            1 and 2; against a restart (issue 52). Not in the default STAGES: STAGES=research.
#            RESEARCH_ARGS="--tiny --dtype float32" checks the stage on a CPU
# Knobs (env): STAGES, BUDGET_S (default 515), N11 (1024), N8B (512), HF_CB_N (256),
#   LORA_PRESET (llama3-8b), LORA_ARGS (extra benchmarks/lora.py flags),
#   HF_BS ("64,128,256"), HF_CB_IMPLS ("sdpa,paged|eager,flash_attention_2"), SERVE_N (256),
#   SERVE_RATES ("inf,0.8x,0.5x"), SERVE_LAUNCH_TIMEOUT (180), GEMMA4_ARGS ("--preset gemma4-31b"; "--tiny" on CPU),
#   DUMMY_SHAPE (27b), RESEARCH_ARGS ("--preset tinyllama-1.1b --dtype bfloat16"),
#   T_<stage> caps in seconds (T_tp11=300 ...).
# XLA's persistent compilation cache is on (in the work dir), so the serving stage's server
# reuses the executables the 1.1B throughput stage compiled (same shapes).
#
# Wheels: a machine without network gets what it lacks from .whl/ (pip download them where
# pip works; see README "GPU run"): installed into /tmp/site, put first on PYTHONPATH
# (tools/gpu_env.sh, shared with tools/gpu_kernels.sh).
# Results come back as three files: $OUT/summary.txt, $OUT/gpu_run.log, $OUT/results.tgz
# (JSON + PNG + logs; unpack into benchmarks/results/ to commit them).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/gpu_out}
mkdir -p "$OUT"
WORK=$(mktemp -d /tmp/gpu_run.XXXXXX)
RES=$WORK/results
mkdir -p "$RES"
LOG=$OUT/gpu_run.log
exec > >(tee -a "$LOG") 2>&1

START=$(date +%s)
BUDGET_S=${BUDGET_S:-515}
STAGES=${STAGES:-"pytest kernels kernels2 gdnlora host tp11 tp8b lora8b serving startup dummyinit spec mtp moe gemma4 hybrid"}
N11=${N11:-1024}
N8B=${N8B:-512}
HF_CB_N=${HF_CB_N:-256}
HF_CB_IMPLS=${HF_CB_IMPLS:-sdpa,paged|eager,flash_attention_2}
HF_BS=${HF_BS:-64,128,256}
SERVE_N=${SERVE_N:-256}
SERVE_RATES=${SERVE_RATES:-inf,0.8x,0.5x}
export TOKENIZERS_PARALLELISM=false
# every engine's start-up (load, each bucket's compile) in the stage logs: where a capped stage was
export JAXSERVE_LOGGING_LEVEL=${JAXSERVE_LOGGING_LEVEL:-INFO}
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-$WORK/jax_cache}
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0

GPU_ENV_TITLE="stages: $STAGES" . "$ROOT/tools/gpu_env.sh" jax jaxlib flax torch transformers \
  starlette uvicorn pydantic httpx matplotlib

STATUS=()
# run_stage NAME CAP_SECONDS CMD...: time-capped, never past the overall deadline
run_stage() {
  local name=$1 cap=$2; shift 2
  case " $STAGES " in *" $name "*) ;; *) return 0 ;; esac
  local var="T_${name}"; cap=${!var:-$cap}
  local left=$(( BUDGET_S - ($(date +%s) - START) ))
  if (( left < 20 )); then
    echo "== $name: SKIPPED (budget spent)"; STATUS+=("$name: skipped (budget)"); return 0
  fi
  (( cap > left )) && cap=$left
  echo "== $name (cap ${cap}s): $*"
  local t0=$(date +%s)
  timeout -k 10 "$cap" "$@" > "$RES/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$RES/$name.log"
  local dt=$(( $(date +%s) - t0 ))
  if (( rc == 124 || rc == 137 )); then STATUS+=("$name: TIMEOUT after ${dt}s")
  elif (( rc != 0 )); then STATUS+=("$name: FAILED rc=$rc (${dt}s)")
  else STATUS+=("$name: ok (${dt}s)"); fi
}

# Each stage is a function; they run in the order STAGES names them.
stage_pytest() {
  # Tests compile on the host, so several workers share the one GPU (no preallocation).
  local xdist=()
  if $PY -c "import xdist" 2>/dev/null && (( ${PYTEST_WORKERS:-4} > 1 )); then
    xdist=(-n "${PYTEST_WORKERS:-4}")
  fi
  export XLA_PYTHON_CLIENT_PREALLOCATE=false
  run_stage pytest 55 $PY -m pytest -m gpu -q -p no:cacheprovider \
    --timeout 120 "${xdist[@]}" \
    ${PYTEST_TARGETS:---continue-on-collection-errors -rfE tests/kernels tests/models tests/worker}
  unset XLA_PYTHON_CLIENT_PREALLOCATE
}
stage_kernels() {
  run_stage kernels 35 $PY benchmarks/kernels.py ${KERNEL_ARGS:---ctx 2048} --iters 20 --disable-tqdm \
    --output-json "$RES/kernels.json"
}
stage_kernels2() {
  # float8 pages (per-head scales), then Gemma 4's head_dim 256 and 512, every backend
  run_stage kernels2 150 bash -c "$PY benchmarks/kernels.py --ctx 2048 --kv-cache-dtype fp8 \
    --iters 20 --disable-tqdm --output-json $RES/kernels-fp8.json && \
    $PY benchmarks/kernels.py --ctx 2048 --head-dim 256 --num-q-heads 16 --num-kv-heads 8 \
    --iters 20 --disable-tqdm --output-json $RES/kernels-d256.json && \
    $PY benchmarks/kernels.py --ctx 2048 --head-dim 512 --num-q-heads 16 --num-kv-heads 4 \
    --iters 20 --disable-tqdm --output-json $RES/kernels-d512.json"
}
stage_gdnlora() {
  run_stage gdnlora 120 $PY benchmarks/kernels.py --cases gdn,lora ${GDN_LORA_ARGS:-} --iters 20 \
    --disable-tqdm --output-json "$RES/kernels-gdn-lora.json"
}
stage_tp11() {
  # HF=0 skips the HF baselines (e.g. when this session already measured them)
  local hf=(--hf-baseline --hf-batch-sizes "$HF_BS" --hf-cb-baseline --hf-cb-num-prompts "$HF_CB_N"
            --hf-cb-attn-impls "$HF_CB_IMPLS" --hf-timeout "${HF_TIMEOUT:-70}")
  [[ "${HF:-1}" == 0 ]] && hf=()
  run_stage tp11 240 $PY benchmarks/throughput.py --preset tinyllama-1.1b --dtype bfloat16 \
    --num-prompts "$N11" --input-len 512 --output-len 128 --disable-detokenize \
    "${hf[@]}" --roofline --profile-dir "$WORK/trace-tp11" \
    --disable-tqdm --output-json "$RES/throughput-tinyllama-1.1b.json"
}
stage_host() {
  # The persistent batch's host time: throughput with the phase breakdown and a profile, this
  # tree ("after") and, when $BASELINE_DIR holds the tree before it (made by
  #   mkdir -p .baseline && git archive 640bafb | tar -x -C .baseline
  # and carried), the same run there ("before"), then benchmarks/host_phases.py over both.
  # HOST_ARGS replaces the workload (CPU check: a tiny model and shape).
  local base=${BASELINE_DIR:-$ROOT/.baseline}
  local args=${HOST_ARGS:-"--preset tinyllama-1.1b --dtype bfloat16 --num-prompts $N11 --input-len 512 --output-len 128"}
  local run="$PY benchmarks/throughput.py $args --disable-detokenize --disable-tqdm --no-plot"
  local cmd="mkdir -p $RES/host/after $RES/host/before && \
    $run --profile-dir $WORK/trace-host --output-json $RES/host/after/throughput-host.json"
  local sets="after=$RES/host/after"
  if [[ -d "$base/jaxserve" ]]; then
    cmd="$cmd && (cd $base && PYTHONPATH=$base:\${PYTHONPATH:-} $run \
      --output-json $RES/host/before/throughput-host.json)"
    sets="before=$RES/host/before $sets"
  else
    echo "host: no baseline tree at $base (after only)"
  fi
  cmd="$cmd && $PY benchmarks/host_phases.py $sets --output-json $RES/host_phases.json"
  run_stage host 300 bash -c "$cmd"
}
stage_tp8b() {
  run_stage tp8b 110 $PY benchmarks/throughput.py --preset llama3-8b --dtype bfloat16 \
    --num-prompts "$N8B" --input-len 512 --output-len 128 --disable-detokenize --roofline \
    --disable-tqdm --output-json "$RES/throughput-llama3-8b.json"
}
stage_lora8b() {
  run_stage lora8b 120 $PY benchmarks/lora.py --preset "${LORA_PRESET:-llama3-8b}" --dtype bfloat16 \
    --num-prompts 64 --input-len 256 --output-len 64 --max-num-seqs 64 --repeats 2 \
    --targets all ${LORA_ARGS:-} --disable-tqdm --output-json "$RES/lora-${LORA_PRESET:-llama3-8b}.json"
}
stage_serving() {
  run_stage serving 260 $PY benchmarks/serving.py --launch --preset tinyllama-1.1b \
    --dtype bfloat16 --num-prompts "$SERVE_N" --input-len 512 --output-len 128 \
    --request-rates "$SERVE_RATES" --goodput ttft:30 tpot:8 \
    --launch-timeout "${SERVE_LAUNCH_TIMEOUT:-180}" \
    --disable-tqdm --output-json "$RES/serving-tinyllama-1.1b.json"
}
stage_startup() {
  local model
  model=$($PY -c "from benchmarks.baselines import resolve_model; print(resolve_model(None, 'tinyllama-1.1b'))")
  run_stage startup 150 $PY benchmarks/startup.py --model "$model" \
    --extra-args "--load-format dummy --dtype bfloat16" --timeout 70 --result-dir "$RES"
}
stage_spec() {
  # n-gram speculation against plain decoding, batch 1 and 8, prompts that ask to repeat a code
  # passage. SPEC_MODEL: a real model (the >= 1.5x target needs one: a dummy model does not
  # copy its prompt); default the 1.1B shape with dummy weights (overhead and equal outputs).
  local src=(--preset tinyllama-1.1b)
  [[ -n "${SPEC_MODEL:-}" ]] && src=(--model "$SPEC_MODEL")
  local cfg='{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
  run_stage spec 200 $PY benchmarks/latency.py "${src[@]}" --dtype bfloat16 --output-len 128 \
    --speculative-config "${SPEC_CONFIG:-$cfg}" \
    --batch-sizes 1,8 --num-iters-warmup 1 --num-iters 3 --spec-prompt repeat \
    --output-json "$RES/latency-spec-ngram.json"
}
stage_mtp() {
  # MTP speculation (Qwen3.6-27B shape with a one-layer head, dummy weights, bf16) against plain
  # decoding at batch 1 and 8: a random head accepts ~nothing, so this measures the drafting
  # overhead (MTP_SHAPE=cpu: the tiny shape). Outputs match plain decoding in float32 (tiny
  # shape on CPU: identical at batch 1 and 8); in bf16 a random model's near-tied logits flip
  # with the verify step's shapes, so "identical" can read False there.
  local model
  model=$($PY -c "from benchmarks.hybrid_decode import write_shape; print(write_shape('${MTP_SHAPE:-27b}', mtp=True))")
  run_stage mtp 300 $PY benchmarks/latency.py --model "$model" --load-format dummy \
    --dtype bfloat16 --max-model-len 1024 --input-len 256 --output-len 64 \
    --speculative-config '{"method": "mtp", "num_speculative_tokens": 2}' \
    --batch-sizes 1,8 --num-iters-warmup 1 --num-iters 3 --spec-prompt random \
    --output-json "$RES/latency-spec-mtp.json"
}
stage_moe() {
  run_stage moe 120 $PY benchmarks/moe_decode.py --num-layers 8 --batch-sizes ${MOE_BATCHES:-1,8,32,128} \
    --output-json "$RES/moe_decode-mixtral-8x7b.json"
}
stage_gemma4() {
  local g4=${GEMMA4_ARGS:---preset gemma4-31b}
  run_stage gemma4 150 bash -c "$PY benchmarks/gemma4_capacity.py --no-plot --output-json \
    $RES/gemma4_capacity.json && $PY benchmarks/gemma4_capacity.py --engine $g4 \
    --output-json $RES/gemma4_capacity_engine-31b.json"
}
stage_dummyinit() {
  # how long the Qwen3.6-27B shape's dummy weights take (op by op, what hybrid/mtp load), then
  # the old one-jit init's lower + compile as the baseline (its JSON is written after each part)
  run_stage dummyinit 240 $PY -m benchmarks.dummy_init --hybrid-shape ${DUMMY_SHAPE:-27b} \
    --output-json "$RES/dummy_init-qwen3.6-${DUMMY_SHAPE:-27b}.json"
}
stage_research() {
  run_stage research 240 $PY benchmarks/research.py \
    ${RESEARCH_ARGS:---preset tinyllama-1.1b --dtype bfloat16} --gpu-memory-utilization 0.6 \
    --output-json "$RES/research-tinyllama-1.1b.json"
}
stage_offload() {
  run_stage offload 240 $PY benchmarks/multi_turn.py ${OFFLOAD_ARGS:---hidden 2048 --layers 22 \
    --dtype bfloat16 --conversations 32 --turns 8 --first-tokens 1024 --user-tokens 128 \
    --output-tokens 64 --max-num-batched-tokens 2048} --out-dir "$RES/offload"
}
stage_hybrid() {
  run_stage hybrid 240 $PY benchmarks/hybrid_decode.py --shape ${HYBRID_SHAPE:-27b} \
    --quantization fp8 --batch ${HYBRID_BATCH:-8} \
    --contexts ${HYBRID_CONTEXTS:-1024,2048,4096,8192,16384,32768} ${HYBRID_ARGS:-} \
    --output-json "$RES/hybrid_decode-qwen3.6-27b.json"
}
stage_multimodal() {
  run_stage multimodal 240 $PY benchmarks/multimodal.py --shape 27b --quantization fp8 \
    --num-layers ${MM_LAYERS:-16} ${MM_ARGS:-} --output-json "$RES/multimodal-qwen3.6-27b.json"
}

for s in $STAGES; do
  if declare -F "stage_$s" >/dev/null; then "stage_$s"
  else echo "== $s: unknown stage"; STATUS+=("$s: unknown stage"); fi
done

echo
echo "== stages"
printf '  %s\n' "${STATUS[@]}"
$PY benchmarks/baselines.py table "$RES" | tee "$OUT/summary.txt"
printf '  %s\n' "${STATUS[@]}" >> "$OUT/summary.txt"
echo "total $(( $(date +%s) - START )) s" | tee -a "$OUT/summary.txt"
tar czf "$OUT/results.tgz" -C "$WORK" results
echo "results: $OUT/results.tgz ($(ls "$RES" | wc -l) files)"
