"""Our engine on one GGUF: prompt tokens/s at given lengths, decode tokens/s, VRAM, and a per-step profile.

    python bench/engine_bench.py --model M.gguf [--prompts 512,4096] [--decode 128] [--expert-slots N]
                                 [--profile] [--out bench/results/ours.json]

Prompts are fixed token ids (not from a cache); decode is greedy from the longest prompt... as llama-bench does,
prompt and decode are measured separately: decode starts from a short prompt."""

import argparse
import logging
import os
import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.report import emit
from engine.experts.capacity import LAYER_MISS_COST
from engine.experts.policy import ExpertPolicy
from engine.pipeline.loader import load_model


def _kv_bytes(model_path: str, ctx: int, kv: str = "bf16") -> int:
    """The `kv` cache of the longest prompt measured (allocated after load: the expert budget leaves room)."""
    from engine.gguf.reader import GGUFFile
    from engine.layers.kv_cache import kv_bytes_per_token
    from engine.models.registry import file_config
    from engine.tokenizer import Tokenizer

    gf = GGUFFile.open(model_path)
    c = file_config(gf, Tokenizer.from_metadata(gf.metadata).vocab_size)
    return c.n_layer * ctx * kv_bytes_per_token(c, kv)


def _sync() -> None:
    torch.cuda.synchronize()


def prompt_ids(n: int) -> torch.Tensor:
    """n fixed token ids (seeded by n)."""
    return torch.randint(100, 10000, (n,), generator=torch.Generator().manual_seed(n))


def read_prompt(model, ids: torch.Tensor, cache, chunk: int, span: int = 0) -> None:
    """ids into `cache` from position 0 as the Runner reads a prompt: chunks, or spans of chunks read layer by layer
    where the card streams experts (span > chunk)."""
    n, step = ids.shape[0], max(span, chunk)
    for s in range(0, n, step):
        if min(n, s + step) - s > chunk:
            model.forward_span(ids[s : s + step], cache, s, chunk)
        else:
            model.forward(ids[s : s + chunk], cache, s, last_only=True)


def measure_prompt(model, n: int, reps: int, chunk: int, span: int = 0, kv: str = "bf16") -> float:
    """Best tok/s of `reps` timed n-token prompts into a `kv` cache, after an untimed one (kernels of new shapes
    compile there); reps=0: the one run, timed."""
    ids = prompt_ids(n)
    best = 0.0
    for rep in range(reps + 1):
        cache = model.new_cache(n + 8, kv)
        _sync()
        t = time.perf_counter()
        read_prompt(model, ids, cache, chunk, span)
        _sync()
        if rep or not reps:
            best = max(best, n / (time.perf_counter() - t))
        del cache
    return best


def measure_decode(model, n: int, reps: int) -> float:
    best = 0.0
    for _ in range(reps):
        cache = model.new_cache(n + 64, "bf16")
        model.forward(torch.arange(1, 17), cache, 0)
        tok = torch.tensor([42])
        # the first steps capture graphs; time after them
        for p in range(16, 20):
            logits = model.forward(tok, cache, p)
            tok = logits[-1].argmax().view(1).cpu()
        _sync()
        t = time.perf_counter()
        for p in range(20, 20 + n):
            logits = model.forward(tok, cache, p)
            tok = logits[-1].argmax().view(1).cpu()  # a real step: the next token depends on this one
        _sync()
        best = max(best, n / (time.perf_counter() - t))
    return best


def _kernel_table(prof, per: int) -> dict:
    """CUDA kernel counts and times from a torch profile, per `per` (tokens or chunks), by class and by name."""
    kinds: Counter = Counter()
    times: Counter = Counter()
    by_name: Counter = Counter()
    n_by_name: Counter = Counter()
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            name = ev.name
            low = name.lower()
            t = ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
            by_name[name[:80]] += t
            n_by_name[name[:80]] += 1
            if "gemv" in name:
                cls = "gemv"
            elif any(w in low for w in ("attention", "attn", "flash", "fmha")):
                cls = "attention"
            elif "gemm" in low or "matmul" in low:
                cls = "gemm"
            else:
                cls = "elementwise/other"
            kinds[cls] += 1
            times[cls] += t
    return {
        "kernels": {k: v / per for k, v in kinds.items()},
        "us": {k: round(v / per, 1) for k, v in times.items()},
        # the costliest kernels by name: what to fuse or speed up next
        "top_kernels": [
            {"name": n, "count": n_by_name[n] / per, "us": round(t / per, 1)}
            for n, t in by_name.most_common(20)
        ],
    }


