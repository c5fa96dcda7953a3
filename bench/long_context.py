"""Long contexts: prompt tokens/s of long prompts and decode tokens/s deep into the context, ours and llama.cpp's in
one run, as JSON.

    python bench/long_context.py --model M.gguf [--prompts 4096,32768] [--depths 0,4096,16384,32768]
        [--decode 128] [--kv-types bf16,q4_0] [--prompt-kv-types bf16,q4_0] [--torch-attention 32768]
        [--llama-bench PATH [--llama-args '-ncmoe 36' --match-llama]]
        [--out bench/results/long-context.json]

Ours: the prompt is read as the server reads it (chunks of --prefill auto's size, bf16 KV); decode at depth D fills a
cache with D prompt tokens first, then times greedy steps after a few untimed ones (the decode graphs of that span
are captured there). `--torch-attention N` times an N-token prompt once more with the prompt chunks' attention in
torch (STRATA_FLASH_PREFILL=0's path) in the same process, for the kernel's own share. llama.cpp: llama-bench with
flash attention on, `-p N -n 0` for the prompts and `-d D -p 0 -n 128` for the depths, after ours (not at once);
with --match-llama before ours, and ours then runs within the VRAM llama.cpp used (its experts in VRAM as that
allows, the rest in host RAM)."""

import argparse
import json
import logging
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.engine_bench import _kv_bytes, measure_prompt, prompt_ids, read_prompt
from bench.report import emit
from engine.experts.policy import ExpertPolicy
from engine.layers.kv_cache import kv_bytes_per_value
from engine.pipeline.loader import load_model
from engine.pipeline.prefill import device_chunk, device_span


def decode_at(model, depth: int, n: int, chunk: int, span: int, kv: str = "bf16") -> dict:
    """Greedy decode of n tokens after `depth` prompt tokens on a `kv` cache -> tok/s, and the fill's time (after
    an untimed fill of up to two chunks, where a KV type's prompt kernels compile)."""
    warm = min(max(depth, 16), 2 * chunk + 16)
    cache = model.new_cache(warm + 8, kv)
    read_prompt(model, prompt_ids(warm), cache, chunk, span)
    del cache
    cache = model.new_cache(depth + n + 32, kv)
    torch.cuda.synchronize()
    t = time.perf_counter()
    read_prompt(model, prompt_ids(max(depth, 16)), cache, chunk, span)
    torch.cuda.synchronize()
    fill_s = time.perf_counter() - t
    p = max(depth, 16)
    tok = torch.tensor([42])
    for _ in range(8):  # the span's graphs are captured in these
        tok = model.forward(tok, cache, p)[-1].argmax().view(1).cpu()
        p += 1
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        tok = model.forward(tok, cache, p)[-1].argmax().view(1).cpu()
        p += 1
    torch.cuda.synchronize()
    out = {"decode_tok_s": round(n / (time.perf_counter() - t), 2), "fill_s": round(fill_s, 3)}
    del cache
    torch.cuda.empty_cache()
    return out


def _gpu_used_mib() -> int:
    r = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
        capture_output=True,
        text=True,
        check=False,
    )
    return int(r.stdout.split()[0]) if r.returncode == 0 and r.stdout.strip() else 0


