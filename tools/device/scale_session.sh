#!/usr/bin/env bash
# Runs at width on one multi-GPU node (with .devdeps beside the tree), by STAGE:
#   ddp     GPT-2 124M data-parallel scaling, T=1024, B per GPU (32): Loom (loom-train / loom-run, --phase-times) and
#           PyTorch DDP with torch.compile (tools/bench/pytorch_gpt2.py under torchrun) on 1, 2, .. $NGPU GPUs, and a
#           control: $NGPU independent one-GPU Loom runs at once (what the node gives without communication).
#           LOOM_VARIANTS: more Loom runs on all GPUs, "name|ENV=v ...|flags" separated by ';'.
#   parity  GPT-2 350M and LLaMA-3 1B over 4 GPUs: PP=4 (1F1B, interleaved with 2 virtual stages) and TP=4 against
#           one GPU at the same global batch and micro-batches, in f32 (no TF32): losses and gradient norms side by side.
#   speed   the same models and layouts (and TP=4 with SP) in bf16 at 16 micro-batches per step: tokens/s per GPU.
# STAGE may name several ("parity speed"; "wide" is both). Each builds first (tools/device/build.sh, vendor bridges
# left out; a warm machine keeps build-dev). Logs go to /tmp/scale and come back as $OUT/scale_logs.tar.gz (a GPU
# run returns only a few files); the tables are printed last. STEPS (30), B (32), NGPU (all visible).
set -u
O=/tmp/scale; mkdir -p "$O"
trap 'tar -czf "${OUT:-/tmp/out}/scale_logs.tar.gz" -C /tmp scale 2>/dev/null' EXIT
nvidia-smi -L
NGPU=${NGPU:-$(nvidia-smi -L | wc -l)}
export LOOM_CMAKE_ARGS="-DLOOM_INFINIOPS=OFF -DLOOM_DIOPI=OFF"
. tools/device/build.sh || exit 1
export NCCL_NVLS_ENABLE=0
[ -f .device/cache/gpt2/encoder.json ] && export LOOM_CACHE_DIR=$PWD/.device/cache
STEPS=${STEPS:-30}; B=${B:-32}; T=1024

# The median of perf/tokens_per_second over the steps after the fifth, from a metrics.jsonl.
median_tps() {
  python3 - "$1" <<'PY'
import json, statistics, sys
v = [json.loads(l).get("perf/tokens_per_second") for l in open(sys.argv[1])]
v = [x for x in v if x is not None]
print(f"{statistics.median(v[5:] or v):.0f}" if v else "nan")
PY
}
launch() {  # n: loom-train on one GPU, or loom-run over n
  if [ "$1" = 1 ]; then echo build-dev/loom-train; else echo "build-dev/loom-run --nproc-per-node $1 build-dev/loom-train"; fi
}

