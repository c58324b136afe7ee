#!/usr/bin/env bash
# LoRA on LLaMA-3 8B on one GPU: loom-train against transformers + PEFT (tools/bench/peft_lora.py) in the same call,
# the same shapes: frozen base in bf16, rank R (16) adapters on q, k, v, o, gate, up, down with alpha 2R, B x T
# (2 x 4096), activation recompute for both (Loom: --recompute ${RECOMPUTE:-full}; PEFT: gradient checkpointing),
# STEPS (20) steps on a synthetic shard. Prints both runs' tokens/s and peak memory and their ratio.
# RECOMPUTE_BLOCKS="8 16 24" runs Loom once per value with --recompute-blocks N (only the first N blocks recompute;
# "all" is every block, the default) beside one PEFT run: the speed and memory between full and no recompute.
# SKIP_PEFT=1 leaves PEFT out; LOOM_FLAGS adds loom-train flags (a --lora-base-dtype there replaces the bf16 base:
# LOOM_FLAGS='--fp8 all --lora-base-dtype fp8' holds it in FP8).
#   tools/bench/lora_8b.sh          (from the repository root, with build-dev/ built; MODEL=llama3-tiny to try it)
set -uo pipefail
MODEL=${MODEL:-llama3-8b}; B=${B:-2}; T=${T:-4096}; R=${R:-16}; STEPS=${STEPS:-20}
LOOM=${LOOM:-build-dev/loom-train}
DIR=${DIR:-${OUT:-/tmp}/lora}
mkdir -p "$DIR"
VOCAB=(); [ "$MODEL" = llama3-tiny ] && VOCAB=(--vocab 512)
DATA=$DIR/shard.bin
[ -f "$DATA" ] || python3 tools/bench/make_shard.py "$DATA" --tokens $(( (STEPS + 2) * B * T + 1 )) \
  ${VOCAB[@]+"${VOCAB[@]}"} > /dev/null || exit 1
DEVICE=${DEVICE:-cuda}
if [ -z "${SKIP_PEFT:-}" ]; then
  timeout ${PEFT_TIMEOUT:-900} python3 tools/bench/peft_lora.py --model "$MODEL" -b "$B" -t "$T" --rank "$R" \
    --steps "$STEPS" --data "$DATA" --device "$DEVICE" > "$DIR/peft.log" 2>&1
  echo "peft: rc $? ($(grep -c '^step' "$DIR/peft.log") steps)"; tail -2 "$DIR/peft.log"
fi
base=(--lora-base-dtype bf16)
[[ " ${LOOM_FLAGS:-} " == *" --lora-base-dtype"[\ =]* ]] && base=()
for blocks in ${RECOMPUTE_BLOCKS:-all}; do
  extra=(); [ "$blocks" = all ] || extra=(--recompute-blocks "$blocks")
  run=$DIR/loom_$blocks
  rm -rf "$run"
  # shellcheck disable=SC2086
  timeout ${LOOM_TIMEOUT:-900} "$LOOM" --model "$MODEL" --device "$DEVICE" --dtype bf16 --train-data "$DATA" -b "$B" \
    -t "$T" --steps "$STEPS" --lora-rank "$R" --lora-alpha $((2 * R)) --lora-targets q,k,v,o,gate,up,down \
    ${base[@]+"${base[@]}"} --recompute "${RECOMPUTE:-full}" ${extra[@]+"${extra[@]}"} --eval-interval 0 \
    --sample-tokens 0 --warmup 2 --log-dir "$run" ${LOOM_FLAGS:-} > "$run.log" 2>&1
  echo "loom, recompute ${RECOMPUTE:-full} in $blocks blocks: rc $?"; tail -3 "$run.log"
  python3 - "$run/metrics.jsonl" "$DIR/peft.log" "$B" "$T" <<'PY'
import json, os, re, statistics, sys
metrics, peft_log, B, T = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
rows = [json.loads(l) for l in open(metrics) if l.startswith("{")] if os.path.exists(metrics) else []
ms = [r["perf/ms_per_step"] for r in rows if r.get("perf/ms_per_step") is not None]
ms = ms[5:] or ms
loom = B * T / (statistics.median(ms) / 1000) if ms else None
peak = max((r.get("perf/memory_peak_bytes") or 0 for r in rows), default=0) / 2**30
peft = re.search(r"RESULT peft tokens_per_s (\d+) peak_mem_mib (\d+)", open(peft_log).read()) if os.path.exists(peft_log) else None
print(f"loom tokens/s {loom:.0f} | loom peak {peak:.1f} GiB" if loom else "loom: no step times (see its log)")
if peft:
    print(f"peft tokens/s {peft.group(1)} | peft peak {int(peft.group(2)) / 1024:.1f} GiB")
    if loom: print(f"ratio loom / peft: {loom / int(peft.group(1)):.2f}x, memory {peak * 1024 / int(peft.group(2)):.2f}x")
PY
done
