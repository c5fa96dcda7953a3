"""Decode against the VRAM a card has: ours on routing traces, and llama.cpp with its best `-ncmoe` for each budget.

    python bench/budget_curve.py --model F --llama-bench B [--budgets-gib 6,10,16,24] [--traces realistic,uniform]
                                 [--out bench/results/budget-curve.json]

For each budget (the whole process's VRAM as nvidia-smi counts it, what a card of that size leaves a program):
llama.cpp keeps the experts of `-ncmoe N` layers in host RAM; the best N is the smallest whose run fits. Two short
llama-bench runs (N = 0 and all layers) give the VRAM one layer's experts take, which predicts N for each budget; the
prediction is checked by the run itself (nvidia-smi every 0.2 s) and N raised while it does not fit. Ours runs
engine_bench within the same budget (`--vram-process-mib`, no reserve) with each trace replayed in place of the
router (bench/cache_policies.py's traces; the cache filled from the trace's second half, as from a profile recorded
on like text). One GPU, nothing else on it."""

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.cache_policies import _geometry, _trace_file
from bench.long_context import llama_bench
from bench.report import emit

HERE = Path(__file__).resolve().parent


def llama_decode(binary: str, model: str, ncmoe: int, n: int, threads: int) -> dict:
    """llama-bench's decode with the experts of `ncmoe` layers in host RAM, and its VRAM at the peak."""
    r = llama_bench(binary, model, [], [0], n, ["-ncmoe", str(ncmoe), "-t", str(threads)])
    return {"ncmoe": ncmoe, "decode_tok_s": r.get("decode_depth_0_tok_s"), "vram_peak_mib": r["vram_peak_mib"],
            **({"errors": r["errors"]} if "errors" in r else {})}  # fmt: skip


def vram_per_layer(binary: str, model: str, layers: int, threads: int) -> tuple[int, float]:
    """(llama.cpp's VRAM with every layer's experts in host RAM, the VRAM one layer's experts add), from two short
    runs: all experts in RAM, all in VRAM."""
    least = llama_decode(binary, model, layers, 16, threads)["vram_peak_mib"]
    most = llama_decode(binary, model, 0, 16, threads)["vram_peak_mib"]
    return least, (most - least) / layers


def best_ncmoe(binary: str, model: str, layers: int, budget_mib: int, n: int, threads: int, least: int,
               per_layer: float) -> dict:  # fmt: skip
    """The fastest llama.cpp run within `budget_mib`: the fewest layers' experts in host RAM that fit, from the
    predicted count up while a run does not fit."""
    if least > budget_mib:
        return {"fits": False, "least_vram_mib": least}
    ncmoe = max(0, min(layers, math.ceil(layers - (budget_mib - least) / max(per_layer, 1.0))))
    tried = []
    while ncmoe <= layers:
        run = llama_decode(binary, model, ncmoe, n, threads)
        tried.append(run)
        if run["vram_peak_mib"] <= budget_mib and run["decode_tok_s"]:
            return {"fits": True, **run, "tried": tried}
        ncmoe += 1
    return {"fits": False, "tried": tried}


def ours(model: str, budget_mib: int, trace: Path, decode: int, threads: int, fill: str = "profile") -> dict:
    """engine_bench within `budget_mib` (the whole process) replaying `trace`, in a process of its own. `fill`:
    "profile" fills the cache from the usage counts of the trace's second half by the engine's plan (the slots per
    layer whose misses cost least, engine/experts/capacity.py), "hottest" from the same counts by the hottest
    (layer, expert) pairs whatever the layer, "layers" without a profile (whole layers in order: the misses gather
    in the other layers)."""
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "eb.json"
        cmd = [sys.executable, str(HERE / "engine_bench.py"), "--model", model, "--prompts", "512", "--decode",
               str(decode), "--reps", "2", "--expert-policy", "profile", "--vram-process-mib",
               str(budget_mib), "--vram-reserve-mib", "0", "--threads", str(threads), "--out", str(out)]  # fmt: skip
        if fill in ("profile", "hottest"):
            cmd.append("--profile-from-trace")
        if fill == "hottest":
            cmd += ["--layer-miss-cost", "hottest"]
        p = subprocess.run(
            cmd, env={**os.environ, "STRATA_ROUTE_TRACE": str(trace)}, capture_output=True, text=True
        )
        if p.returncode != 0:
            return {"error": p.stderr[-1500:]}
        r = json.loads(out.read_text())
    keys = ("decode_tok_s", "decode_hit_rate", "experts_in_vram", "experts_total", "vram_budget_mib")
    return {k: r[k] for k in keys if k in r}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--llama-bench", help="llama-bench built for this card (without it: ours only)")
    ap.add_argument("--budgets-gib", default="6,10,16,24")
    ap.add_argument("--traces", default="realistic,uniform")
    ap.add_argument(
        "--fills",
        default="profile",
        help="cache fills to run ours with: profile, hottest, layers (see ours())",
    )
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "strata-traces")
    ap.add_argument("--out")
    a = ap.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    layers = _geometry(a.model)[0]
    traces = {name: _trace_file(name, a.model, a.work, 4096) for name in a.traces.split(",")}
    least, per_layer = (
        vram_per_layer(a.llama_bench, a.model, layers, a.threads) if a.llama_bench else (0, 0.0)
    )
    rows = []
    for gib in (float(g) for g in a.budgets_gib.split(",")):
        budget = int(gib * 1024)
        row: dict = {"budget_mib": budget}
        if a.llama_bench:
            row["llamacpp"] = best_ncmoe(
                a.llama_bench, a.model, layers, budget, a.decode, a.threads, least, per_layer
            )
        row["ours"] = {
            name if fill == "profile" else f"{name}_{fill}": ours(
                a.model, budget, t, a.decode, a.threads, fill
            )
            for fill in a.fills.split(",")
            for name, t in traces.items()
            if t
        }
        best = (row.get("llamacpp") or {}).get("decode_tok_s")
        if best:
            row["over_llamacpp"] = {
                name: round(r["decode_tok_s"] / best, 3)
                for name, r in row["ours"].items()
                if "decode_tok_s" in r
            }
        print(json.dumps(row), flush=True)
        rows.append(row)
    emit({"what": "bench/budget_curve.py: decode against the VRAM budget, ours per trace and llama.cpp's best -ncmoe",
          "model": Path(a.model).name, "layers": layers, "llamacpp_least_vram_mib": least,
          "llamacpp_vram_per_layer_mib": round(per_layer, 1), "rows": rows}, a.out)  # fmt: skip


if __name__ == "__main__":
    main()
