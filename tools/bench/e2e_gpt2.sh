#!/usr/bin/env bash
# End-to-end training benchmark, GPT-2 or LLaMA-3: Loom's loom-train and the PyTorch reference
# (tools/bench/pytorch_gpt2.py, or tools/bench/pytorch_llama.py for MODEL=llama3-*) on the same llm.c shard, one after
# the other on the same GPU, then a table of tokens/s, MFU, peak memory, the ratio Loom/PyTorch and both loss curves.
# Run from the repository root on a GPU machine after building (build-dev/ by tools/device/build.sh). Options
# (environment): MODEL (124m, 350m or 774m for GPT-2; llama3-1b, mixtral-1b, or llama3-tiny / mixtral-tiny for a smoke test), B (16 for GPT-2, 4
# for LLaMA), T (1024 for GPT-2, 2048 for LLaMA, 256 for llama3-tiny), STEPS (30), DATA (a shard; default: a synthetic
# Markov-chain shard from tools/bench/make_shard.py), LOOM (build-dev/loom-train), DIR (where logs go; default
# $OUT/e2e or /tmp/e2e), PROFILE=1 to also take Loom's per-op breakdown of one step (tools/bench/op_profile.py),
# SKIP_TORCH=1 to run Loom alone. SAME_INIT=1 starts both from the same weights: PyTorch writes its initial weights
# (--save-init: f32 safetensors, Hugging Face names) to INIT_FILE (default /tmp/e2e_init_$MODEL.safetensors, outside
# $OUT and $DIR: 0.5 GB for 124m, 4.9 GB for llama3-1b) and loom-train starts from them (--init-from), so the loss
# curves compare step by step (with SKIP_TORCH=1 an existing file is reused).
# LOOM_FLAGS: more loom-train flags for both Loom runs (e.g. --recompute-mlp); TORCH_FLAGS: more flags for the
# PyTorch script (e.g. --repeat-kv for LLaMA). LOOM_TIMEOUT: seconds per Loom run (200 for GPT-2, 300 for LLaMA).
# FP8: FP8 scopes of loom-train's --fp8 (classifier, linear, all; e.g. FP8='linear all') to run after the bf16 run, each
# with --dtype bf16 --fp8 SCOPE and FP8_FLAGS (e.g. --fp8-amax-history 16) on the same data and initial weights, and
# again with --fp8-fast-accumulation NAME for each NAME in FP8_FAST (e.g. FP8_FAST='input all'). RUNS=N (default 1)
# makes Loom's bf16 run and each FP8 run N times with the same settings: the GPU's step is not bit for bit repeatable,
# so the runs of one recipe spread, and the picture's comparison takes each recipe's runs as a group against bf16's
# spread. EVAL_INTERVAL=N evaluates every N steps (--val-data in LOOM_FLAGS; default 0, at the end only); the
# table then has a row per scope beside Loom's bf16 (tokens/s, ratio to Loom bf16 and to PyTorch) and the loss
# difference from the bf16 run step by step. With PROFILE=1 the first scope is profiled too. GRAPH=1 also runs Loom's
# bf16 step as a CUDA graph (--cuda-graph) and reports it the same way (a graph replays the eager step's bits, so its
# losses equal the bf16 run's), and with FP8 each FP8 scope as a graph too.
# With FP8 the loss curves of the bf16 run and each scope are drawn on one picture, loss_$MODEL_b$B_fp8.png in DIR,
# and each scope's mean loss over windows of LOSS_WINDOW steps (default STEPS / 10) compared with bf16's, those
# window means also drawn in percent from bf16's (loss_$MODEL_b$B_fp8_relative.png).
set -uo pipefail
STEPS=${STEPS:-30}; MODEL=${MODEL:-124m}
case "$MODEL" in gpt2) MODEL=124m ;; gpt2-*) MODEL=${MODEL#gpt2-} ;; esac  # GPT-2 by Loom's names too
case "$MODEL" in
  llama*|mixtral*) LOOM_MODEL=$MODEL; TORCH_SCRIPT=tools/bench/pytorch_llama.py; B=${B:-4}
          case $MODEL in *-tiny) T=${T:-256} ;; *) T=${T:-2048} ;; esac
          LOOM_TIMEOUT=${LOOM_TIMEOUT:-300} ;;
  124m|350m|774m) LOOM_MODEL=gpt2-$MODEL; TORCH_SCRIPT=tools/bench/pytorch_gpt2.py; B=${B:-16}; T=${T:-1024}
     LOOM_TIMEOUT=${LOOM_TIMEOUT:-200} ;;
  *) echo "e2e_gpt2.sh: unknown MODEL '$MODEL' (expected 124m, 350m, 774m or gpt2, llama3-*, mixtral-*)" >&2; exit 2 ;;