stages=${STAGE:-ddp}; stages=${stages/wide/parity speed}
for stage in $stages; do
case "$stage" in
ddp)
  SHARD=/tmp/gpt2_scaling.bin
  python3 tools/bench/make_shard.py $SHARD --tokens $(( (STEPS + 2) * B * T * NGPU + 1 )) > /dev/null
  C="--model gpt2-124m --dtype bf16 -b $B -t $T --steps $STEPS --device cuda --eval-interval 0 --sample-tokens 0
    --train-data $SHARD --phase-times --log-interval 10"
  table=$O/ddp_table.txt; : > $table
  row() { printf "%-34s %5s %12s %12s\n" "$@" >> $table; }
  row run GPUs tokens/s per-GPU
  loom_run() {  # name n env flags
    local name=$1 n=$2 envs=$3 flags=$4
    env $envs timeout 240 $(launch $n) $C --total-batch-tokens $(( B * T * n )) $flags --log-dir $O/$name \
      > $O/$name.log 2>&1 || { echo "$name failed"; tail -5 $O/$name.log; }
    local tps=$(median_tps $O/$name/metrics.jsonl 2>/dev/null)
    row "$name" $n "$tps" "$(python3 -c "print(f'{$tps / $n:.0f}')" 2>/dev/null)"
    grep -h "phase times" $O/$name.log | sed "s/^\[rank 0\] //; s/^/  $name: /" | cut -c1-200
  }
  n=1; while [ $n -le $NGPU ]; do loom_run loom_gpu$n $n "" ""; n=$((n * 2)); done
  IFS=';' read -ra variants <<< "${LOOM_VARIANTS:-}"
  for v in "${variants[@]}"; do
    IFS='|' read -r name envs flags <<< "$v"
    loom_run "loom_${name}_gpu$NGPU" $NGPU "$envs" "$flags"
  done
  # Control: NGPU independent one-GPU runs at once.
  for ((g = 0; g < NGPU; ++g)); do
    CUDA_VISIBLE_DEVICES=$g timeout 240 build-dev/loom-train $C --log-dir $O/control_$g > $O/control_$g.log 2>&1 &
  done
  wait
  sum=0; for ((g = 0; g < NGPU; ++g)); do sum=$(python3 -c "print($sum + $(median_tps $O/control_$g/metrics.jsonl))"); done
  row "loom, $NGPU independent runs" $NGPU "$sum" "$(python3 -c "print(f'{$sum / $NGPU:.0f}')")"
  n=1; while [ $n -le $NGPU ]; do
    if [ $n = 1 ]; then cmd="python3"; else cmd="python3 -m torch.distributed.run --nproc-per-node $n"; fi
    timeout 300 $cmd tools/bench/pytorch_gpt2.py --model 124m -b $B --steps $STEPS --data $SHARD > $O/pytorch_gpu$n.log 2>&1 \
      || { echo "pytorch $n failed"; tail -5 $O/pytorch_gpu$n.log; }
    tps=$(grep -o "RESULT pytorch tokens_per_s [0-9]*" $O/pytorch_gpu$n.log | grep -o "[0-9]*$")
    row "pytorch ddp compile" $n "${tps:-nan}" "$(python3 -c "print(f'{${tps:-0} / $n:.0f}')")"
    n=$((n * 2))
  done
  python3 - $table <<'PY'
import sys
rows = [l.split() for l in open(sys.argv[1]) if l.strip()][1:]
print(open(sys.argv[1]).read(), end="")
base = {}
for r in rows:
    name, n, tps = " ".join(r[:-3]), int(r[-3]), r[-2]
    fw = "pytorch" if name.startswith("pytorch") else "loom"
    if n == 1 and tps != "nan": base[fw] = float(tps)
for r in rows:
    name, n, tps = " ".join(r[:-3]), int(r[-3]), r[-2]
    fw = "pytorch" if name.startswith("pytorch") else "loom"
    if n > 1 and tps != "nan" and fw in base: print(f"scaling {name} on {n} GPUs: {float(tps) / base[fw]:.3f}x")
PY
  ;;
parity)
  [ -f /tmp/gpt2_wide.bin ] || python3 tools/bench/make_shard.py /tmp/gpt2_wide.bin --tokens 3000000 > /dev/null
  [ -f /tmp/llama_wide.bin ] || python3 tools/bench/make_shard.py /tmp/llama_wide.bin --tokens 3000000 --vocab 128256 > /dev/null
  # Parity: f32, 8 sequences per step in micro-batches of 2 everywhere (PP: 4 micro-batches in flight).
  parity() {  # model shard T name n flags
    local model=$1 shard=$2 t=$3 name=$4 n=$5; shift 5
    timeout 240 $(launch $n) --device cuda --dtype f32 --model $model --train-data $shard -b 2 -t $t \
      --total-batch-tokens $((8 * t)) --steps ${PSTEPS:-6} --warmup 2 --eval-interval 0 --sample-tokens 0 \
      --log-dir $O/parity_${model}_$name "$@" > $O/parity_${model}_$name.log 2>&1 || { echo "$model $name failed"; tail -4 $O/parity_${model}_$name.log; }
  }
  for spec in "gpt2-350m /tmp/gpt2_wide.bin 1024" "llama3-1b /tmp/llama_wide.bin 1024"; do
    set -- $spec
    parity $1 $2 $3 gpu1 1
    parity $1 $2 $3 pp4-1f1b 4 --pp 4
    parity $1 $2 $3 pp4-interleaved 4 --pp 4 --pp-schedule interleaved --virtual-stages 2
    parity $1 $2 $3 tp4 4 --tp 4
  done
  python3 - $O <<'PY'
