#!/usr/bin/env bash
# The default model's three drafters trained on one GPU in a fixed time budget: self-distilled data
# (`specserve train data`), then the EAGLE3 head, the draft model and the MTP layer side by side on the
# same GPU (`specserve train eagle3|draft|mtp --device cuda`). What made the shipped weights of session 22.
#
#   scripts/train_drafters_gpu.sh MODEL.gguf DATA_DIR OUT_DIR [BUDGET_SECONDS] [DEVICE]
#
# DATA_DIR may hold prompts.jsonl and heldout.jsonl made beforehand (`build_prompts` of the machine whose
# standard library the held-out split was cut from); it is resumed. The answers come from specserve's engine;
# if its first shard fails or is slower than transformers' `generate` would be (MIN_ENGINE_TOK_S), from
# scripts/hf_answers.py. Every stage has a deadline inside BUDGET_SECONDS (default 540); OUT_DIR gets the
# three drafters, the logs and the data summary. EAGLE3_INIT / MTP_INIT: saved drafters to continue training.
set -u
gguf=$1 data=$2 out=$3 budget=${4:-540} device=${5:-cuda}
: "${ANSWERS_PER_PROMPT:=6}" "${CHUNK:=1024}" "${MAX_TOKENS:=192}" "${BATCH:=32}" "${SEQ:=512}"
: "${MIN_ENGINE_TOK_S:=8000}" "${DATA_SHARE:=0.42}" "${KV_GB:=32}" "${RECORD_TOKENS:=65536}"
: "${FIRST_SHARD_S:=100}" "${GENERATOR:=engine}" "${PARALLEL:=1}" "${SMOKE:=0}" "${LOAD_S:=110}"
: "${EAGLE3_INIT:=}" "${MTP_INIT:=}"
start=$SECONDS
left() { echo $(( budget - (SECONDS - start) )); }
log() { echo "[$(date -u +%T) +$((SECONDS - start))s] $*"; }
mkdir -p "$out" "$data"
py=python3
log "device $device; $($py -c 'import torch; print(torch.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else "no cuda")')"

target=$($py -c "import sys; from specserve.gguf.convert import converted_dir; print(converted_dir(sys.argv[1]))" "$gguf") || exit 3
log "target converted: $target"

data_args=(--target "$target" --out "$data" --resume --answers-per-prompt "$ANSWERS_PER_PROMPT" --chunk-size "$CHUNK"
           --max-tokens "$MAX_TOKENS" --device "$device" --max-batch-tokens "$RECORD_TOKENS" --kv-cache-memory-gb "$KV_GB")
shards() { $py -c "import json,sys; print(len(json.load(open(sys.argv[1]))['shards']))" "$data/training_summary.json" 2>/dev/null || echo 0; }
engine_tok_s() { $py -c "import json,sys; s=json.load(open(sys.argv[1]))['shards']['0']; print(int(s['answer_tokens']/s['generate_s']))" "$data/training_summary.json" 2>/dev/null || echo 0; }

# data: one shard with the engine, then the faster of the engine and transformers for the rest; or (GENERATOR=
# transformers) PARALLEL transformers processes on disjoint slices of the prompts, merged
data_deadline=$($py -c "import sys; print(int(float(sys.argv[1]) * int(sys.argv[2])))" "$DATA_SHARE" "$budget")
log "data until +${data_deadline}s"
minutes() { $py -c "import sys; print(max(0.01, (int(sys.argv[1]) - 60) / 60))" "$1"; }
here=$(dirname "$0")
if [ "$SMOKE" = 1 ]; then
    timeout 90 $py "$here/cuda_smoke.py" "$target" 16 64 "$device" >"$out/cuda_smoke.log" 2>&1 &