esac
RUNS=${RUNS:-1}
[[ $RUNS =~ ^[1-9][0-9]*$ ]] || { echo "e2e_gpt2.sh: RUNS must be a whole number of 1 or more, not '$RUNS'" >&2; exit 2; }
LOOM=${LOOM:-build-dev/loom-train}
DIR=${DIR:-${OUT:-/tmp}/e2e}
mkdir -p "$DIR"
DATA=${DATA:-}
if [ -z "$DATA" ]; then
  DATA=/tmp/e2e_shard.bin; VOCAB=()
  case $MODEL in  # tokens within the model's vocabulary
    *-tiny) DATA=/tmp/e2e_shard_v512.bin; VOCAB=(--vocab 512) ;;
    mixtral-1b) DATA=/tmp/e2e_shard_v32000.bin; VOCAB=(--vocab 32000) ;;
  esac
  need=$(( (STEPS + 2) * B * T + 1 ))
  [ -f $DATA ] || python3 tools/bench/make_shard.py $DATA --tokens $(( need > 2000000 ? need : 2000000 )) \
    ${VOCAB[@]+"${VOCAB[@]}"} || exit 1
fi
SAME_INIT=${SAME_INIT:-0}
INIT=${INIT_FILE:-/tmp/e2e_init_${MODEL}.safetensors}
SAVE_INIT=(); INIT_FROM=()
if [ "$SAME_INIT" = 1 ]; then
  SAVE_INIT=(--save-init "$INIT"); INIT_FROM=(--init-from "$INIT")
  [ "${SKIP_TORCH:-0}" = 1 ] || rm -f "$INIT"  # never start Loom from a stale file
fi
echo "== device: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1)"

if [ "${SKIP_TORCH:-0}" != 1 ]; then
  echo "== pytorch: $LOOM_MODEL bf16 B=$B T=$T steps=$STEPS"
  PYTHONUNBUFFERED=1 python3 $TORCH_SCRIPT --model $MODEL -b $B -t $T --steps $STEPS --data "$DATA" ${TORCH_FLAGS:-} \
    ${SAVE_INIT[@]+"${SAVE_INIT[@]}"} 2>&1 | grep -v Warning | tee "$DIR/torch_${MODEL}_b$B.log"
fi

if [ "$SAME_INIT" = 1 ] && [ ! -s "$INIT" ]; then
  echo "SAME_INIT=1: no initial weights at $INIT (the PyTorch run did not write them)"; exit 1
fi
echo "== loom: $LOOM_MODEL bf16 B=$B T=$T steps=$STEPS${INIT_FROM[@]+ (--init-from $INIT)}"
timeout $LOOM_TIMEOUT "$LOOM" --model $LOOM_MODEL --dtype bf16 -b $B -t $T --steps $STEPS --device cuda --eval-interval ${EVAL_INTERVAL:-0} \
  --sample-tokens 0 --train-data "$DATA" ${LOOM_FLAGS:-} ${INIT_FROM[@]+"${INIT_FROM[@]}"} --log-dir "$DIR/loom_${MODEL}_b$B" 2>&1 | tee "$DIR/loom_${MODEL}_b$B.log"

FP8_SCOPES=(${FP8:-})
# The variants run after Loom's bf16 run on the same data and weights, each "label|log suffix|loom-train flags".
VARIANTS=()
for scope in ${FP8_SCOPES[@]+"${FP8_SCOPES[@]}"}; do VARIANTS+=("fp8 $scope|_fp8_$scope|--fp8 $scope ${FP8_FLAGS:-}"); done
# FP8_FAST: more runs of each scope with --fp8-fast-accumulation NAME (e.g. FP8_FAST='input all').
for scope in ${FP8_SCOPES[@]+"${FP8_SCOPES[@]}"}; do
  for fast in ${FP8_FAST:-}; do
    VARIANTS+=("fp8 $scope fast $fast|_fp8_${scope}_fast_$fast|--fp8 $scope ${FP8_FLAGS:-} --fp8-fast-accumulation $fast")
  done
