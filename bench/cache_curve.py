"""The expert cache on one GPU: decode tokens/s and hit rates against the fraction of experts in VRAM, and the VRAM
used under budgets that emulate smaller cards (allocated and reserved by torch, against the budget given).

python bench/cache_curve.py --model F [--fractions 0,0.25,0.5,0.75,1] [--budgets 10240,16384,24576]
                            [--out bench/results/cache_curve.json]"""

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.engine_bench import measure_decode, measure_prompt
from engine.experts.policy import ExpertPolicy, MiB
from engine.gguf.model_config import ModelConfig
from engine.gguf.reader import GGUFFile
from engine.layers.kv_cache import kv_bytes_per_token
from engine.models.registry import file_config
from engine.pipeline.loader import load_model
from engine.tokenizer import Tokenizer


def _free() -> None:
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def _config(model_path: str) -> ModelConfig:
    gf = GGUFFile.open(model_path)
    return file_config(gf, Tokenizer.from_metadata(gf.metadata).vocab_size)


def curve_point(model_path: str, fraction: float, decode: int, misses_path: str = "copy") -> dict:
    _free()
    c = _config(model_path)
    slots = round(fraction * c.n_layer * c.n_expert)
    lm = load_model(
        model_path, device="cuda", dtype="bf16", experts=ExpertPolicy(slots=slots, miss_path=misses_path)
    )
    cache = lm.model.expert_cache
    before = cache.stats()
    tok_s = measure_decode(lm.model, decode, 1)
    after = cache.stats()
    hits, misses = after.hits - before.hits, after.misses - before.misses
    out = {
        "fraction": fraction,
        "miss_path": misses_path,
        "misses": misses,
        "experts_in_vram": after.experts_in_vram,
        "experts_total": after.experts_total,
        "decode_tok_s": round(tok_s, 2),
        "hit_rate": round(hits / max(1, hits + misses), 4),
        "vram_allocated_peak": torch.cuda.max_memory_allocated(),
    }
    del lm, cache
    return out


def budget_point(model_path: str, budget_mib: int, prompt: int, decode: int) -> dict:
    _free()
    ctx = prompt + decode + 128
    t0 = time.perf_counter()
    c = _config(model_path)
    kv = c.n_layer * ctx * kv_bytes_per_token(c, "bf16")  # the bf16 KV cache this run allocates
    policy = ExpertPolicy(vram_budget_mib=budget_mib, kv_bytes=kv)
    lm = load_model(model_path, device="cuda", dtype="bf16", experts=policy)
    st = lm.model.expert_cache.stats()
    prompt_tok_s = measure_prompt(lm.model, prompt, 1, prompt)
    decode_tok_s = measure_decode(lm.model, decode, 1)
    reserved = torch.cuda.max_memory_reserved()
    out = {
        "budget_mib": budget_mib,
        "experts_in_vram": st.experts_in_vram,
        "experts_total": st.experts_total,
        f"prompt_{prompt}_tok_s": round(prompt_tok_s, 1),
        "decode_tok_s": round(decode_tok_s, 2),
        "allocated_peak_mib": round(torch.cuda.max_memory_allocated() / MiB),
        "reserved_peak_mib": round(reserved / MiB),
        "within_budget": reserved <= budget_mib * MiB,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    del lm
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--fractions", default="0,0.25,0.5,0.75,1")
    ap.add_argument("--budgets", default="10240,16384,24576")
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--misses", default="copy", help="comma-separated --expert-misses paths to measure")
    ap.add_argument("--out")
    a = ap.parse_args()
    res: dict = {"model": Path(a.model).name, "curve": [], "budgets": []}
    for f, m in [(float(x), m) for x in a.fractions.split(",") if x for m in a.misses.split(",")]:
        res["curve"].append(curve_point(a.model, f, a.decode, m))
        print(json.dumps(res["curve"][-1]), flush=True)
    for b in [int(x) for x in a.budgets.split(",") if x]:
        res["budgets"].append(budget_point(a.model, b, a.prompt, a.decode))
        print(json.dumps(res["budgets"][-1]), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
