#!/usr/bin/env bash
# On the GPU machine: the CPU's share of a card's missed experts for expert files of other block types than Q4_K,
# against llama.cpp on the same file at the VRAM its `-ncmoe 36` takes (decode, one call):
#   KIT=path/to/shared/bench OUT=results-dir bash bench/cpu_share_types.sh
# The kit's Qwen3-30B-A3B-geometry file is written as Q4_K (device_llamacpp.sh); the other types are that file
# with its routed experts rewritten as random blocks of the type (bench/retype_experts.py, at disk speed: no
# llama-quantize), one at a time and deleted after their runs (the disk holds two 17-32 GB files, not three).
# For each file: llama-bench -ncmoe 36 decode with nvidia-smi sampling its VRAM, then ours within that VRAM
# (engine_bench --vram-process-mib) with the CPU's share on its default (every layer whose blocks the CPU reads in
# place: Q4_K/Q6_K by cpu_q4k, the other types by cpu_blocks) and off (--cpu-experts 0), into cpu-share-types.json.
# TYPES (default "q4k q8_0 iq4_xs") chooses the files; KEEP=1 keeps the rewritten files; CPU_OFF= skips the runs
# with the share off. One type fits a call: `TYPES=iq4_xs` took 391 s with both runs (2026-12-04).
set -u
KIT=${KIT:?set KIT to the benchmark kit folder}
OUT=${OUT:-bench/results}
W=/tmp/anchor
mkdir -p "$OUT"
[ "${KIT_STARTED:-0}" = 1 ] || SERVER=0 bash "$KIT/device_llamacpp.sh" start
# the first retyped file is written while llama.cpp builds (the build takes ~4 minutes, the model ~1, a retype ~1)
for _ in $(seq 1 120); do [ -f $W/gen.rc ] && break; sleep 2; done
first=$(for t in ${TYPES:-q4k q8_0 iq4_xs}; do [ $t = q4k ] || { echo $t; break; }; done)
[ -z "$first" ] || [ -f $W/a3b-$first.gguf ] || python3 bench/retype_experts.py $W/a3b-q4k.gguf $W/a3b-$first.gguf --type "$first"
bash "$KIT/device_llamacpp.sh" wait
B=$W/llama.cpp/build/bin/llama-bench
for t in ${TYPES:-q4k q8_0 iq4_xs}; do
    M=$W/a3b-$t.gguf
    [ $t = q4k ] || [ -f "$M" ] || python3 bench/retype_experts.py $W/a3b-q4k.gguf "$M" --type "$t" || continue
    [ -f "$M" ] || { echo "no $t file"; continue; }
    (nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 100 > "$OUT/smi-$t.txt") & SMI=$!
    timeout 200 $B -m "$M" -ngl 99 -fa 1 -ncmoe 36 -t 16 -p 0 -n 128 -r 2 -o json > "$OUT/llamacpp-ncmoe36-$t.json"
    kill $SMI
    USED=$(sort -n "$OUT/smi-$t.txt" | tail -1)
    echo "$t: llama.cpp -ncmoe 36 VRAM peak $USED MiB"
    for cpu in default ${CPU_OFF-0}; do  # CPU_OFF= (empty) skips the run with the share off
        extra=(); [ $cpu = 0 ] && extra=(--cpu-experts 0)
        timeout 300 python3 bench/engine_bench.py --model "$M" --prompts 512 --decode 128 --reps 2 \
            --vram-process-mib "$USED" "${extra[@]}" --out "$OUT/ours-ncmoe36-vram-$t-cpu-$cpu.json" \
            | grep -E "decode_tok_s|experts_in" | head -3
    done
    [ $t = q4k ] || [ "${KEEP:-0}" = 1 ] || rm -f "$M"
done
python3 - "$OUT" <<'PY'
import json, pathlib, sys
o = pathlib.Path(sys.argv[1])
res = {}
for f in sorted(o.glob("llamacpp-ncmoe36-*.json")):
    t = f.stem.removeprefix("llamacpp-ncmoe36-")
    try:
        llama = next(r["avg_ts"] for r in json.loads(f.read_text()) if r["n_gen"] > 0)
        row = {"llamacpp_decode_tok_s": llama, "vram_mib": max(map(int, (o / f"smi-{t}.txt").read_text().split()))}
        for cpu in ("default", "0"):
            p = o / f"ours-ncmoe36-vram-{t}-cpu-{cpu}.json"
            if p.exists():
                ours = json.loads(p.read_text())["decode_tok_s"]
                row[f"ours_cpu_share_{cpu}_tok_s"] = ours
                row[f"ratio_cpu_share_{cpu}"] = round(ours / llama, 3)
        res[t] = row
    except (OSError, StopIteration, ValueError, KeyError) as e:
        res[t] = f"not measured: {type(e).__name__}"
(o / "cpu-share-types.json").write_text(json.dumps(res, indent=1) + "\n")
print(json.dumps(res))
PY