def profile_step(model) -> dict:
    """Kernels of a decode step (per token)."""
    cache = model.new_cache(128, "bf16")
    model.forward(torch.arange(1, 17), cache, 0)
    tok = torch.tensor([42])
    for p in range(16, 20):
        model.forward(tok, cache, p)
    _sync()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for p in range(20, 24):
            model.forward(tok, cache, p)
        _sync()
    return _kernel_table(prof, 4)


def profile_prompt(model, n: int) -> dict:
    """Kernels of one n-token prompt chunk (per chunk), and its wall time."""
    ids = prompt_ids(n)
    cache = model.new_cache(n + 8, "bf16")
    model.forward(ids, cache, 0, last_only=True)  # warm: compile and tune first
    _sync()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        model.forward(ids, cache, 0, last_only=True)
        _sync()
        wall = time.perf_counter() - t
    return {"tokens": n, "wall_ms": round(wall * 1e3, 2), **_kernel_table(prof, 1)}


def host_profile(model, n: int) -> dict:
    """Where the host's time goes in one n-token prompt chunk: its wall time without a profiler, the CUDA runtime
    calls that wait for the device (synchronisations, blocking copies) from a CPU-side torch profile, and the
    Python functions with the most own time (cProfile)."""
    import cProfile
    import pstats

    ids = prompt_ids(n)
    cache = model.new_cache(n + 8, "bf16")
    model.forward(ids, cache, 0, last_only=True)
    _sync()
    walls = []
    for _ in range(3):
        t = time.perf_counter()
        model.forward(ids, cache, 0, last_only=True)
        host = time.perf_counter() - t  # the launches, before the device finishes
        _sync()
        walls.append((host * 1e3, (time.perf_counter() - t) * 1e3))
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        model.forward(ids, cache, 0, last_only=True)
        _sync()
    runtime = Counter()
    runtime_us = Counter()
    for ev in prof.events():
        if ev.name.startswith(("cuda", "cu")) and ev.device_type == torch.autograd.DeviceType.CPU:
            runtime[ev.name] += 1
            runtime_us[ev.name] += ev.cpu_time_total
    ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:25]
    pr = cProfile.Profile()
    pr.enable()
    model.forward(ids, cache, 0, last_only=True)
    _sync()
    pr.disable()
    st = pstats.Stats(pr)
    funcs = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:30]  # by own time
    return {
        "tokens": n,
        "host_then_wall_ms": [[round(a, 2), round(b, 2)] for a, b in walls],
        "runtime_calls": {k: [runtime[k], round(runtime_us[k] / 1e3, 2)] for k, _ in runtime.most_common(15)},
        "ops_self_cpu_ms": [[e.key[:70], e.count, round(e.self_cpu_time_total / 1e3, 2)] for e in ops],
        "python_own_ms": [
            [f"{Path(f).name}:{line}:{fn}", cc, round(tt * 1e3, 2), round(ct * 1e3, 2)]
            for (f, line, fn), (cc, _nc, tt, ct, _callers) in funcs
        ],
    }