done
# RUNS=N: bf16 and each recipe above N times in all, the repeats after the first runs (same label, suffix _runK).
recipes=("bf16||" ${VARIANTS[@]+"${VARIANTS[@]}"})
for ((k = 2; k <= RUNS; k++)); do
  for recipe in "${recipes[@]}"; do
    IFS='|' read -r label suffix flags <<< "$recipe"
    VARIANTS+=("$label|${suffix}_run$k|$flags")
  done
done
if [ "${GRAPH:-0}" = 1 ]; then
  VARIANTS+=("graph|_graph|--cuda-graph")
  for scope in ${FP8_SCOPES[@]+"${FP8_SCOPES[@]}"}; do
    VARIANTS+=("fp8 $scope graph|_fp8_${scope}_graph|--fp8 $scope ${FP8_FLAGS:-} --cuda-graph")
  done
fi
for variant in ${VARIANTS[@]+"${VARIANTS[@]}"}; do
  IFS='|' read -r label suffix flags <<< "$variant"
  echo "== loom: $LOOM_MODEL bf16 $flags B=$B T=$T steps=$STEPS"
  # shellcheck disable=SC2086
  timeout $LOOM_TIMEOUT "$LOOM" --model $LOOM_MODEL --dtype bf16 $flags -b $B -t $T --steps $STEPS \
    --device cuda --eval-interval ${EVAL_INTERVAL:-0} --sample-tokens 0 --train-data "$DATA" ${LOOM_FLAGS:-} ${INIT_FROM[@]+"${INIT_FROM[@]}"} \
    --log-dir "$DIR/loom_${MODEL}_b${B}$suffix" 2>&1 | tee "$DIR/loom_${MODEL}_b${B}$suffix.log"
done

