#!/usr/bin/env bash
# On the GPU machine: our engine and llama.cpp on the same benchmark file, in the same run.
#   KIT=path/to/shared/bench OUT=results-dir bash bench/compare_llamacpp.sh
# The kit (the model writer, the vocabulary, llama.cpp's source and device_llamacpp.sh) is the project's shared
# benchmark kit; llama.cpp is built here for sm_90 and the Qwen3-30B-A3B-geometry Q4_K model written to /tmp/anchor.
# GPU_TESTS=0 skips the GPU tests run while llama.cpp builds; GPU_TEST_ARGS chooses them (default: tests/engine).
# FLOAT=0 skips the decode with float activations. CURVE=1 also runs bench/cache_curve.py (decode against the cached fraction, VRAM under 10/16/24 GB budgets).
set -u
KIT=${KIT:?set KIT to the benchmark kit folder}
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
[ "${KIT_STARTED:-0}" = 1 ] || bash "$KIT/device_llamacpp.sh" start  # KIT_STARTED=1: already started by the caller
if [ "${GPU_TESTS:-1}" = 1 ]; then
    # modules that need what the GPU machine lacks (ZeroMQ, pydantic) are reported as collection errors, not fatal
    # shellcheck disable=SC2086
    # TEST_DEVICES (e.g. 0,1): the cards the tests see, where the benchmarks below are kept to one
    timeout "${GPU_TESTS_TIMEOUT:-240}" env ${TEST_DEVICES:+CUDA_VISIBLE_DEVICES=$TEST_DEVICES} \
        python3 -m pytest -m gpu ${GPU_TEST_ARGS:-tests/engine --ignore=tests/engine/serve} \
        --continue-on-collection-errors -v -p no:cacheprovider -p no:warnings -rfE 2>&1 | grep -v "^  File" \
        > "$OUT/gpu-tests.txt"
    grep -cE " PASSED" "$OUT/gpu-tests.txt"; grep -E "FAILED|ERROR|passed|failed" "$OUT/gpu-tests.txt" | tail -12
fi
bash "$KIT/device_llamacpp.sh" wait
M=/tmp/anchor/a3b-q4k.gguf B=/tmp/anchor/llama.cpp/build/bin/llama-bench
timeout 200 python3 bench/engine_bench.py --model $M --prompts 512,4096 --decode 128 --reps 2 --profile \
    --out "$OUT/ours_full.json" | grep -E "tok_s|vram_" | head -6
# the exact path beside it: decode with float activations (--activations float); FLOAT=0 skips it
[ "${FLOAT:-1}" = 1 ] && STRATA_ACTIVATIONS=float timeout 90 python3 bench/engine_bench.py --model $M --prompts 512 --decode 128 --reps 1 \
    --out "$OUT/ours_float.json" | grep -E "decode_tok_s" | head -2
if [ "${NCMOE:-1}" = 1 ]; then  # NCMOE=0 skips the matched-VRAM pair (~2 min)
    # llama.cpp with the experts of 36 of 48 layers in host RAM; its VRAM (nvidia-smi, the whole process) becomes ours.
    # Ours still keeps its default 512 MiB for other programs out of the experts' room (llama-bench keeps none): a
    # 4,096-token chunk's temporaries use that room, and the budget covers them.
    (nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 100 > "$OUT/smi_ncmoe36.txt") & SMI=$!
    timeout 150 $B -m $M -ngl 99 -fa 1 -ncmoe 36 -t 16 -p 4096 -n 128 -r 2 -o json > "$OUT/llamacpp_ncmoe36.json"
    kill $SMI
    USED=$(sort -n "$OUT/smi_ncmoe36.txt" | tail -1)
    echo "llama.cpp -ncmoe 36: VRAM peak $USED MiB (whole process)"
    timeout 150 python3 bench/engine_bench.py --model $M --prompts 4096 --decode 64 --reps 1 --vram-process-mib "$USED" \
        --out "$OUT/ours_budget_ncmoe36.json" | grep -E "tok_s|experts_in" | head -4
fi
timeout 150 $B -m $M -ngl 99 -fa 1 -p 512,4096 -n 128 -r 3 -o json > "$OUT/llamacpp_full.json"
if [ "${CURVE:-0}" = 1 ]; then  # the expert cache's decode curve and VRAM budgets on the same file (~4 min)
    timeout 300 python3 bench/cache_curve.py --model $M --decode 32 --out "$OUT/cache_curve.json" | tail -8
fi
python3 - "$OUT" "${USED:-0}" "${NCMOE:-1}" <<'PY'
import json, sys, pathlib
o, used, ncmoe = pathlib.Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
ts = lambda f: {(r["n_prompt"], r["n_gen"]): r["avg_ts"] for r in json.loads((o / f).read_text())}
ours, llama = json.loads((o / "ours_full.json").read_text()), ts("llamacpp_full.json")
fl = o / "ours_float.json"
res = {"ours": ours, "llamacpp": {f"{k[0]}/{k[1]}": v for k, v in llama.items()}, "ratio_ours_over_llamacpp": {
    "decode": ours["decode_tok_s"] / llama[(0, 128)],
    "prompt_512": ours["prompt_512_tok_s"] / llama[(512, 0)],
    "prompt_4096": ours["prompt_4096_tok_s"] / llama[(4096, 0)],
}}
if fl.exists():  # --activations float: the decode that computes on float activations
    res["ratio_ours_over_llamacpp"]["decode_float_activations"] = (
        json.loads(fl.read_text())["decode_tok_s"] / llama[(0, 128)])
if not ncmoe:  # files of an earlier run in the same folder must not pass for this one's
    res["matched_vram_ncmoe36"] = "not measured (NCMOE=0)"
else:
    try:
        nc, s = ts("llamacpp_ncmoe36.json"), json.loads((o / "ours_budget_ncmoe36.json").read_text())
        res["matched_vram_ncmoe36"] = {
            "llamacpp_vram_mib": used, "ours": s, "llamacpp_ncmoe36": {f"{k[0]}/{k[1]}": v for k, v in nc.items()},
            "ratio_decode": s["decode_tok_s"] / nc[(0, 128)],
            "ratio_prompt_4096": s["prompt_4096_tok_s"] / nc[(4096, 0)],
        }
    except OSError as e:  # a step that failed left no file; its name only, not this machine's path
        res["matched_vram_ncmoe36"] = f"not measured: no {pathlib.Path(str(e.filename)).name}"
(o / "compare.json").write_text(json.dumps(res, indent=1) + "\n")
print(json.dumps({**res["ratio_ours_over_llamacpp"], **({k: v for k, v in res["matched_vram_ncmoe36"].items()
                  if k.startswith("ratio")} if isinstance(res["matched_vram_ncmoe36"], dict) else {})}))
PY
