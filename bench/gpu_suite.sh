#!/usr/bin/env bash
# On the GPU machine: the whole GPU suite (pytest -m gpu) in PARTS calls that each end well inside one call's
# 10 minutes, every test named with its outcome, so that a run cut short still says what passed and what failed.
#   PART=1 PARTS=2 OUT=results-dir bash bench/gpu_suite.sh      then PART=2 in the next call
# WORKERS (default 6) runs that many pytest workers on the one card (pytest-xdist, on the GPU machine's image);
# TIMEOUT (default 540 s) bounds the part. Tests marked `exclusive` (they time the card) run alone, one at a time, at
# the end of the last part: beside other workers' kernels their timings mean nothing. Wheels the machine lacks (gguf, pydantic, fastapi, pyzmq, ...) must be on
# PYTHONPATH first (device README: carry them as .whl).
set -u
PART=${PART:-1} PARTS=${PARTS:-1} OUT=${OUT:-bench/results} WORKERS=${WORKERS:-6}
mkdir -p "$OUT"
ids=$(mktemp)
python3 -m pytest -m "gpu and not exclusive" tests/engine --collect-only -q -p no:cacheprovider 2>/dev/null | grep "::" > "$ids"
part=$(mktemp)
awk -v p="$PART" -v n="$PARTS" 'NR % n == p % n' "$ids" > "$part"
log="$OUT/gpu-suite-$PART-of-$PARTS.txt"
echo "part $PART of $PARTS: $(wc -l < "$part") of $(wc -l < "$ids") tests" | tee "$log"
# shellcheck disable=SC2046
timeout "${TIMEOUT:-540}" python3 -m pytest -m "gpu and not exclusive" -n "$WORKERS" -v -p no:cacheprovider -p no:warnings -rfE \
    --tb=line $(cat "$part") 2>&1 | grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|^E  |Error" >> "$log"
echo "rc ${PIPESTATUS[0]}" | tee -a "$log"
alone=$(mktemp)
python3 -m pytest -m "gpu and exclusive" tests/engine --collect-only -q -p no:cacheprovider 2>/dev/null | grep "::" > "$alone"
if [ "$PART" = "$PARTS" ] && [ -s "$alone" ]; then
    echo "and alone: $(wc -l < "$alone") tests" | tee -a "$log"
    # shellcheck disable=SC2046
    timeout 120 python3 -m pytest -m "gpu and exclusive" $(cat "$alone") -v -p no:cacheprovider -p no:warnings -rfE \
        --tb=line 2>&1 | grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|^E  |Error" >> "$log"
    echo "rc (exclusive) ${PIPESTATUS[0]}" | tee -a "$log"
fi
grep -cE " PASSED" "$log"; grep -E "FAILED|ERROR" "$log" | sort -u | head -20; tail -1 "$log"