if [ "${PROFILE:-0}" = 1 ]; then
  # One profiled run of 7 steps; loom-train resets the table after the first (warm-up), so it covers 6 steps (and the
  # one batch of the final evaluation). LOOM_PROFILE_OPS=shapes splits rows by shape.
  LOOM_PROFILE_OPS=${PROFILE_MODE:-1} LOOM_PROFILE_OPS_FILE="$DIR/profile_${MODEL}_b${B}.tsv" timeout $LOOM_TIMEOUT "$LOOM" \
    --model $LOOM_MODEL --dtype bf16 -b $B -t $T --steps 7 --warmup 1 --device cuda --eval-interval 0 --sample-tokens 0 \
    --eval-batches 1 --train-data "$DATA" ${LOOM_FLAGS:-} ${INIT_FROM[@]+"${INIT_FROM[@]}"} > "$DIR/profile_${MODEL}_b$B.log" 2>&1
  grep "peak device memory" "$DIR/profile_${MODEL}_b$B.log"
  python3 tools/bench/op_profile.py - "$DIR/profile_${MODEL}_b$B.tsv" 6 | tee "$DIR/breakdown_${MODEL}_b$B.txt"
  if [ ${#FP8_SCOPES[@]} -gt 0 ]; then
    P="$DIR/profile_${MODEL}_b${B}_fp8_${FP8_SCOPES[0]}"
    LOOM_PROFILE_OPS=${PROFILE_MODE:-1} LOOM_PROFILE_OPS_FILE="$P.tsv" timeout $LOOM_TIMEOUT "$LOOM" --model $LOOM_MODEL \
      --dtype bf16 --fp8 ${FP8_SCOPES[0]} ${FP8_FLAGS:-} -b $B -t $T --steps 7 --warmup 1 --device cuda --eval-interval 0 \
      --sample-tokens 0 --eval-batches 1 --train-data "$DATA" ${LOOM_FLAGS:-} ${INIT_FROM[@]+"${INIT_FROM[@]}"} > "$P.log" 2>&1
    grep "peak device memory" "$P.log"
    python3 tools/bench/op_profile.py - "$P.tsv" 6 | tee "$DIR/breakdown_${MODEL}_b${B}_fp8_${FP8_SCOPES[0]}.txt"
  fi
fi

python3 - "$DIR/loom_${MODEL}_b$B/metrics.jsonl" "$DIR/torch_${MODEL}_b$B.log" "$DIR/profile_${MODEL}_b$B.log" \
  $B $T $MODEL $SAME_INIT "$DIR" "$(for v in ${VARIANTS[@]+"${VARIANTS[@]}"}; do IFS='|' read -r l x _ <<< "$v"; printf '%s|%s;' "$l" "$x"; done)" <<'PY'
import json, math, re, statistics, sys, os
loom_log, torch_log, prof_log, B, T, model, same_init, out_dir, variants = sys.argv[1:10]
B, T = int(B), int(T)
GPT2 = {"124m": (12, 12, 768), "350m": (24, 16, 1024), "774m": (36, 20, 1280)}
# LLaMA: layers, heads, kv heads, dim, ffn, vocab (unpadded: Loom's padded_vocab_size for LLaMA), tied embeddings
LLAMA = {"llama3-1b": (16, 32, 8, 2048, 8192, 128256, True), "llama3-3b": (28, 24, 8, 3072, 8192, 128256, True),
         "llama3-8b": (32, 32, 8, 4096, 14336, 128256, False),
         "llama3-tiny": (2, 4, 2, 64, 160, 512, False),
         "mixtral-1b": (16, 32, 8, 2048, 4096, 32000, False), "mixtral-tiny": (2, 4, 2, 64, 128, 512, False)}
MOE = {"mixtral-1b": (8, 2), "mixtral-tiny": (4, 2)}  # experts, top k: the active MLP is k experts plus the router
if model in LLAMA:  # Loom's active parameters: the tied embedding once; no biases; RMSNorm weights only
    L, H, KV, C, FFN, V, tied = LLAMA[model]
    kv_dim = KV * (C // H)
    E, K = MOE.get(model, (0, 1))
    params = V * C * (1 if tied else 2) + L * (2 * C * C + 2 * C * kv_dim + K * 3 * C * FFN + E * C + 2 * C) + C
    label = f"LLaMA {model}"
else:
    L, H, C = GPT2[model]
    params = 50304 * C + 1024 * C + L * (12 * C * C + 13 * C) + 2 * C
    label = f"GPT-2 {model}"
flops_per_token = 6 * params + 6 * L * C * T
WARM = 5
def read(path, pat):
    if not os.path.exists(path): return [], []
    ms, loss = [], []
    for line in open(path):
        m = re.search(pat, line)
        if m: loss.append(float(m.group(1))); ms.append(float(m.group(2)))
    return ms, loss
def read_metrics(path):  # loom-train's metrics.jsonl: full-precision step times and losses, of its last run only
    ms, loss = [], []  # (loom-train appends to a log dir's metrics.jsonl after a run_start line)
    if os.path.exists(path):
        for line in open(path):
            j = json.loads(line)
            if j.get("run_start"):
                ms, loss = [], []
            if j.get("perf/ms_per_step") is not None:
                ms.append(j["perf/ms_per_step"]); loss.append(j["train/loss"] if j["train/loss"] is not None else float("nan"))
    return ms, loss
lms, lloss = read_metrics(loom_log)
tms, tloss = read(torch_log, r"^step\s+\d+/\d+ \| loss ([\d.naninf]+) .*\|\s+([\d.]+) ms")
def mib(path, pat):
    if not os.path.exists(path): return None
    for line in open(path):
        m = re.search(pat, line)
        if m: return float(m.group(1))
rows = []
for name, ms, mem in (("loom", lms, mib(prof_log, r"peak device memory allocated: ([\d.]+) MiB")),
                      ("pytorch", tms, mib(torch_log, r"peak_mem_mib (\d+)"))):
    if not ms: rows.append((name, None, None, mem)); continue
    tok = B * T / (statistics.median(ms[WARM:] or ms) / 1000)
    rows.append((name, tok, flops_per_token * tok / 989e12 * 100, mem))
print(f"\n== {label}, bf16, B={B}, T={T}, {len(lms)} Loom / {len(tms)} PyTorch steps; "
      f"{'same initial weights' if same_init == '1' else 'each framework initialized on its own'}; "
      f"median over steps > {WARM}; MFU = (6N + 6LCT) tokens/s / 989 TFLOP/s, N = {params}")
print(f"{'':10}{'tokens/s':>12}{'MFU %':>8}{'peak MiB':>10}")
for name, tok, mfu, mem in rows:
    f = lambda v, fmt: format(v, fmt) if v is not None else "-".rjust(int(fmt.split(".")[0]))
    print(f"{name:10}{f(tok, '12.0f')}{f(mfu, '8.1f')}{f(mem, '10.0f')}")
if rows[0][1] and rows[1][1]:
    print(f"{'ratio':10}{rows[0][1] / rows[1][1]:12.3f}{'':8}"
          f"{(rows[0][3] / rows[1][3]) if rows[0][3] and rows[1][3] else float('nan'):10.3f}   (Loom / PyTorch)")
for variant in filter(None, variants.split(";")):
    label, suffix = variant.split("|")
    base = f"{out_dir}/loom_{model}_b{B}{suffix}"
    repeat = re.search(r"_run(\d+)$", suffix)
    if repeat: label += f" #{repeat.group(1)}"
    fms, floss = read_metrics(f"{base}/metrics.jsonl")
    if not fms:
        print(f"{label:10}: no steps (see {base}.log)"); continue
    tok = B * T / (statistics.median(fms[WARM:] or fms) / 1000)
    mem = mib(f"{out_dir}/profile_{model}_b{B}{suffix}.log", r"peak device memory allocated: ([\d.]+) MiB")
    line = f"{label:10}{tok:12.0f}{flops_per_token * tok / 989e12 * 100:8.1f}" + (f"{mem:10.0f}" if mem else f"{'-':>10}")
    if rows[0][1]: line += f"   {tok / rows[0][1]:.3f}x Loom bf16"
    if rows[1][1]: line += f", {tok / rows[1][1]:.3f}x PyTorch"
    print(line + " (MFU against the bf16 peak)")
    n = min(len(lloss), len(floss))
    rel = [(abs(a - b) / abs(b), i + 1) for i, (a, b) in enumerate(zip(floss[:n], lloss[:n])) if math.isfinite(a) and math.isfinite(b) and b]
    if rel:
        worst, at = max(rel[WARM:] or rel)
        print(f"    loss vs Loom bf16 over {n} steps: max relative difference after step {WARM} {worst * 100:.2f}% (step {at}), "
              f"last step {floss[n - 1]:.4f} vs {lloss[n - 1]:.4f}" + (f"; {n - len(rel)} steps not finite" if len(rel) < n else ""))
if lloss and tloss:
    n = min(len(lloss), len(tloss))
    print("loss  step: " + " ".join(f"{i + 1:>6}" for i in range(0, n, max(1, n // 10))))
    print("      loom: " + " ".join(f"{lloss[i]:6.3f}" for i in range(0, n, max(1, n // 10))))
    print("   pytorch: " + " ".join(f"{tloss[i]:6.3f}" for i in range(0, n, max(1, n // 10))))
    diffs = [(abs(a - b), i + 1) for i, (a, b) in enumerate(zip(lloss[:n], tloss[:n]))]
    finite = [d for d in diffs if math.isfinite(d[0])]
    if finite:
        d, at = max(finite)
        print(f"max |loom - pytorch| loss over {len(finite)} steps: {d:.4f} (step {at}); "
              f"first step {diffs[0][0]:.4f}, last {diffs[-1][0]:.4f}"
              + (f"; {n - len(finite)} steps not finite" if len(finite) < n else "")
              + ("" if same_init == "1" else " (different initial weights: SAME_INIT=1 for a step-by-step comparison)"))
    else:
        print(f"max |loom - pytorch| loss: no finite step among {n}")
PY
# The loss curves of Loom's bf16 run and each FP8 scope on one picture (tools/plot_loss.py; WARMUP_STEPS, default a
# tenth of the steps, are left out of the largest difference it prints). A recipe's repeats share its label, which
# makes them a group there.
if [ ${#FP8_SCOPES[@]} -gt 0 ] || [ "$RUNS" -gt 1 ]; then
  runs=("$DIR/loom_${MODEL}_b$B"); labels=(--label bf16)
  for variant in "${VARIANTS[@]}"; do  # the runs made above, but the graphs (each replays its eager run's bits)
    IFS='|' read -r label suffix _ <<< "$variant"
    [[ $suffix == *_graph ]] && continue
    runs+=("$DIR/loom_${MODEL}_b${B}$suffix"); labels+=(--label "$label")
  done
  plot=(python3 tools/plot_loss.py "${runs[@]}" "${labels[@]}" --warmup "${WARMUP_STEPS:-$((STEPS / 10))}"
        --window "${LOSS_WINDOW:-$((STEPS >= 10 ? STEPS / 10 : 1))}")
  "${plot[@]}" --title "$MODEL B=$B bf16 and fp8" -o "$DIR/loss_${MODEL}_b${B}_fp8.png"
  # The same runs' window means in percent from bf16's (the mean of its runs with RUNS), where a few percent shows.
  "${plot[@]}" --relative --title "$MODEL B=$B against bf16" -o "$DIR/loss_${MODEL}_b${B}_fp8_relative.png" |
    grep "wrote"
fi
