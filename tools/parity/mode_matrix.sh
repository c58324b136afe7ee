#!/usr/bin/env bash
# Trains a tiny GPT-2, a tiny LLaMA-3 and a tiny Mixtral under every parallel mode and combination loom-train offers on the CPU
# (mpirun with 1, 2 and 4 ranks) and writes each run's per-step loss, gradient norm and evaluation loss with every
# digit, one JSON line per run, into OUT. Two such files from two builds compare with tools/parity/compare.py: the
# same bits mean the two builds train alike in every mode.
#
#   tools/parity/mode_matrix.sh before.jsonl            # build/ as it is
#   LOOM_BUILD_DIR=build-other tools/parity/mode_matrix.sh after.jsonl
#   python3 tools/parity/compare.py before.jsonl after.jsonl
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=$(realpath -m "$1")
BIN=${LOOM_BUILD_DIR:-build}/loom-train
ONLY=${2:-}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
python3 tools/bench/make_shard.py "$WORK/train.bin" --tokens 40000 --vocab 250 > /dev/null
python3 tools/bench/make_shard.py "$WORK/val.bin" --tokens 4000 --vocab 250 --seed 7 > /dev/null
cat > "$WORK/gpt2.json" <<'J'
{"family": "gpt2", "vocab_size": 250, "padded_vocab_size": 256, "max_seq_len": 32, "n_layer": 4, "n_head": 4, "n_embd": 64}
J
cat > "$WORK/llama.json" <<'J'
{"family": "llama", "vocab_size": 250, "padded_vocab_size": 256, "max_seq_len": 32, "n_layer": 4, "n_head": 4,
 "n_kv_head": 2, "n_embd": 64, "ffn_hidden": 160, "tie_embeddings": false}
J
cat > "$WORK/mixtral.json" <<'J'
{"family": "llama", "vocab_size": 250, "padded_vocab_size": 256, "max_seq_len": 32, "n_layer": 2, "n_head": 4,
 "n_kv_head": 2, "n_embd": 64, "ffn_hidden": 96, "tie_embeddings": false, "num_experts": 4, "experts_per_token": 2}
J
: > "$OUT"
MPIRUN="mpirun --oversubscribe --allow-run-as-root -x OMP_NUM_THREADS=1"
COMMON="--train-data $WORK/train.bin --val-data $WORK/val.bin -b 2 -t 16 --total-batch-tokens 256 --lr 3e-3
  --warmup 1 --eval-interval 2 --eval-batches 2 --sample-tokens 0 --seed 1337"

# run NAME RANKS MODEL FLAGS...
run() {
  local name=$1 np=$2 model=$3
  shift 3
  if [ -n "$ONLY" ] && [[ "$name" != $ONLY ]]; then return; fi
  local dir="$WORK/$name"
  rm -rf "$dir"
  mkdir -p "$dir"
  if ! $MPIRUN -np "$np" "$BIN" --model "$WORK/$model.json" $COMMON --steps 4 --log-dir "$dir/logs" "$@" \
      > "$dir/out.txt" 2>&1; then
    echo "{\"run\": \"$name\", \"error\": $(tail -3 "$dir/out.txt" | python3 -c 'import json,sys; print(json.dumps(sys.stdin.read()))')}" >> "$OUT"
    echo "FAILED $name"
    return
  fi
  python3 - "$name" "$dir/logs/metrics.jsonl" >> "$OUT" <<'P'
import json, sys
steps = {}
for line in open(sys.argv[2]):
    j = json.loads(line)
    if j.get("run_start"):
        continue
    s = steps.setdefault(str(j["step"]), {})
    for k in ("train/loss", "train/grad_norm", "val/loss"):
        if k in j:
            s[k] = repr(j[k])
print(json.dumps({"run": sys.argv[1], "steps": steps}))
P
  echo "ok     $name"
}

# resume NAME SAVE_RANKS "SAVE FLAGS" RESUME_RANKS "RESUME FLAGS": saves at step 2, resumes to step 4.
resume() {
  local name=$1 np_save=$2 save_flags=$3 np_resume=$4 resume_flags=$5
  if [ -n "$ONLY" ] && [[ "$name" != $ONLY ]]; then return; fi
  local ckpt="$WORK/$name.ckpt"
  rm -rf "$ckpt"
  $MPIRUN -np "$np_save" "$BIN" --model "$WORK/gpt2.json" $COMMON --steps 2 --checkpoint-dir "$ckpt" $save_flags \
    > "$WORK/$name.save.txt" 2>&1 || { echo "FAILED $name (save): $(tail -2 "$WORK/$name.save.txt")"; return; }
  run "$name" "$np_resume" gpt2 --resume "$ckpt" $resume_flags
}

