#!/usr/bin/env bash
# The GPU check (issue 49): the paper's configuration (mistral-7b-v0.1, 2 + 2 local layers) measured on a
# bare offline GPU host in one run of under 8 minutes, from this repository's files alone.
#
#   scripts/gpu_check.sh OUT_DIR
#
# The host it is made for has PyTorch, transformers, safetensors, tokenizers, numpy, prometheus-client and
# tqdm, reaches no package registry and receives at most 64 MiB (the tree and what is carried with it). So:
# - what it lacks travels as wheels: run scripts/gpu_wheels.sh beforehand on a machine with a registry (it
#   fills .gpu-wheels/, gitignored, with manylinux wheels for the host's Python 3.12: websockets, ~0.2 MB),
#   and carry .gpu-wheels with the tree; this script installs them into /tmp/gpu-check-site when missing;
# - no weights travel: the shards are synthetic (`prepare --synthetic`: seeded random weights in the
#   config's shape, made on the host in about a minute); a step's cost depends on the shapes, not the values;
# - the shipped SmolLM2 does not travel: its smallest form, the Q4_1 GGUF, is 98 MB, over the limit alone,
#   so the check has no text, no acceptance and no drafter training (those need the real model).
#
# Steps, each with a time limit (x LIMIT_SCALE), each recorded in summary.json (ok, failed or missing):
#   wheels      websockets importable (installed from WHEELS when the host lacks it)
#   shards      prepare --synthetic CONFIG: local shard (LOCAL_DTYPE) and cloud shard (CLOUD_DTYPE) in SHARDS
#   cloud-step  the cloud half on DEVICE, ROWS rows at CONTEXTS cached tokens, eager and as CUDA graphs,
#               beside its bytes bound at the measured copy bandwidth      -> device-step.json
#   batch       bench batch on DEVICE: SESSIONS one-row sessions batched vs one at a time   -> batch.json
#   split       serve on DEVICE (its steps as CUDA graphs: --graphs GRAPHS) behind an emulated RTT_MS round
#               trip, the trusted half on this host's CPU (LOCAL_THREADS threads), sequential and tree on token
#               ids, checked identical: the cloud in SPLIT_DTYPE (float32, from the bfloat16 shard) and a
#               float32 wire, since bfloat16 kernels round blocks of different rows differently
#               (bench/splitcheck.py says why)                            -> split.json
#   split-gpu   the same with the trusted half on DEVICE too (the paper's setup: both halves on GPUs)
#                                                                         -> split-gpu.json
# OUT_DIR then holds summary.json (steps, device, travelling size), device-step.json, batch.json, split.json,
# split-gpu.json and check.log: six files, no folders. It exits non-zero naming any step that failed or could not run.
#
# The dry run on a CPU (tests/test_gpu_check.py, in `make test-slow`), with a tiny config:
#   DEVICE=cpu CONFIG=tiny.json ROWS=1,4 CONTEXTS=8 SESSIONS=1,2 REPEATS=2 PROMPTS=1 MAX_NEW_TOKENS=6 \
#       RTT_MS=20 GRAPHS=static scripts/gpu_check.sh /tmp/gpu-dry
# Knobs (environment): DEVICE (cuda), CONFIG (mistral-7b-v0.1), SHARDS (/tmp/gpu-check-shards), PYTHON
# (python3), WHEELS (.gpu-wheels), LOCAL_DTYPE (float32), CLOUD_DTYPE (bfloat16), ROWS (1,2,4,8,16,32,64),
# CONTEXTS (64,2048), SESSIONS (1,4,16,64), REPEATS (20), RTT_MS (80), PROMPTS (3), MAX_NEW_TOKENS (32),
# LOCAL_THREADS (8), SPLIT_DTYPE (float32), GRAPHS (auto: CUDA graphs on a CUDA device), BUDGET_S (540: every step's limit is cut to what is left of it),
# LIMIT_SCALE (1: multiplies every limit and the budget).
set -u -o pipefail

