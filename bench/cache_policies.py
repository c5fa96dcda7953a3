"""Decode with part of the experts in VRAM, per routing trace and cache policy: which policy wins on which routing.

    python bench/cache_policies.py --model M.gguf --vram-process-mib 6099 [--traces uniform,realistic,local]
        [--policies profile,lru,lfu] [--llamacpp llama-bench.json] [--out bench/results/cache-policies.json]

Each trace (engine/experts/trace_gen.py's presets, made for the model's geometry, or a recorded .npz) is replayed in
place of the router (STRATA_ROUTE_TRACE) by bench/engine_bench.py, one process per (trace, policy), at the same VRAM
budget; "router" is the model's own routing. The "profile" policy fills the cache from the counts of the trace's
second half (a profile recorded earlier on like text). Beside each measured hit rate stands the simulator's
(engine/experts/trace.py) at the same slots per layer. With --llamacpp (llama-bench -o json at the same VRAM) each
decode figure gets its ratio to llama.cpp's. With --served each run is also measured through HTTP (one client,
bench/serve_clients.py), the server replaying the same trace at the same budget with the same profile."""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.report import emit
from engine.experts.profile import UsageProfile, profile_location, save_profile
from engine.experts.trace import hit_rate, load_trace, save_trace, usage_counts
from engine.experts.trace_gen import generate, trace_spec
from engine.gguf.reader import GGUFFile
from engine.models.registry import file_config
from engine.tokenizer import Tokenizer


def _geometry(model: str) -> tuple[int, int, int]:
    gf = GGUFFile.open(model)
    c = file_config(gf, Tokenizer.from_metadata(gf.metadata).vocab_size)
    moe = sum(1 for i in range(c.n_layer) if f"blk.{i}.ffn_gate_exps.weight" in gf.tensors)
    return moe, c.n_expert, c.n_expert_used


def _trace_file(name: str, model: str, work: Path, tokens: int) -> Path | None:
    if name == "router":
        return None
    if name.endswith(".npz"):
        return Path(name)
    path = work / f"{name}-{tokens}.npz"
    if not path.exists():
        layers, n_expert, k = _geometry(model)
        t0 = time.perf_counter()
        params, streams = trace_spec(name)  # NAME-xS: S conversations interleaved (a step of S slots' rows)
        save_trace(path, generate(tokens, layers, n_expert, k, params, seed=1, streams=streams))
        print(
            f"trace {name}: {tokens} tokens x {layers} layers in {time.perf_counter() - t0:.1f} s", flush=True
        )
    return path