def llama_bench(
    binary: str, model: str, prompts: list[int], depths: list[int], n: int, extra: list[str]
) -> dict:
    """llama-bench's prompt and depth figures, and the most VRAM the card had in use while it ran (nvidia-smi every
    0.2 s: with nothing else on the card, llama.cpp's own)."""
    base = [binary, "-m", model, "-ngl", "99", "-fa", "1", "-r", "2", "-o", "json", *extra]
    res: dict = {"args": extra}
    peak = [0]
    done = threading.Event()

    def poll() -> None:
        while not done.wait(0.2):
            peak[0] = max(peak[0], _gpu_used_mib())

    threading.Thread(target=poll, daemon=True).start()
    runs = []
    if prompts:
        runs.append(["-p", ",".join(map(str, prompts)), "-n", "0"])
    if depths:
        runs.append(["-d", ",".join(map(str, depths)), "-p", "0", "-n", str(n)])
    for args in runs:
        r = subprocess.run(base + args, capture_output=True, text=True, check=False)
        if r.returncode != 0:
            res.setdefault("errors", []).append(r.stderr[-2000:])
            continue
        for row in json.loads(r.stdout):
            if row["n_prompt"]:
                res[f"prompt_{row['n_prompt']}_tok_s"] = round(row["avg_ts"], 2)
            else:
                res[f"decode_depth_{row.get('n_depth', 0)}_tok_s"] = round(row["avg_ts"], 2)
    done.set()
    res["vram_peak_mib"] = peak[0]
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", default="4096,32768")
    ap.add_argument("--depths", default="0,4096,16384,32768")
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--kv-types", default="bf16", help="KV types decoded at each depth, e.g. bf16,int8")
    ap.add_argument(
        "--prompt-kv-types", default="bf16", help="KV types the prompts are read into, e.g. bf16,q4_0"
    )
    ap.add_argument(
        "--torch-attention", type=int, default=0, help="also time a prompt of N with torch's attention"
    )
    ap.add_argument("--vram-budget-mib", type=int, default=None)
    ap.add_argument(
        "--kv-host-fraction",
        type=float,
        default=0.0,
        help="the share of the layers whose KV lives in page-locked host RAM (as --kv-resident places it: the "
        "later layers), for every prompt and depth measured; the expert budget gets their room",
    )
    ap.add_argument("--llama-bench", help="llama-bench binary: measured after ours")
    ap.add_argument("--llama-args", default="", help="more llama-bench arguments, e.g. '-ncmoe 36 -t 16'")
    ap.add_argument(
        "--match-llama",
        action="store_true",
        help="run llama-bench first and give ours the VRAM it used (its peak, less our CUDA context)",
    )
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--out")
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    prompts = [int(x) for x in a.prompts.split(",") if x]
    depths = [int(x) for x in a.depths.split(",") if x]
    max_ctx = max([*prompts, *(d + a.decode + 32 for d in depths)]) + 8
    # the budget keeps room for the largest KV type measured (a q4_0-only run fits a longer context in less VRAM)
    used = {*a.prompt_kv_types.split(","), *(a.kv_types.split(",") if depths else ())}
    reserve_kv = max(used, key=lambda kv: kv_bytes_per_value(kv))
    lc = None
    if a.match_llama:
        assert a.llama_bench, "--match-llama needs --llama-bench"
        lc = llama_bench(a.llama_bench, a.model, prompts, depths, a.decode, a.llama_args.split())
        torch.empty(1, device="cuda")
        context_mib = _gpu_used_mib()  # our CUDA context alone
        a.vram_budget_mib = lc["vram_peak_mib"] - context_mib
    t0 = time.perf_counter()
    lm = load_model(
        a.model,
        device="cuda",
        dtype="bf16",
        experts=ExpertPolicy(
            vram_budget_mib=a.vram_budget_mib,
            kv_bytes=int(_kv_bytes(a.model, max_ctx, reserve_kv) * (1 - a.kv_host_fraction))
            if a.vram_budget_mib
            else 0,
        ),
    )
    m = lm.model
    layers = list(m.layer_range)
    m.kv_host_layers = frozenset(layers[round(len(layers) * (1 - a.kv_host_fraction)) :])
    chunk = device_chunk(m, max_ctx, reserve_kv, a.vram_budget_mib, ExpertPolicy.reserve_mib)
    span = device_span(m, chunk, max_ctx, reserve_kv, a.vram_budget_mib, ExpertPolicy.reserve_mib)
    res: dict = {
        "model": Path(a.model).name,
        "load_s": round(time.perf_counter() - t0, 1),
        "gpu": torch.cuda.get_device_name(),
        "vram_budget_mib": a.vram_budget_mib,
        "prompt_chunk": chunk,
        "prompt_span": span,
        "flash_prefill": m.prefill_kernel is not None,
        "kv_host_layers": len(m.kv_host_layers),
        "ours": {},
    }
    ours = res["ours"]
    for kv in a.prompt_kv_types.split(","):
        for n in prompts:
            key = f"prompt_{n}_tok_s" if kv == "bf16" else f"prompt_{n}_{kv}_tok_s"
            ours[key] = round(measure_prompt(m, n, a.reps, chunk, span, kv), 2)
            print(f"prompt {n} ({kv} KV): {ours[key]} tok/s", flush=True)
    if a.torch_attention:
        kernel, m.prefill_kernel = m.prefill_kernel, None
        ours[f"prompt_{a.torch_attention}_torch_attention_tok_s"] = round(
            measure_prompt(m, a.torch_attention, 0, chunk, span), 2
        )
        m.prefill_kernel = kernel
    for kv in a.kv_types.split(","):
        for d in depths:
            key = f"decode_depth_{d}" + ("" if kv == "bf16" else f"_{kv}")
            ours[key] = decode_at(m, d, a.decode, chunk, span, kv)
            print(f"{kv} depth {d}: {ours[key]}", flush=True)
    res["vram_peak_mib"] = torch.cuda.max_memory_allocated() >> 20
    res["vram_used_mib"] = _gpu_used_mib()  # the card's, ours alone on it (nvidia-smi)
    if a.llama_bench:
        del lm, m
        torch.cuda.empty_cache()
        if lc is None:
            lc = llama_bench(a.llama_bench, a.model, prompts, depths, a.decode, a.llama_args.split())
        res["llamacpp"] = lc
        res["ratios"] = {
            k: round(ours[k] / lc[k], 3) for k in ours if k.startswith("prompt_") and k in lc and lc[k]
        }
        for d in depths:
            key = f"decode_depth_{d}_tok_s"
            theirs = lc.get(key)
            for kv in a.kv_types.split(","):  # each KV type of ours against llama.cpp's cache
                mine = ours.get(f"decode_depth_{d}" + ("" if kv == "bf16" else f"_{kv}"))
                if theirs and mine:
                    res["ratios"][key.replace("_tok_s", "" if kv == "bf16" else f"_{kv}") + "_tok_s"] = round(
                        mine["decode_tok_s"] / theirs, 3
                    )
    emit(res, a.out)


if __name__ == "__main__":
    main()