OUT=${1:?usage: scripts/gpu_check.sh OUT_DIR}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
DEVICE=${DEVICE:-cuda}
CONFIG=${CONFIG:-mistral-7b-v0.1}
SHARDS=${SHARDS:-/tmp/gpu-check-shards}
PYTHON=${PYTHON:-python3}
WHEELS=${WHEELS:-$ROOT/.gpu-wheels}
LOCAL_DTYPE=${LOCAL_DTYPE:-float32}
CLOUD_DTYPE=${CLOUD_DTYPE:-bfloat16}
ROWS=${ROWS:-1,2,4,8,16,32,64}
CONTEXTS=${CONTEXTS:-64,2048}
SESSIONS=${SESSIONS:-1,4,16,64}
REPEATS=${REPEATS:-20}
RTT_MS=${RTT_MS:-80}
PROMPTS=${PROMPTS:-3}
MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-32}
LOCAL_THREADS=${LOCAL_THREADS:-8}
SPLIT_DTYPE=${SPLIT_DTYPE:-float32}
GRAPHS=${GRAPHS:-auto}
LIMIT_SCALE=${LIMIT_SCALE:-1}
BUDGET_S=${BUDGET_S:-540}  # the whole check, so that it ends inside one 10-minute device call
SITE=/tmp/gpu-check-site
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
LOG="$OUT/check.log"
STATUS=$(mktemp)
SCRATCH=$(mktemp -d)
: > "$LOG"
START=$(date +%s)
export PYTHONPATH="$ROOT/src:$SITE${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
SPLITINFER=("$PYTHON" -m splitinfer)

record() {  # name status seconds rc detail
    printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "$5" >> "$STATUS"
    echo "gpu-check: $1: $2 ($3 s, rc $4) $5" >&2
}

step() {  # name limit_s command...: run it, its output appended to check.log; record ok/failed
    local name=$1 limit=$(( $2 * LIMIT_SCALE ))
    shift 2
    local left=$(( BUDGET_S * LIMIT_SCALE - ($(date +%s) - START) ))
    if [ "$left" -le 5 ]; then record "$name" failed 0 - "not started: the check's $BUDGET_S s budget is spent"; return 1; fi
    [ "$limit" -gt "$left" ] && limit=$left  # the whole check fits one device call
    echo "=== $name: $*" >> "$LOG"
    local t0=$(date +%s)
    timeout "$limit" "$@" >> "$LOG" 2>&1
    local rc=$?
    local dt=$(( $(date +%s) - t0 ))
    if [ $rc -eq 0 ]; then record "$name" ok "$dt" 0 ""; else record "$name" failed "$dt" "$rc" "see check.log"; fi
    return $rc
}

# wheels: websockets is the one package the host lacks (serve and the client speak WebSocket)
if "$PYTHON" -c "import websockets" 2> /dev/null; then
    record wheels ok 0 0 "already importable"
