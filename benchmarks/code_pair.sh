#!/usr/bin/env bash
# Two checkouts of jaxserve side by side on CPU: throughput (benchmarks/cpu_smollm2.py --skip-hf)
# and serving (benchmarks/serving.py --launch, burst then Poisson at 4 req/s, the demo model), the
# trees alternating REPEATS times, then summary.json + summary.png (medians, after / before).
#   git worktree add /tmp/before REV; git worktree add /tmp/after HEAD
#   bash benchmarks/code_pair.sh /tmp/before /tmp/after benchmarks/results/NAME [REPEATS]
set -u
B=$1; A=$2; OUT=$3; R=${4:-2}
PY=${PYTHON:-python}
mkdir -p "$OUT"
for i in $(seq 1 "$R"); do
  for tag in after before; do
    T=$A; [ $tag = before ] && T=$B
    (cd "$T" && PYTHONPATH=$T JAX_PLATFORMS=cpu $PY benchmarks/cpu_smollm2.py --skip-hf \
        --out "$OUT/throughput-$tag-$i.json" > "$OUT/throughput-$tag-$i.log" 2>&1)
    (cd "$T" && PYTHONPATH=$T JAX_PLATFORMS=cpu $PY benchmarks/serving.py --launch \
        --model ~/.cache/jaxserve/demo-random --num-prompts 64 --input-len 64 --output-len 64 \
        --max-num-seqs 64 --request-rates inf,4 --no-plot --disable-tqdm \
        --output-json "$OUT/serving-$tag-$i.json" > "$OUT/serving-$tag-$i.log" 2>&1)
    echo "$tag $i done $(date -u +%T) load $(cut -d' ' -f1 /proc/loadavg)"
  done
done
$PY "$(dirname "$0")/code_pair_summary.py" "$OUT"
