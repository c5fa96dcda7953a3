#!/usr/bin/env bash
# On the GPU machine: our engine and llama.cpp on the same benchmark file, in the same run.
#   KIT=path/to/shared/bench OUT=results-dir bash bench/compare_llamacpp.sh
# The kit (the model writer, the vocabulary, llama.cpp's source and device_llamacpp.sh) is the project's shared
# benchmark kit; llama.cpp is built here for sm_90 and the Qwen3-30B-A3B-geometry Q4_K model written to /tmp/anchor.
set -u
KIT=${KIT:?set KIT to the benchmark kit folder}
OUT=${OUT:-bench/results}
GPU_TESTS=${GPU_TESTS:-1}
bash "$KIT/device_llamacpp.sh" start
if [ "$GPU_TESTS" = 1 ]; then
    # modules that need what the GPU machine lacks (ZeroMQ, pydantic) are reported as collection errors, not fatal
    timeout 240 python3 -m pytest -m gpu tests/engine --ignore=tests/engine/serve --continue-on-collection-errors \
        -q -p no:cacheprovider -p no:warnings 2>&1 | tail -4 | tee "$OUT/gpu-tests.txt"
fi
bash "$KIT/device_llamacpp.sh" wait
M=/tmp/anchor/a3b-q4k.gguf
timeout 200 python3 bench/engine_bench.py --model $M --prompts 512,4096 --decode 128 --reps 2 --profile \
    --out "$OUT/ours_full.json" | tail -3
timeout 150 python3 bench/engine_bench.py --model $M --prompts 4096 --decode 64 --reps 1 --expert-slots 1536 \
    --out "$OUT/ours_slots1536.json" | tail -3
timeout 150 python3 bench/engine_bench.py --model $M --prompts 4096 --decode 64 --reps 1 --expert-slots 1536 \
    --expert-misses copy --out "$OUT/ours_slots1536_copy.json" | tail -3
OUT=$OUT timeout 240 bash "$KIT/device_llamacpp.sh" bench
python3 - "$OUT" <<'PY'
import json, sys, pathlib
o = pathlib.Path(sys.argv[1])
ours = json.loads((o / "ours_full.json").read_text())
llama = {(r["n_prompt"], r["n_gen"]): r["avg_ts"] for r in json.loads((o / "llamacpp_full.json").read_text())}
ratios = {
    "decode": ours["decode_tok_s"] / llama[(0, 128)],
    "prompt_512": ours["prompt_512_tok_s"] / llama[(512, 0)],
    "prompt_4096": ours["prompt_4096_tok_s"] / llama[(4096, 0)],
}
res = {"ours": ours, "llamacpp": {f"{k[0]}/{k[1]}": v for k, v in llama.items()}, "ratio_ours_over_llamacpp": ratios}
try:
    nc = {(r["n_prompt"], r["n_gen"]): r["avg_ts"] for r in json.loads((o / "llamacpp_ncmoe36.json").read_text())}
    s = json.loads((o / "ours_slots1536.json").read_text())
    res["experts_12_of_48_layers_in_vram"] = {
        "ours": s, "llamacpp_ncmoe36": {f"{k[0]}/{k[1]}": v for k, v in nc.items()},
        "ratio_decode": s["decode_tok_s"] / nc[(0, 128)], "ratio_prompt_4096": s["prompt_4096_tok_s"] / nc[(4096, 0)],
    }
    copy = o / "ours_slots1536_copy.json"
    if copy.exists():
        c = json.loads(copy.read_text())
        res["experts_12_of_48_layers_in_vram"]["ours_misses_copy"] = c
        res["experts_12_of_48_layers_in_vram"]["ratio_decode_misses_copy"] = c["decode_tok_s"] / nc[(0, 128)]
except Exception as e:
    res["experts_12_of_48_layers_in_vram"] = f"not measured: {e}"
(o / "compare.json").write_text(json.dumps(res, indent=1))
print(json.dumps(res["ratio_ours_over_llamacpp"]))
PY