elif ls "$WHEELS"/*.whl > /dev/null 2>&1; then
    step wheels 60 "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" "$WHEELS"/*.whl
else
    record wheels missing 0 - "no websockets here and no wheels in $WHEELS: run scripts/gpu_wheels.sh and carry .gpu-wheels"
fi

# shards: synthetic, made here (nothing large travels)
step shards 240 "${SPLITINFER[@]}" prepare --synthetic "$CONFIG" --seed 0 --out "$SHARDS" --head-layers 2 \
    --tail-layers 2 --dtype "$LOCAL_DTYPE" --cloud-dtype "$CLOUD_DTYPE"

# cloud-step: eager and CUDA graphs against the bytes bound
step cloud-step 180 "$PYTHON" -m splitinfer.bench.devicestep --shard "$SHARDS/cloud" --device "$DEVICE" \
    --dtype "$CLOUD_DTYPE" --rows "$ROWS" --contexts "$CONTEXTS" --repeats "$REPEATS" --out "$OUT/device-step.json"

# batch: sessions batched into one pass vs one at a time (cloud side only: the host's clients would time the CPU)
step batch 150 "${SPLITINFER[@]}" bench batch --shards "$SHARDS" --out "$SCRATCH/batch" --device "$DEVICE" \
    --dtype "$CLOUD_DTYPE" --sizes "$SESSIONS" --load-clients '' --clients '' --repeats 3 \
    && cp "$SCRATCH/batch/batching.json" "$OUT/batch.json"

# split: the cloud on DEVICE, the trusted half on this CPU, an emulated round trip, token ids, exact
step split 240 "$PYTHON" -m splitinfer.bench.splitcheck --shards "$SHARDS" --device "$DEVICE" --dtype "$SPLIT_DTYPE" \
    --rtt-ms "$RTT_MS" --prompts "$PROMPTS" --max-new-tokens "$MAX_NEW_TOKENS" --threads "$LOCAL_THREADS" \
    --strategies sequential,tree-nohead --graphs "$GRAPHS" --out "$OUT/split.json"

# split-gpu: both halves on DEVICE (client --device), the same check
step split-gpu 200 "$PYTHON" -m splitinfer.bench.splitcheck --shards "$SHARDS" --device "$DEVICE" \
    --local-device "$DEVICE" --dtype "$SPLIT_DTYPE" --rtt-ms "$RTT_MS" --prompts "$PROMPTS" \
    --max-new-tokens "$MAX_NEW_TOKENS" --threads "$LOCAL_THREADS" --strategies sequential,tree-nohead \
    --graphs "$GRAPHS" --out "$OUT/split-gpu.json"

rm -rf "$SCRATCH"
"$PYTHON" - "$OUT" "$START" "$STATUS" "$ROOT" "$WHEELS" "$DEVICE" <<'EOF'
import json, os, subprocess, sys, time
out, start, status, root, wheels, device = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5], sys.argv[6]
LIMIT = 64 * 2**20

def tree_bytes() -> tuple[int, str]:
    """What travels with the tree: tracked and untracked-not-ignored files (git), else every file here."""
    try:
        listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=root,
                                capture_output=True, check=True).stdout.split(b"\0")
        paths = [os.path.join(root, p.decode()) for p in listed if p]
        return sum(os.path.getsize(p) for p in paths if os.path.isfile(p)), "git ls-files"
    except (OSError, subprocess.CalledProcessError):
        skip = {os.path.realpath(out), os.path.realpath(wheels)}
        total = 0
        for top, dirs, files in os.walk(root):
            dirs[:] = [d for d in dirs if os.path.realpath(os.path.join(top, d)) not in skip]
            total += sum(os.path.getsize(os.path.join(top, f)) for f in files if os.path.isfile(os.path.join(top, f)))
        return total, "every file under the tree"

steps = []
for line in open(status):
    name, state, seconds, rc, detail = line.rstrip("\n").split("\t")
    steps.append({"step": name, "status": state, "seconds": int(seconds), "rc": rc, "detail": detail})
tree, how = tree_bytes()
carried = sum(os.path.getsize(os.path.join(wheels, f)) for f in os.listdir(wheels)) if os.path.isdir(wheels) else 0
travel = {"tree_bytes": tree, "counted_by": how, "wheels_bytes": carried, "total_bytes": tree + carried,
          "limit_bytes": LIMIT, "fits": tree + carried <= LIMIT}
try:
    import torch
    info = {"torch": torch.__version__, "cuda": torch.cuda.is_available(),
            "name": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None, "device": device}
except Exception as exc:  # noqa: BLE001 - recorded, not fatal
    info = {"error": str(exc), "device": device}
bad = [s["step"] for s in steps if s["status"] != "ok"] + ([] if travel["fits"] else ["travelling size"])
summary = {"steps": steps, "total_s": int(time.time()) - start, "not_ok": bad, "device": info, "travel": travel,
           "files": sorted(os.listdir(out)) + ["summary.json"]}
json.dump(summary, open(os.path.join(out, "summary.json"), "w"), indent=1)
mib = lambda n: f"{n / 2**20:.1f} MiB"  # noqa: E731
print(f"gpu-check: travelling size {mib(tree + carried)} (tree {mib(tree)} by {how}, wheels {mib(carried)}); "
      f"limit {mib(LIMIT)}: {'fits' if travel['fits'] else 'OVER'}", file=sys.stderr)
if bad:
    print(f"gpu-check: FAILED or MISSING: {', '.join(bad)} (details in {out}/summary.json, check.log)", file=sys.stderr)
    sys.exit(1)
print(f"gpu-check: all steps ok in {summary['total_s']} s ({out}/summary.json)", file=sys.stderr)
EOF
rc=$?
rm -f "$STATUS"
exit $rc