fi
if [ "$GENERATOR" = engine ]; then
    first=$(( data_deadline - (SECONDS - start) )); [ "$first" -gt "$FIRST_SHARD_S" ] && first=$FIRST_SHARD_S
    timeout "$first" $py -m specserve.train.cli train data "${data_args[@]}" --minutes 0.01 >"$out/data_engine.log" 2>&1
    rate=$(engine_tok_s)
    log "engine: $(shards) shard(s), $rate answer tok/s"
fi
if [ "$GENERATOR" = engine ] && [ "$rate" -ge "$MIN_ENGINE_TOK_S" ]; then
    timeout $(( data_deadline - (SECONDS - start) )) $py -m specserve.train.cli train data "${data_args[@]}" \
        --minutes "$(minutes $(( data_deadline - (SECONDS - start) )))" >>"$out/data_engine.log" 2>&1
else
    log "answers from transformers' generate, $PARALLEL process(es)"
    parts=()
    for j in $(seq 0 $(( PARALLEL - 1 ))); do
        part="$data.part$j"; parts+=("$part"); mkdir -p "$part"
        $py -c "import sys; lines = open(sys.argv[1]).readlines(); open(sys.argv[2], 'w').writelines(lines[int(sys.argv[3])::int(sys.argv[4])])" \
            "$data/prompts.jsonl" "$part/prompts.jsonl" "$j" "$PARALLEL"
        cp "$data/heldout.jsonl" "$part/"
        part_args=("${data_args[@]}"); part_args[3]="$part"
        # few CPU threads each: six processes with torch's default (every core) stalled one another (session 22)
        OMP_NUM_THREADS=$(( $(nproc) / PARALLEL > 0 ? $(nproc) / PARALLEL : 1 )) \
        timeout $(( data_deadline - (SECONDS - start) )) $py "$here/hf_answers.py" "${part_args[@]}" --seed "$j" \
            --minutes "$(minutes $(( data_deadline - (SECONDS - start) )))" >"$out/data_hf$j.log" 2>&1 &
    done
    wait
    $py "$here/merge_data.py" "$data" "${parts[@]}" >"$out/merge.log" 2>&1
fi
log "data: $(shards) shards"
cp "$data/training_summary.json" "$out/data_summary.json" 2>/dev/null
[ "$(shards)" -ge 1 ] || { log "no data"; exit 4; }

# the three drafters side by side; each keeps 45 s for loading and 30 s for saving inside the budget
train_minutes=$($py -c "import sys; print(round(max(0.5, (int(sys.argv[1]) - 75) / 60), 2))" "$(left)")
log "training ${train_minutes} min each"
common=(--target "$target" --data "$data" --device "$device" --batch-size "$BATCH" --seq-len "$SEQ" --minutes "$train_minutes")
hard=$(( $(left) - 10 ))
e3_init=(--draft-vocab-size 2600 --intermediate-size 896); [ -n "$EAGLE3_INIT" ] && e3_init=(--init "$EAGLE3_INIT")
mtp_init=(); [ -n "$MTP_INIT" ] && mtp_init=(--init "$MTP_INIT")
timeout "$hard" $py -m specserve.train.cli train eagle3 "${common[@]}" --out "$out/eagle3" "${e3_init[@]}" \
    >"$out/eagle3.log" 2>&1 &
# the draft model overfits small data (850 epochs of 230k tokens in session 22): DRAFT_MINUTES caps it
timeout "$hard" $py -m specserve.train.cli train draft "${common[@]}" --minutes "${DRAFT_MINUTES:-$train_minutes}" \
    --out "$out/draft" >"$out/draft.log" 2>&1 &
timeout "$hard" $py -m specserve.train.cli train mtp "${common[@]}" --out "$out/mtp" "${mtp_init[@]}" >"$out/mtp.log" 2>&1 &
wait
for kind in eagle3 draft mtp; do
    log "$kind: $(ls "$out/$kind" 2>/dev/null | tr '\n' ' ') $(grep -o '"final_loss": [0-9.]*\|"last_loss": [0-9.]*' "$out/$kind/training_summary.json" 2>/dev/null)"
done
log "done"