import json, sys, os
O = sys.argv[1]
for model in ("gpt2-350m", "llama3-1b"):
    runs = {}
    for name in ("gpu1", "pp4-1f1b", "pp4-interleaved", "tp4"):
        p = f"{O}/parity_{model}_{name}/metrics.jsonl"
        if os.path.exists(p):
            rows = [json.loads(l) for l in open(p)]
            runs[name] = [(r["train/loss"], r["train/grad_norm"]) for r in rows if "train/loss" in r]
    print(f"parity {model} (f32): step, then loss / grad norm per run: " + ", ".join(runs))
    base = runs.get("gpu1", [])
    worst = {}
    for i in range(len(base)):
        print(f"  {i + 1}: " + "  ".join(f"{runs[n][i][0]:.6f}/{runs[n][i][1]:.5f}" if i < len(runs[n]) else "-" for n in runs))
        for n in runs:
            if n != "gpu1" and i < len(runs[n]):
                d = max(abs(runs[n][i][0] - base[i][0]) / abs(base[i][0]), abs(runs[n][i][1] - base[i][1]) / abs(base[i][1]))
                worst[n] = max(worst.get(n, 0), d)
    print("  largest relative difference from one GPU: " + ", ".join(f"{n} {d:.2e}" for n, d in worst.items()))
PY
  ;;
speed)
  [ -f /tmp/gpt2_wide.bin ] || python3 tools/bench/make_shard.py /tmp/gpt2_wide.bin --tokens 3000000 > /dev/null
  [ -f /tmp/llama_wide.bin ] || python3 tools/bench/make_shard.py /tmp/llama_wide.bin --tokens 3000000 --vocab 128256 > /dev/null
  # Throughput, bf16: one GPU against 4, the same global batch (16 micro-batches).
  table=$O/wide_table.txt; : > $table
  speed() {  # model shard T B name n flags
    local model=$1 shard=$2 t=$3 b=$4 name=$5 n=$6; shift 6
    timeout 300 $(launch $n) --device cuda --dtype bf16 --model $model --train-data $shard -b $b -t $t \
      --total-batch-tokens $((16 * b * t)) --steps ${WSTEPS:-12} --warmup 2 --eval-interval 0 --sample-tokens 0 \
      --log-dir $O/speed_${model}_$name "$@" > $O/speed_${model}_$name.log 2>&1 || { echo "$model $name failed"; tail -4 $O/speed_${model}_$name.log; }
    local tps=$(median_tps $O/speed_${model}_$name/metrics.jsonl 2>/dev/null)
    local mem=$(grep -o "mem [0-9.]*[KMG]*B" $O/speed_${model}_$name.log | tail -1)
    printf "%-10s %-16s %3s %10s %10s  %s\n" $model $name $n "$tps" "$(python3 -c "print(f'{$tps / $n:.0f}')" 2>/dev/null)" "$mem" >> $table
  }
  for spec in "gpt2-350m /tmp/gpt2_wide.bin 1024 4" "llama3-1b /tmp/llama_wide.bin 2048 2"; do
    set -- $spec
    speed $1 $2 $3 $4 gpu1 1
    speed $1 $2 $3 $4 pp4-1f1b 4 --pp 4
    speed $1 $2 $3 $4 pp4-interleaved 4 --pp 4 --pp-schedule interleaved --virtual-stages 2
    speed $1 $2 $3 $4 tp4 4 --tp 4
    speed $1 $2 $3 $4 tp4-sp 4 --tp 4 --sp
  done
  echo "bf16 throughput (model, run, GPUs, tokens/s, per GPU, last step's memory on rank 0):"; cat $table
  ;;
*) echo "unknown STAGE '$stage' (ddp, parity, speed, wide)"; exit 2 ;;
esac
done
