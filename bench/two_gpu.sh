#!/usr/bin/env bash
# Issue 14 on a machine with two NVIDIA cards, in one run (~4-5 minutes, at most 7): the GPU tests of the split on two
# cards, llama.cpp's llama-bench with -sm layer on both cards and on card 0 alone, then bench/two_gpu.py (one card against two, each budgeted as a 16 GB card; the
# pinned-host and peer-copy hand-offs; greedy identity with full caches; the later stage in a worker process on card 1
# over loopback), then $OUT/two-gpu.json with the ratios.
#   OUT=results-dir bash bench/two_gpu.sh
# Needs the benchmark model and llama-bench that bench/compare_llamacpp.sh's kit step leaves (M, LB below), python3
# with torch and triton. The wheels in .whl/ (gguf, platformdirs; pyzmq and msgpack for this python, which the remote arm
# needs) are installed to /tmp/site-whl when one of those modules is missing, those in .whl-link/ to /tmp/site-link;
# without pyzmq the remote arm is reported as not measured and the rest runs.
# Knobs: M, LB, BUDGET_MIB (16384), ROUNDS (3), PROMPT (4096), DECODE (128), OURS_S (the timeout of our arms, 230),
# TESTS=0 (skip the GPU tests of the split on two cards that run first).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-bench/results}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
M=${M:-/tmp/anchor/a3b-q4k.gguf}
LB=${LB:-/tmp/anchor/llama.cpp/build/bin/llama-bench}
P=${PROMPT:-4096} N=${DECODE:-128}
cd "$(dirname "$0")/.." || exit 1

install_wheels() {  # $1: a wheel folder, $2: the target folder, then the modules it brings; installed if one is missing
    local dir=$1 target=$2 m
    shift 2
    ls "$dir"/*.whl >/dev/null 2>&1 || return 0
    for m in "$@"; do
        if ! python3 -c "import $m" 2>/dev/null; then
            python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$target" \
                "$dir"/*.whl 2>&1 | tail -1
            export PYTHONPATH="$target${PYTHONPATH:+:$PYTHONPATH}"
            return 0
        fi
    done
}
install_wheels .whl /tmp/site-whl gguf platformdirs zmq msgpack
install_wheels .whl-link /tmp/site-link zmq msgpack
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

{ nvidia-smi --query-gpu=index,name,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv
  nvidia-smi topo -m; } > "$OUT/two-gpu-cards.txt" 2>&1
head -3 "$OUT/two-gpu-cards.txt"

if [ "${TESTS:-1}" = 1 ]; then  # the split's output on two cards against one card (also warms Triton's kernel cache)
    echo "== GPU tests of the split on two cards"
    timeout 60 python3 -m pytest -m gpu -q -p no:cacheprovider -p no:randomly -rfEs \
        tests/engine/pipeline/test_two_cards_gpu.py tests/engine/pipeline/test_split_gpu.py \
        > "$OUT/two-gpu-tests.txt" 2>&1
    grep -E "passed|failed|FAILED|ERROR" "$OUT/two-gpu-tests.txt" | tail -6
fi

echo "== llama.cpp -sm layer on cards 0 and 1"
CUDA_VISIBLE_DEVICES=0,1 timeout 70 "$LB" -m "$M" -ngl 99 -fa 1 -sm layer -p "$P" -n "$N" -r 2 -o json \
    > "$OUT/two-gpu-llamacpp-2.json" 2> "$OUT/two-gpu-llamacpp-2.log" || echo "llama-bench (two cards) failed: rc $?"
echo "== llama.cpp on card 0"
CUDA_VISIBLE_DEVICES=0 timeout 60 "$LB" -m "$M" -ngl 99 -fa 1 -p "$P" -n "$N" -r 2 -o json \
    > "$OUT/two-gpu-llamacpp-1.json" 2> "$OUT/two-gpu-llamacpp-1.log" || echo "llama-bench (one card) failed: rc $?"

echo "== ours (log: $OUT/two-gpu-ours.log)"
# The JSON is rewritten after each step, so a timeout still leaves what was measured.
timeout "${OURS_S:-230}" python3 bench/two_gpu.py measure --model "$M" --gpus 0,1 --vram-budget-mib "${BUDGET_MIB:-16384}" \
    --prompt "$P" --decode "$N" --rounds "${ROUNDS:-3}" --out "$OUT/two-gpu-ours.json" 2> "$OUT/two-gpu-ours.log" \
    || { echo "two_gpu.py measure: rc $?"; tail -5 "$OUT/two-gpu-ours.log"; }
grep -E "^round|rror" "$OUT/two-gpu-ours.log" | tail -6

python3 bench/two_gpu.py assemble --ours "$OUT/two-gpu-ours.json" --llama-two "$OUT/two-gpu-llamacpp-2.json" \
    --llama-one "$OUT/two-gpu-llamacpp-1.json" --out "$OUT/two-gpu.json"
