"""GB/s of the block-format GEMV kernels on decode shapes, for kernel variants, rows per program and warps.

python bench/gemv_micro.py [--out bench/results/gemv_micro.json]"""

import argparse
import json
import sys
from pathlib import Path

import torch
import triton.testing
from gguf import GGMLQuantizationType as QT

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from engine.gguf.random_blocks import random_blocks
from engine.kernels.gemv import gemv

SHAPES = [(4096, 2048), (2048, 4096), (768, 2048), (151936, 2048)]  # attn_q, attn_output, one expert, head
SWEEP = {"Q4_K": (1, 2, 4, 8), "Q6_K": (1,), "Q8_0": (1,)}  # super-blocks a step (Q4_K only)


def _time(raw, qt, n, k, x, bn, warps, sb) -> float:
    return triton.testing.do_bench(
        lambda: gemv(raw, qt, n, k, x, block_n=bn, num_warps=warps, sb=sb), warmup=5, rep=20
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", help="all measurements (JSON)")
    ap.add_argument(
        "--tuned", help="write the best launch shape per type and size class here (gemv_tuned.json)"
    )
    a = ap.parse_args()
    rows = []
    for tname, steps in SWEEP.items():
        qt = QT[tname]
        for n, k in SHAPES:
            raw = torch.from_numpy(random_blocks(qt, n, k, seed=0)).cuda()
            x = torch.randn(1, k, device="cuda")
            for sb in steps:
                for bn in (4, 8, 16):
                    for warps in (4, 8):
                        row = {"type": tname, "n": n, "k": k, "sb": sb, "block_n": bn, "warps": warps}
                        try:
                            ms = _time(raw, qt, n, k, x, bn, warps, sb)
                        except Exception as e:  # a shape that does not compile is reported, not fatal
                            rows.append({**row, "error": str(e)[:120]})
                            continue
                        rows.append({**row, "us": ms * 1e3, "GBps": raw.numel() / (ms * 1e-3) / 1e9})
    best: dict[str, dict] = {}
    for r in rows:
        if "GBps" in r:
            key = f"{r['type']} {r['n']}x{r['k']}"
            if key not in best or r["GBps"] > best[key]["GBps"]:
                best[key] = r
    for key, r in best.items():
        print(key, r["sb"], r["block_n"], r["warps"], f"{r['GBps']:.0f} GB/s {r['us']:.1f} us")
    # Per type and size class, the shape with the least total time over that class's measured matrices.
    tuned: dict[str, dict[str, list[int]]] = {}
    for tname in SWEEP:
        for cls, pick in (("small", lambda n: n <= 8192), ("large", lambda n: n > 8192)):
            totals: dict[tuple[int, int, int], float] = {}
            for r in rows:
                if r["type"] == tname and pick(r["n"]) and "us" in r:
                    key = (r["block_n"], r["sb"], r["warps"])
                    totals[key] = totals.get(key, 0.0) + r["us"]
            if totals:
                tuned.setdefault(tname, {})[cls] = list(min(totals, key=totals.get))
    print(json.dumps(tuned))
    if a.out:
        Path(a.out).write_text(json.dumps({"best": best, "tuned": tuned, "all": rows}, indent=1))
    if a.tuned:
        Path(a.tuned).write_text(json.dumps(tuned, indent=1) + "\n")


if __name__ == "__main__":
    main()
