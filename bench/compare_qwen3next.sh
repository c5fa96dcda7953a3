#!/usr/bin/env bash
# On the GPU machine: our engine and llama.cpp on the same Qwen3-Next-geometry file (bench/make_qwen3next_bench.py:
# 48 layers, 512 experts top-10, random Q4_K blocks, ~43 GiB), in the same run, from the project root:
#   KIT=path/to/shared/bench bash bench/compare_qwen3next.sh start   # background: build llama-bench, write the model
#   KIT=path/to/shared/bench bash bench/compare_qwen3next.sh wait    # until both are done (call again if it returns early)
#   bash bench/compare_qwen3next.sh ours                             # bench/engine_bench.py on the file
#   bash bench/compare_qwen3next.sh llamacpp                         # llama-bench on the file
#   bash bench/compare_qwen3next.sh report                           # both into $OUT/qwen3next-compare.json
# `all` runs the five in turn (for a machine without a per-command time limit). Each step fits in 10 minutes.
# Environment: KIT (the shared benchmark kit: llama.cpp's source and ggml-vocab-qwen2.gguf), OUT (bench/results),
# LAYERS (48; fewer keeps the per-layer geometry in a smaller file), W (/tmp/anchor, where the kit's
# device_llamacpp.sh builds too: an existing llama-bench there is reused).
# The kit's own `device_llamacpp.sh start` also writes its 16 GiB qwen3moe model; this script does not, so the
# 43 GiB file fits the 64 GiB disk of a one-GPU machine.
set -euo pipefail
W=${W:-/tmp/anchor}
OUT=${OUT:-bench/results}
LAYERS=${LAYERS:-48}
M=$W/qwen3next-${LAYERS}L-q4k.gguf
B=$W/llama.cpp/build/bin/llama-bench
mkdir -p "$W" "$OUT"

# python3 needs torch and the project's dependencies; gguf may come from llama.cpp's source (as for the kit's writer)
py() {
    if python3 -c 'import gguf' 2>/dev/null; then
        python3 "$@"
    else
        PYTHONPATH="$W/llama.cpp/gguf-py${PYTHONPATH:+:$PYTHONPATH}" python3 "$@"
    fi
}

start() {
    : "${KIT:?set KIT to the benchmark kit folder (llamacpp-src.tgz, ggml-vocab-qwen2.gguf)}"
    [[ -d $W/llama.cpp ]] || tar xzf "$KIT/llamacpp-src.tgz" -C "$W"
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv || true
    if [[ -x $B ]]; then
        echo 0 > "$W/build.rc"
    else
        rm -f "$W/build.rc"
        setsid bash -c "cd '$W/llama.cpp' && cmake -B build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
            -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
            -DCMAKE_BUILD_TYPE=Release > '$W/cfg.log' 2>&1 && cmake --build build -j 15 --target llama-bench \
            > '$W/build.log' 2>&1; echo \$? > '$W/build.rc'" < /dev/null > /dev/null 2>&1 &
    fi
    if [[ -s $M ]]; then
        echo 0 > "$W/q3n-gen.rc"
    else
        local free_gib need_gib=$((LAYERS * 9 / 10 + 2))
        free_gib=$(df -BG --output=avail "$W" | tail -1 | tr -dc 0-9)
        if ((free_gib < need_gib)); then
            echo "only ${free_gib} GiB free in $W; the ${LAYERS}-layer file needs about ${need_gib} GiB:" \
                "remove other models there or set LAYERS lower" >&2
            exit 1
        fi
        rm -f "$W/q3n-gen.rc"
        local here
        here=$(pwd)
        export -f py
        export W
        setsid bash -c "cd '$here' && py bench/make_qwen3next_bench.py '$M' --vocab '$KIT/ggml-vocab-qwen2.gguf' \
            --layers '$LAYERS' > '$W/q3n-gen.log' 2>&1; echo \$? > '$W/q3n-gen.rc'" < /dev/null > /dev/null 2>&1 &
    fi
    sleep 2
    echo started
}

wait_done() {
    for _ in $(seq 1 55); do
        [[ -f $W/build.rc && -f $W/q3n-gen.rc ]] && break
        sleep 10
    done
    echo "build rc: $(cat "$W/build.rc" 2>/dev/null) model rc: $(cat "$W/q3n-gen.rc" 2>/dev/null)"
    tail -2 "$W/build.log" "$W/q3n-gen.log" 2>/dev/null || true
    ls -la "$M" 2>/dev/null || true
    [[ $(cat "$W/build.rc" 2>/dev/null) == 0 && $(cat "$W/q3n-gen.rc" 2>/dev/null) == 0 ]]
}

ours() {
    timeout 560 py bench/engine_bench.py --model "$M" --prompts 512,4096 --decode 128 --reps 2 \
        --out "$OUT/qwen3next-ours.json" | tail -4
}

llamacpp() {
    timeout 560 "$B" -m "$M" -ngl 99 -fa 1 -p 512,4096 -n 128 -r 3 -o json > "$OUT/qwen3next-llamacpp.json"
    python3 -c 'import json,sys; [print(r["n_prompt"], r["n_gen"], round(r["avg_ts"], 1)) for r in json.load(sys.stdin)]' \
        < "$OUT/qwen3next-llamacpp.json"
}

report() {
    python3 - "$OUT" "$LAYERS" <<'PY'
import json
import pathlib
import sys

out, layers = pathlib.Path(sys.argv[1]), int(sys.argv[2])
ours = json.loads((out / "qwen3next-ours.json").read_text())
runs = json.loads((out / "qwen3next-llamacpp.json").read_text())
llama = {(r["n_prompt"], r["n_gen"]): r["avg_ts"] for r in runs}
res = {
    "model": {"file": ours["model"], "bytes": ours.get("file_bytes"), "layers": layers,
              "geometry": "Qwen3-Next-80B-A3B (bench/make_qwen3next_bench.py), Q4_K + Q6_K head, random blocks"},
    "gpu": runs[0].get("gpu_info"),
    "llamacpp_build": runs[0].get("build_commit"),
    "ours": ours,
    "llamacpp": {f"{p}/{g}": v for (p, g), v in llama.items()},
    "ratio_ours_over_llamacpp": {
        "decode": ours["decode_tok_s"] / llama[(0, 128)],
        "prompt_512": ours["prompt_512_tok_s"] / llama[(512, 0)],
        "prompt_4096": ours["prompt_4096_tok_s"] / llama[(4096, 0)],
    },
}
(out / "qwen3next-compare.json").write_text(json.dumps(res, indent=1) + "\n")
print(json.dumps(res["ratio_ours_over_llamacpp"]))
PY
}

case ${1:-} in
start) start ;;
wait) wait_done ;;
ours) ours ;;
llamacpp) llamacpp ;;
report) report ;;
all)
    start
    until wait_done; do
        if [[ $(cat "$W/build.rc" 2>/dev/null) =~ ^[1-9] || $(cat "$W/q3n-gen.rc" 2>/dev/null) =~ ^[1-9] ]]; then
            echo "the llama.cpp build or the model writer failed: see $W/build.log, $W/q3n-gen.log" >&2
            exit 1
        fi
    done
    ours
    llamacpp
    report
    ;;
*)
    echo "usage: compare_qwen3next.sh start|wait|ours|llamacpp|report|all" >&2
    exit 2
    ;;
esac