for model in gpt2 llama; do
  run "$model-1" 1 $model
  run "$model-1-recompute-full" 1 $model --recompute full
  run "$model-1-recompute-selective" 1 $model --recompute selective
  run "$model-1-zero1" 1 $model --zero 1
  run "$model-1-zero2" 1 $model --zero 2
  run "$model-1-zero3" 1 $model --zero 3
  run "$model-2-ddp" 2 $model
  run "$model-2-zero1" 2 $model --zero 1
  run "$model-2-zero2" 2 $model --zero 2
  run "$model-2-zero3" 2 $model --zero 3
  run "$model-2-zero3-full" 2 $model --zero 3 --recompute full
  run "$model-2-zero3-selective" 2 $model --zero 3 --recompute selective
  run "$model-2-tp" 2 $model --tp 2
  run "$model-2-tp-sp" 2 $model --tp 2 --sp
  run "$model-2-pp-gpipe" 2 $model --pp 2 --pp-schedule gpipe
  run "$model-2-pp-1f1b" 2 $model --pp 2
  run "$model-2-pp-interleaved" 2 $model --pp 2 --pp-schedule interleaved --virtual-stages 2
  run "$model-4-tp-ddp" 4 $model --tp 2
  run "$model-4-tp-zero1" 4 $model --tp 2 --zero 1
  run "$model-4-tp-zero3" 4 $model --tp 2 --zero 3
  run "$model-4-tp-sp-ddp" 4 $model --tp 2 --sp
  run "$model-4-pp-tp" 4 $model --pp 2 --tp 2
  run "$model-4-pp-dp-interleaved" 4 $model --pp 2 --pp-schedule interleaved --virtual-stages 2
  run "$model-4-pp-tp-sp" 4 $model --pp 2 --tp 2 --sp
done
run gpt2-1-recompute-mlp 1 gpt2 --recompute-mlp
run gpt2-2-ddp-bf16-reduce 2 gpt2 --reduce-dtype bf16
run gpt2-2-ddp-small-buckets 2 gpt2 --bucket-mb 1
run gpt2-2-pp-zero1 2 gpt2 --pp 2 --zero 1
run gpt2-4-zero2 4 gpt2 --zero 2
run gpt2-4-pp-dp-zero1 4 gpt2 --pp 2 --zero 1
run gpt2-2-zero3-bf16 2 gpt2 --zero 3 --dtype bf16
run gpt2-2-tp-bf16 2 gpt2 --tp 2 --dtype bf16
run gpt2-2-ddp-bf16 2 gpt2 --dtype bf16
run gpt2-2-zero2-bf16-reduce 2 gpt2 --zero 2 --reduce-dtype bf16
# LoRA: adapters on every projection, the base frozen, under one process and the data-parallel modes.
LORA="--lora-rank 4 --lora-targets q,k,v,o,gate,up,down"
run llama-1-lora 1 llama $LORA
run llama-2-lora-ddp 2 llama $LORA
run llama-2-lora-zero1 2 llama $LORA --zero 1
run llama-2-lora-zero2 2 llama $LORA --zero 2
run llama-2-lora-zero3 2 llama $LORA --zero 3
# GPT-2's four adapted layers (c_attn, attn.c_proj, c_fc, mlp.c_proj), the tied embedding frozen on both stages under --pp.
GPT2_LORA="--lora-rank 4 --lora-targets c_attn,c_proj,c_fc"
run gpt2-1-lora 1 gpt2 $GPT2_LORA
run gpt2-2-lora-ddp 2 gpt2 $GPT2_LORA
run gpt2-2-lora-pp 2 gpt2 $GPT2_LORA --pp 2
# A mixture of experts: data-parallel, and its experts split over the data ranks (--ep; with --zero 1/2/3 the
# experts' state, and with 2/3 their gradients and weights, are sharded over their replicas).
run mixtral-1 1 mixtral
run mixtral-2-ddp 2 mixtral
run mixtral-2-zero1 2 mixtral --zero 1
run mixtral-2-ep 2 mixtral --ep 2
run mixtral-4-ep2-ddp 4 mixtral --ep 2
run mixtral-4-ep4 4 mixtral --ep 4
run mixtral-2-ep-zero1 2 mixtral --ep 2 --zero 1
run mixtral-4-ep2-zero1 4 mixtral --ep 2 --zero 1
run mixtral-4-ep4-zero1 4 mixtral --ep 4 --zero 1
run mixtral-2-ep-zero3 2 mixtral --ep 2 --zero 3
run mixtral-4-ep2-zero2 4 mixtral --ep 2 --zero 2
run mixtral-4-ep2-zero3 4 mixtral --ep 2 --zero 3
resume resume-zero3x2-to-1 2 "--zero 3" 1 ""
resume resume-zero3x2-to-zero3x4 2 "--zero 3" 4 "--zero 3"
resume resume-zero3x2-to-ddp4 2 "--zero 3" 4 "--zero 0"
resume resume-zero3x2-to-tp2 2 "--zero 3" 2 "--tp 2 --zero 0"
resume resume-tp2-to-pp2 2 "--tp 2" 2 "--pp 2 --tp 1"
resume resume-pp2-to-zero1 2 "--pp 2" 2 "--pp 1 --zero 1"
resume resume-single-file-1 1 "--checkpoint-format single" 1 ""
# A single file resumes with the layout that saved it.
resume resume-single-file-zero1x2 2 "--zero 1 --checkpoint-format single" 2 "--zero 1"
resume resume-single-file-tp2 2 "--tp 2 --checkpoint-format single" 2 "--tp 2"
resume resume-single-file-zero3x2 2 "--zero 3 --checkpoint-format single" 2 "--zero 3"
