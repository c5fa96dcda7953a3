#!/usr/bin/env bash
# On a GPU machine: one model served three ways in one run with one HTTP client (bench/serve_clients.py), so that
# the ratios compare like with like: one stage, a layer split on the one card (--split-device 0), and a remote
# stage on loopback (a worker process for the later layers, as on another PC).
#   M=model.gguf OUT=results-dir [K=24] [CLIENTS=1,8] [REQUESTS=2] [TOKENS=128] [ARGS="--parallel 8 --threads 4"] \
#       [RUNS="one split remote remote-no-overlap"] bash bench/serve_stages.sh
# On a machine with two cards every process but a card-1 worker sees card 0 only, and RUNS may add remote-card1 and
# remote-card1-g2: the worker on the second card (two PCs' cards, the link on loopback), one group of slots or two
# pipelined (--batch-groups 2: this process computes one group's layers while the worker computes the other's).
# Each run writes $OUT/serve-<run>.json (and the server's log beside it; the worker's with STRATA_REMOTE_TIMING=1
# timing lines), then a line of aggregates per run and each one's ratio to the one stage's at the most clients.
set -u
M=${M:?set M to the model file} OUT=${OUT:-bench/results} K=${K:-24}
CLIENTS=${CLIENTS:-1,8} REQUESTS=${REQUESTS:-2} TOKENS=${TOKENS:-128} ARGS=${ARGS:---parallel 8 --threads 4}
RUNS=${RUNS:-one split remote remote-no-overlap} PORT=${PORT:-7070}
mkdir -p "$OUT"
export STRATA_STAGE_TOKEN=${STRATA_STAGE_TOKEN:-$(python3 -c 'import secrets; print(secrets.token_urlsafe(24))')}

serve() {  # serve NAME "extra serve args" [VAR=value ...]
    local name=$1 extra=$2
    shift 2
    env "$@" timeout "${RUN_TIMEOUT:-300}" python3 bench/serve_clients.py --model "$M" --clients "$CLIENTS" \
        --requests "$REQUESTS" --tokens "$TOKENS" --serve-args "$ARGS $extra" --out "$OUT/serve-$name.json" \
        --server-log "$OUT/serve-$name.log" > /dev/null
    echo "$name: rc $?"
}

CARDS=$(nvidia-smi -L 2> /dev/null | wc -l)
PIN=()  # with two cards or more, the one stage, the mains and a same-card worker on card 0
[ "$CARDS" -ge 2 ] && PIN=(CUDA_VISIBLE_DEVICES=0)

worker() {  # worker NAME [CARD]: a worker for layers K.. on card 0 (or CARD), until stop_worker
    local name=$1 card=${2:-0}
    local pin=("${PIN[@]}")
    [ "$card" != 0 ] && pin=(CUDA_VISIBLE_DEVICES="$card")
    env "${pin[@]}" STRATA_REMOTE_TIMING=1 python3 -m engine.cli worker --model "$M" --stage-worker "$PORT" \
        --stage-begin "$K" --parallel 8 > "$OUT/worker-$name.log" 2>&1 &
    WP=$!
    for _ in $(seq 300); do
        grep -qs "listening" "$OUT/worker-$name.log" && return 0
        kill -0 $WP 2> /dev/null || break
        sleep 1
    done
    echo "the worker did not start: $(tail -3 "$OUT/worker-$name.log")"
    return 1
}

stop_worker() { kill $WP 2> /dev/null; wait $WP 2> /dev/null; }

for run in $RUNS; do
    case $run in
        one) serve one "" "${PIN[@]}" ;;
        split) serve split "--layer-split $K --split-device 0" "${PIN[@]}" ;;
        remote)
            worker remote && serve remote "--layer-split $K --remote-stage 127.0.0.1:$PORT" "${PIN[@]}"
            stop_worker
            ;;
        remote-no-overlap)
            worker remote-no-overlap && serve remote-no-overlap "--layer-split $K --remote-stage 127.0.0.1:$PORT" \
                STRATA_STEP_OVERLAP=0 "${PIN[@]}"
            stop_worker
            ;;
        remote-card1 | remote-card1-g2)
            if [ "$CARDS" -lt 2 ]; then
                echo "$run: needs two cards (nvidia-smi lists $CARDS)"
                continue
            fi
            groups=1
            [ "$run" = remote-card1-g2 ] && groups=2
            worker "$run" 1 && serve "$run" "--layer-split $K --remote-stage 127.0.0.1:$PORT --batch-groups $groups" \
                "${PIN[@]}"
            stop_worker
            ;;
        *) echo "unknown run $run (one, split, remote, remote-no-overlap, remote-card1, remote-card1-g2)" ;;
    esac
done
python3 - "$OUT" $RUNS << 'EOF'
import json, sys
from pathlib import Path
out, runs = Path(sys.argv[1]), sys.argv[2:]
got = {}
for r in runs:
    f = out / f"serve-{r}.json"
    if f.exists():
        got[r] = {x["clients"]: x["aggregate_tok_s"] for x in json.loads(f.read_text())["rounds"]}
base = got.get("one", {})
for r, agg in got.items():
    most = max(agg)
    ratio = f", {agg[most] / base[most]:.2f}x one stage at {most}" if most in base and r != "one" else ""
    print(f"{r}: " + ", ".join(f"{c} clients {t:.1f} tok/s" for c, t in agg.items()) + ratio)
EOF
