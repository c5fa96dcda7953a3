"""Our engine on one GGUF: prompt tokens/s at given lengths, decode tokens/s, VRAM, and a per-step profile.

    python bench/engine_bench.py --model M.gguf [--prompts 512,4096] [--decode 128] [--expert-slots N]
                                 [--profile] [--out bench/results/ours.json]

Prompts are fixed token ids (not from a cache); decode is greedy from the longest prompt... as llama-bench does,
prompt and decode are measured separately: decode starts from a short prompt."""

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.experts.policy import ExpertPolicy
from engine.loader import load_model


def _sync() -> None:
    torch.cuda.synchronize()


def measure_prompt(model, n: int, reps: int, chunk: int) -> float:
    ids = torch.randint(100, 10000, (n,), generator=torch.Generator().manual_seed(n))
    best = 0.0
    for _ in range(reps):
        cache = model.new_cache(n + 8, "bf16")
        _sync()
        t = time.perf_counter()
        for s in range(0, n, chunk):
            model.forward(ids[s : s + chunk], cache, s, last_only=True)  # as the Runner reads a prompt
        _sync()
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


def profile_step(model) -> dict:
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
    kinds: Counter = Counter()
    times: Counter = Counter()
    by_name: Counter = Counter()
    n_by_name: Counter = Counter()
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            name = ev.name
            t = ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
            by_name[name[:80]] += t
            n_by_name[name[:80]] += 1
            cls = (
                "gemv"
                if "gemv" in name
                else "attention"
                if "attention" in name.lower()
                or "attn" in name.lower()
                or "flash" in name.lower()
                or "fmha" in name.lower()
                else "gemm"
                if "gemm" in name.lower()
                else "elementwise/other"
            )
            kinds[cls] += 1
            times[cls] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
    return {
        "kernels_per_token": {k: v / 4 for k, v in kinds.items()},
        "us_per_token": {k: v / 4 for k, v in times.items()},
        # the costliest kernels by name: what to fuse or speed up next
        "top_kernels": [
            {"name": n, "per_token": n_by_name[n] / 4, "us_per_token": round(t / 4, 1)}
            for n, t in by_name.most_common(20)
        ],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", default="512,4096")
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--expert-slots", type=int, default=None)
    ap.add_argument("--expert-misses", choices=("direct", "copy"), default="direct")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--no-graphs", action="store_true")
    ap.add_argument("--out")
    a = ap.parse_args()
    t0 = time.perf_counter()
    lm = load_model(
        a.model,
        device="cuda",
        dtype="bf16",
        experts=ExpertPolicy(slots=a.expert_slots, miss_path=a.expert_misses),
        cuda_graphs=not a.no_graphs,
    )
    res: dict = {
        "model": Path(a.model).name,
        "load_s": time.perf_counter() - t0,
        "expert_slots": a.expert_slots,
        "expert_misses": a.expert_misses,
    }
    if lm.model.expert_cache is not None:
        st = lm.model.expert_cache.stats()
        res["experts_in_vram"], res["experts_total"] = st.experts_in_vram, st.experts_total
    res["decode_tok_s"] = measure_decode(lm.model, a.decode, a.reps)
    for n in [int(x) for x in a.prompts.split(",") if x]:
        res[f"prompt_{n}_tok_s"] = measure_prompt(lm.model, n, a.reps, a.chunk)
    res["vram_peak_bytes"] = torch.cuda.max_memory_allocated()
    res["file_bytes"] = sum(p.stat().st_size for p in lm.gguf.paths)
    if a.profile:
        res["profile"] = profile_step(lm.model)
    text = json.dumps(res, indent=1)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