def _profile_file(model: str, trace: Path, work: Path) -> Path:
    """The trace's second half as a usage profile file for `serve --profile` (engine_bench fills from the same)."""
    gf = GGUFFile.open(model)
    cfg = file_config(gf, Tokenizer.from_metadata(gf.metadata).vocab_size)
    path, ident = profile_location(gf, cfg, work / f"profile-{trace.stem}.json")
    t = load_trace(trace)
    counts = usage_counts(t, cfg.n_layer, t.tokens // 2)
    path.unlink(missing_ok=True)
    save_profile(path, UsageProfile(ident, counts, t.tokens - t.tokens // 2))
    return path


def _served(model: str, trace: Path | None, policy: str, budget_mib: int, work: Path, tokens: int) -> dict:
    """One client through HTTP (bench/serve_clients.py), the server replaying the same trace at the same budget."""
    here = Path(__file__).resolve().parent
    out = work / f"served-{trace.stem if trace else 'router'}-{policy}.json"
    args = f"--expert-policy {policy} --vram-budget-mib {budget_mib} --vram-reserve-mib 0 --parallel 1"
    env = dict(os.environ)
    env.pop("STRATA_ROUTE_TRACE", None)
    if trace is not None:
        env["STRATA_ROUTE_TRACE"] = str(trace)
        args += f" --profile {_profile_file(model, trace, work)}"
    cmd = [sys.executable, str(here / "serve_clients.py"), "--model", model, "--clients", "1", "--requests", "3",
           "--tokens", str(tokens), "--serve-args", args, "--out", str(out)]  # fmt: skip
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        return {"error": p.stderr[-600:]}
    r = json.loads(out.read_text())["rounds"][0]
    return {"served_decode_tok_s": r["aggregate_tok_s"], "served_latency_median_s": r["latency_median_s"]}


def _llamacpp_decode(path: str | None) -> float | None:
    if not path:
        return None
    rows = json.loads(Path(path).read_text())
    tg = [r["avg_ts"] for r in rows if r.get("n_gen", 0) > 0 and r.get("n_prompt", 0) == 0]
    return tg[0] if tg else None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--traces", default="router,uniform,realistic,local")
    ap.add_argument("--policies", default="profile,lru,lfu")
    ap.add_argument(
        "--vram-process-mib", type=int, help="the whole process's VRAM (llama.cpp's, as nvidia-smi)"
    )
    ap.add_argument("--vram-budget-mib", type=int)
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=4096, help="tokens of a generated trace")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--extra", default="", help="more engine_bench flags, e.g. '--cpu-experts 0'")
    ap.add_argument(
        "--served",
        action="store_true",
        help="also one client through HTTP per run (the engine_bench run's budget)",
    )
    ap.add_argument("--llamacpp", help="llama-bench -o json at the same VRAM: decode ratios")
    ap.add_argument("--work", default=None, help="folder for generated traces (default: a temporary one)")
    ap.add_argument("--out")
    a = ap.parse_args()
    work = Path(a.work or tempfile.mkdtemp(prefix="traces-"))
    work.mkdir(parents=True, exist_ok=True)
    here = Path(__file__).resolve().parent
    ref = _llamacpp_decode(a.llamacpp)
    res: dict = {"model": Path(a.model).name, "vram_process_mib": a.vram_process_mib,
                 "vram_budget_mib": a.vram_budget_mib, "llamacpp_decode_tok_s": ref, "runs": []}  # fmt: skip
    for name in [x for x in a.traces.split(",") if x]:
        path = _trace_file(name, a.model, work, a.tokens)
        for policy in [x for x in a.policies.split(",") if x]:
            out = work / f"run-{Path(name).stem}-{policy}.json"
            cmd = [sys.executable, str(here / "engine_bench.py"), "--model", a.model, "--prompts", "512",
                   "--decode", str(a.decode), "--reps", str(a.reps), "--expert-policy", policy, "--vram-reserve-mib",
                   "0", "--out", str(out), *a.extra.split()]  # fmt: skip
            if a.vram_process_mib:
                cmd += ["--vram-process-mib", str(a.vram_process_mib)]
            if a.vram_budget_mib:
                cmd += ["--vram-budget-mib", str(a.vram_budget_mib)]
            if a.threads:
                cmd += ["--threads", str(a.threads)]
            env = dict(os.environ)
            env.pop("STRATA_ROUTE_TRACE", None)
            if path is not None:
                env["STRATA_ROUTE_TRACE"] = str(path)
                cmd.append("--profile-from-trace")
            t0 = time.perf_counter()
            p = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if p.returncode != 0:
                print(p.stdout[-2000:], p.stderr[-4000:], file=sys.stderr)
                res["runs"].append({"trace": name, "policy": policy, "error": p.stderr[-600:]})
                continue
            r = json.loads(out.read_text())
            row = {
                "trace": name,
                "policy": policy,
                "decode_tok_s": round(r["decode_tok_s"], 1),
                "decode_hit_rate": r.get("decode_hit_rate"),
                "experts_in_vram": r.get("experts_in_vram"),
                "experts_total": r.get("experts_total"),
                "prompt_512_tok_s": round(r.get("prompt_512_tok_s", 0.0), 1),
                "vram_peak_mib": r["vram_peak_bytes"] >> 20,
                "wall_s": round(time.perf_counter() - t0, 1),
            }
            if ref:
                row["ratio_to_llamacpp"] = round(r["decode_tok_s"] / ref, 3)
            if path is not None and r.get("experts_in_vram") and r.get("experts_total"):
                t = load_trace(path)
                per_layer = r["experts_in_vram"] * t.n_expert // r["experts_total"]
                sample = t.ids[: min(t.tokens, 1024)]
                sim = {}
                for pol in ("lru", "lfu", "static"):
                    sim[pol] = round(
                        float(
                            np.mean(
                                [hit_rate(sample[:, j], per_layer, pol) for j in range(0, sample.shape[1], 6)]
                            )
                        ),
                        4,
                    )
                row["simulated_hit_rate"] = sim  # every 6th layer, first 1,024 tokens
                row["slots_per_layer"] = per_layer
            if a.served and r.get("vram_budget_mib"):
                row.update(_served(a.model, path, policy, r["vram_budget_mib"], work, a.decode))
                if ref and "served_decode_tok_s" in row:
                    row["served_ratio_to_llamacpp"] = round(row["served_decode_tok_s"] / ref, 3)
            print(json.dumps(row), flush=True)
            res["runs"].append(row)
    emit(res, a.out)


if __name__ == "__main__":
    main()
