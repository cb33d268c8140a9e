#!/usr/bin/env bash
# The GPU check (issue 13, item 6): everything this project measures on a GPU, in under 8 minutes on one.
#
#   scripts/gpu_check.sh OUT_DIR            (or: make gpu-check GPU_OUT=OUT_DIR)
#
# Steps, each with its own time limit, each writing JSON under OUT_DIR:
#   1. serve --device cuda, and one generation through it       -> serve.json
#   2. bench spec, 5 prompts, 0 and 80 ms, the tree without and with the draft head
#                                                                 -> spec/speculative.json (+ .md)
#   3. blocks in flight on a GPU cloud (issue 18's fast cloud, for real): bench spec at 80 ms, D = 1, 2, auto
#                                                                 -> inflight/speculative.json (+ .md)
#   4. a short bench batch on the device                          -> batch/batching.json (+ .md)
#   5. drafter training throughput with a tiny --tokens           -> train/ (drafter train's own manifest)
# and OUT_DIR/summary.json: every step's status, seconds and exit code.
#
# It fails loudly: a step that fails or cannot run (no CUDA, no head strategy, no drafter train command)
# is recorded as such, every later step still runs, and the script exits non-zero naming them. Nothing is
# skipped in silence. A shard without an installed draft head (`splitinfer prepare` installs the shipped
# one) is recorded as missing too. For a dry run on a machine without a GPU: DEVICE=cpu with small sizes, e.g.
#   DEVICE=cpu MAX_NEW_TOKENS=8 BATCH_SIZES=1,4 LIMIT_SCALE=4 scripts/gpu_check.sh /tmp/gpu-dry
# Knobs (environment): DEVICE (cuda), SHARDS (shards/smollm2), SPLITINFER (the CLI), PYTHON (its
# interpreter), MAX_NEW_TOKENS (64), BATCH_SIZES (1,16,64), TRAIN_TOKENS (20000), LIMIT_SCALE (1).
set -u -o pipefail

OUT=${1:?usage: scripts/gpu_check.sh OUT_DIR}
DEVICE=${DEVICE:-cuda}
SHARDS=${SHARDS:-shards/smollm2}
SPLITINFER=${SPLITINFER:-splitinfer}
PYTHON=${PYTHON:-python3}
MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-64}
BATCH_SIZES=${BATCH_SIZES:-1,16,64}
TRAIN_TOKENS=${TRAIN_TOKENS:-20000}
LIMIT_SCALE=${LIMIT_SCALE:-1}  # multiplies every step's time limit (a CPU dry run needs more than a GPU)
mkdir -p "$OUT"
STATUS="$OUT/status.tsv"
: > "$STATUS"
START=$(date +%s)

record() {  # name status seconds rc detail
    printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "$5" >> "$STATUS"
    echo "gpu-check: $1: $2 ($3 s, rc $4) $5" >&2
}

step() {  # name limit_s command...: run it, record ok/failed with its time and exit code
    local name=$1 limit=$(( $2 * LIMIT_SCALE ))
    shift 2
    local t0=$(date +%s)
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    local dt=$(( $(date +%s) - t0 ))
    if [ $rc -eq 0 ]; then record "$name" ok "$dt" 0 ""; else record "$name" failed "$dt" "$rc" "see $OUT/$name.log"; fi
    return $rc
}

missing() {  # name why: a step that cannot run here is a failure of the check, said out loud
    record "$1" missing 0 - "$2"
}

has_command() { "$SPLITINFER" $1 --help > /dev/null 2>&1; }  # $1 unquoted: "drafter train"
has_head() { [ -f "$SHARDS/local/drafter/head.safetensors" ]; }

# 0. the device itself
if [ "${DEVICE%%:*}" = cuda ]; then
    step device 60 "$PYTHON" -c "import torch, json, sys; ok = torch.cuda.is_available(); \
json.dump({'cuda': ok, 'name': torch.cuda.get_device_name(0) if ok else None, 'torch': torch.__version__}, \
open('$OUT/device.json', 'w')); sys.exit(0 if ok else 1)"
fi