def cpu_expert_timing(cpu, n: int = 64) -> dict:
    """The CPU's expert kernels alone, in this process: with the GPU idle, then while PCIe copies from pinned host
    memory run (what the step's own copies do to the CPU's memory reads)."""
    ce = next(iter(cpu.layers.values()))
    experts = [e for e in range(ce.n_experts) if ce.holds(e)][:8]
    xb = torch.randn(1, ce.d).to(torch.bfloat16)

    def run() -> float:
        t = time.perf_counter()
        for i in range(n):
            ce.expert(experts[i % len(experts)], xb)
        return 1e6 * (time.perf_counter() - t) / n

    run()
    idle = run()
    src = torch.empty(256 << 20, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty_like(src, device="cuda")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        for _ in range(60):  # ~0.3 s of copies at ~50 GB/s
            dst.copy_(src, non_blocking=True)
    busy = run()
    side.synchronize()
    return {"us_per_expert_gpu_idle": idle, "us_per_expert_during_pcie_copies": busy}


def _trace_profile(model_path: str) -> torch.Tensor:
    """Usage counts [n_layer, n_expert] from the second half of the replayed trace (STRATA_ROUTE_TRACE)."""
    from engine.experts.trace import load_trace, usage_counts
    from engine.gguf.reader import GGUFFile

    t = load_trace(os.environ["STRATA_ROUTE_TRACE"])
    gf = GGUFFile.open(model_path)
    n_layer = gf.get(f"{gf.architecture}.block_count")
    return torch.from_numpy(usage_counts(t, int(n_layer), t.tokens // 2))


def cuda_context_mib() -> int:
    """MiB of the card that this process's CUDA context takes, measured before anything else is allocated (what
    --vram-process-mib, another program's whole-process figure, leaves to the budget is that figure less this)."""
    torch.cuda.init()
    torch.empty(1, device="cuda")
    free, total = torch.cuda.mem_get_info()
    return (total - free) // 2**20


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", default="512,4096")
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument(
        "--chunk",
        default="auto",
        help="prompt chunk in tokens; auto (default): the server's --prefill auto, the largest that fits the VRAM "
        "left (with --vram-budget-mib or --vram-process-mib, within that budget)",
    )
    ap.add_argument(
        "--span",
        default="auto",
        help="tokens a prompt forward reads layer by layer where experts stream (Runner's prefill_span); auto "
        "(default): the server's; 0: chunk by chunk",
    )
    ap.add_argument("--expert-slots", type=int, default=None)
    ap.add_argument("--expert-misses", choices=("direct", "copy"), default="copy")
    ap.add_argument(
        "--expert-policy",
        choices=("profile", "lru", "lfu"),
        default="profile",
        help="the engine's --expert-policy",
    )
    ap.add_argument(
        "--expert-prefetch",
        choices=("off", "router"),
        default="off",
        help="the engine's --expert-prefetch (with STRATA_ROUTE_TRACE, STRATA_PREFETCH_TRACE=ACC predicts from the "
        "trace at that accuracy)",
    )
    ap.add_argument(
        "--profile-from-trace",
        action="store_true",
        help="with STRATA_ROUTE_TRACE: fill the cache from the usage counts of the trace's second half (a profile "
        "recorded earlier on like text; the run replays from its start)",
    )
    ap.add_argument(
        "--layer-miss-cost",
        default=str(LAYER_MISS_COST),
        help="the cache's plan per layer (engine/experts/capacity.py): a layer that misses costs this many missed "
        "experts beyond its misses; 'hottest': the profile's hottest (layer, expert) pairs, whatever the layer",
    )
    ap.add_argument(
        "--cpu-experts", type=float, default=None, help="the engine's --cpu-experts F (default: auto)"
    )
    ap.add_argument(
        "--cpu-ratio",
        default="",
        help="with --cpu-experts: the CPU's share of a step's misses, one decode figure each (e.g. 0.2,0.3,0.4)",
    )
    ap.add_argument("--threads", type=int, default=None, help="torch's CPU threads (the CPU's expert share)")
    ap.add_argument(
        "--tune-steps",
        type=int,
        default=256,
        help="decode steps run before the default decode figure while the CPU's share is tuned (recorded apart)",
    )
    ap.add_argument("--vram-budget-mib", type=int, default=None, help="the card behaves as one of this size")
    ap.add_argument(
        "--vram-reserve-mib",
        type=int,
        default=512,
        help="VRAM left free for other programs (the engine's --vram-reserve-mib; 0 to match a program that "
        "keeps none, as llama-bench)",
    )
    ap.add_argument(
        "--vram-process-mib",
        type=int,
        default=None,
        help="VRAM for the whole process as nvidia-smi counts it (another program's figure): the budget is this "
        "less our CUDA context, measured at start",
    )
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument(
        "--host-profile", type=int, default=0, help="where the host's time goes in an N-token chunk"
    )
    ap.add_argument("--no-graphs", action="store_true")
    ap.add_argument("--out")
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # the engine's own account, in the log
    if a.threads:
        torch.set_num_threads(a.threads)
    context_mib = cuda_context_mib()
    if a.vram_process_mib:
        a.vram_budget_mib = a.vram_process_mib - context_mib
    profile = _trace_profile(a.model) if a.profile_from_trace else None
    t0 = time.perf_counter()
    lm = load_model(
        a.model,
        device="cuda",
        dtype="bf16",
        experts=ExpertPolicy(
            slots=a.expert_slots,
            miss_path=a.expert_misses,
            eviction=a.expert_policy,
            prefetch=a.expert_prefetch,
            profile=profile,
            layer_miss_cost=None if a.layer_miss_cost == "hottest" else float(a.layer_miss_cost),
            cpu_share=a.cpu_experts,
            vram_budget_mib=a.vram_budget_mib,
            reserve_mib=a.vram_reserve_mib,
            kv_bytes=_kv_bytes(a.model, max(int(x) for x in a.prompts.split(",") if x) + 8)
            if a.vram_budget_mib
            else 0,
        ),
        cuda_graphs=not a.no_graphs,
    )
    res: dict = {
        "model": Path(a.model).name,
        "load_s": time.perf_counter() - t0,
        "expert_slots": a.expert_slots,
        "expert_misses": a.expert_misses,
        "expert_policy": a.expert_policy,
        "expert_prefetch": a.expert_prefetch,
        "prefetch_trace_accuracy": os.environ.get("STRATA_PREFETCH_TRACE") or None,
        "route_trace": Path(os.environ["STRATA_ROUTE_TRACE"]).name
        if os.environ.get("STRATA_ROUTE_TRACE")
        else None,
        "profile_from_trace": a.profile_from_trace,
        "cpu_experts": a.cpu_experts,
        "threads": torch.get_num_threads(),
        "vram_budget_mib": a.vram_budget_mib,
        "vram_process_mib": a.vram_process_mib,
        "vram_reserve_mib": a.vram_reserve_mib,
        "cuda_context_mib": context_mib,
    }
    # sized as the server sizes them: right after loading, before anything else allocates
    prompts = [int(x) for x in a.prompts.split(",") if x]
    max_ctx = max(prompts, default=512) + 8  # the longest prompt's KV cache
    if a.chunk == "auto":
        from engine.pipeline.prefill import device_chunk

        chunk = device_chunk(lm.model, max_ctx, "bf16", a.vram_budget_mib, a.vram_reserve_mib)
    else:
        chunk = int(a.chunk)
    res["prompt_chunk"] = chunk
    if a.span == "auto":
        from engine.pipeline.prefill import device_span

        span = device_span(lm.model, chunk, max_ctx, "bf16", a.vram_budget_mib, a.vram_reserve_mib)
    else:
        span = int(a.span)
    res["prompt_span"] = span
    if lm.model.expert_cache is not None:
        st = lm.model.expert_cache.stats()
        res["experts_in_vram"], res["experts_total"] = st.experts_in_vram, st.experts_total
    cpu = lm.model.expert_cache.cpu_misses if lm.model.expert_cache is not None else None
    if cpu is not None and cpu.tuner is not None and a.tune_steps:
        # the share is tuned while serving: these steps are a server's first requests (figure kept apart)
        res["decode_while_tuning_tok_s"] = measure_decode(lm.model, a.tune_steps, 1)
    before = lm.model.expert_cache.stats() if lm.model.expert_cache is not None else None
    res["decode_tok_s"] = measure_decode(
        lm.model, a.decode, a.reps
    )  # the engine's own choice of the CPU's share
    if before is not None:
        after = lm.model.expert_cache.stats()
        hits, misses = after.hits - before.hits, after.misses - before.misses
        res["decode_hit_rate"] = round(hits / max(hits + misses, 1), 4)  # the decode runs' selections
        res["decode_admissions"] = after.swaps - before.swaps
    if cpu is not None:
        res["cpu_slots"], res["cpu_timing"] = cpu.slots, cpu.timing()
        print(f"cpu share {cpu.ratio}: decode {res['decode_tok_s']:.1f} tok/s "
              f"quota {cpu.quota.tolist()}", flush=True)  # fmt: skip
    if cpu is not None and a.cpu_ratio:
        res["decode_by_cpu_ratio"] = {}
        for r in (float(x) for x in a.cpu_ratio.split(",")):
            cpu.set_ratio(r)
            before = cpu.slots
            tok_s = measure_decode(lm.model, a.decode, a.reps)
            res["decode_by_cpu_ratio"][str(r)] = {
                "decode_tok_s": tok_s,
                "cpu_slots": cpu.slots - before,
                **cpu.timing(),
            }
            print(f"cpu ratio {r}: decode {tok_s:.1f} tok/s", flush=True)
    if cpu is not None and cpu.layers:
        res["cpu_expert_kernels"] = cpu_expert_timing(cpu)
    for n in prompts:
        res[f"prompt_{n}_tok_s"] = measure_prompt(lm.model, n, a.reps, chunk, span)
        if n > chunk and span > chunk:  # the same prompt chunk by chunk, as before spans
            res[f"prompt_{n}_chunked_tok_s"] = measure_prompt(lm.model, n, a.reps, chunk, 0)
    res["vram_peak_bytes"] = torch.cuda.max_memory_allocated()
    res["vram_reserved_peak_bytes"] = torch.cuda.max_memory_reserved()
    res["file_bytes"] = sum(p.stat().st_size for p in lm.gguf.paths)
    if a.profile:
        res["profile"] = profile_step(lm.model)
        res["prompt_profile"] = profile_prompt(
            lm.model, min(int(x) for x in a.prompts.split(",") if x) if a.prompts else 512
        )
    if a.host_profile:
        res["host_profile"] = host_profile(lm.model, a.host_profile)
    emit(res, a.out)


if __name__ == "__main__":
    main()