# 1. serve --device DEVICE and one generation through it
serve_check() {
    local port
    port=$("$PYTHON" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
    "$SPLITINFER" serve --shard "$SHARDS/cloud" --port "$port" --device "$DEVICE" > "$OUT/serve-server.log" 2>&1 &
    local pid=$!
    local ok=1
    for _ in $(seq 1 120); do
        if "$SPLITINFER" generate --shard "$SHARDS/local" --server "ws://127.0.0.1:$port" --allow-public-weights \
            --prompt "Name three uses of a GPU." --max-new-tokens 24 --json > "$OUT/serve.json" 2>> "$OUT/serve-client.log"; then
            ok=0
            break
        fi
        kill -0 "$pid" 2> /dev/null || break  # the server died: no point waiting
        sleep 1
    done
    kill "$pid" 2> /dev/null
    wait "$pid" 2> /dev/null
    return $ok
}
step serve 180 bash -c "$(declare -f serve_check); SPLITINFER='$SPLITINFER' PYTHON='$PYTHON' SHARDS='$SHARDS' \
DEVICE='$DEVICE' OUT='$OUT' serve_check"

# 2. bench spec: 5 prompts (one per category), 0 and 80 ms, sequential / tree without / tree with the head
has_head || missing head "no draft head in $SHARDS/local/drafter (splitinfer prepare installs it); tree runs without one"
step spec 240 "$SPLITINFER" bench spec --shards "$SHARDS" --out "$OUT/spec" --cloud-device "$DEVICE" \
    --per-category 1 --rtt-ms 0,80 --repeats 1 --max-new-tokens "$MAX_NEW_TOKENS" --strategies sequential,tree-nohead,tree

# 3. blocks in flight with the cloud on the GPU: D = 1, 2 and the controller's choice, at 80 ms
step in-flight 150 "$SPLITINFER" bench spec --shards "$SHARDS" --out "$OUT/inflight" --cloud-device "$DEVICE" \
    --per-category 1 --rtt-ms 80 --repeats 1 --max-new-tokens 48 --strategies sequential,tree-nohead --in-flight 1,2,auto

# 4. a short bench batch on the device (cloud-side sizes only, one end-to-end size)
step batch 120 "$SPLITINFER" bench batch --shards "$SHARDS" --out "$OUT/batch" --device "$DEVICE" \
    --sizes "$BATCH_SIZES" --load-clients 1,16 --load-steps 8 --clients 1 --repeats 1 --max-new-tokens 16

# 5. drafter training throughput
if has_command "drafter train"; then
    step train 150 "$SPLITINFER" drafter train --shards "$SHARDS" --out "$OUT/train" --device "$DEVICE" \
        --tokens "$TRAIN_TOKENS" --seed 0
else
    missing train "this splitinfer has no drafter train command"
fi

"$PYTHON" - "$OUT" "$START" <<'EOF'
import json, sys, time
out, start = sys.argv[1], int(sys.argv[2])
steps = []
for line in open(f"{out}/status.tsv"):
    name, status, seconds, rc, detail = line.rstrip("\n").split("\t")
    steps.append({"step": name, "status": status, "seconds": int(seconds), "rc": rc, "detail": detail})
bad = [s["step"] for s in steps if s["status"] != "ok"]
json.dump({"steps": steps, "total_s": int(time.time()) - start, "not_ok": bad}, open(f"{out}/summary.json", "w"), indent=1)
if bad:
    print(f"gpu-check: FAILED or MISSING: {', '.join(bad)} (details in {out}/summary.json)", file=sys.stderr)
    sys.exit(1)
print(f"gpu-check: all steps ok in {int(time.time()) - start} s ({out}/summary.json)", file=sys.stderr)
EOF
