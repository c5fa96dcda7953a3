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
VARIANTS = {"Q4_K": {"default": None}, "Q6_K": {"default": None}, "Q8_0": {"default": None}}


def _time(raw, qt, n, k, x, bn, warps, vid) -> float:
    return triton.testing.do_bench(
        lambda: gemv(raw, qt, n, k, x, block_n=bn, num_warps=warps, variant=vid), warmup=5, rep=20
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    a = ap.parse_args()
    rows = []
    for tname, variants in VARIANTS.items():
        qt = QT[tname]
        for n, k in SHAPES:
            raw = torch.from_numpy(random_blocks(qt, n, k, seed=0)).cuda()
            x = torch.randn(1, k, device="cuda")
            for vname, vid in variants.items():
                for bn in (8, 16, 32):
                    for warps in (4, 8):
                        try:
                            ms = _time(raw, qt, n, k, x, bn, warps, vid)
                        except Exception as e:  # a variant that does not compile is reported, not fatal
                            rows.append(
                                {
                                    "type": tname,
                                    "n": n,
                                    "k": k,
                                    "variant": vname,
                                    "block_n": bn,
                                    "warps": warps,
                                    "error": str(e)[:120],
                                }
                            )
                            continue
                        rows.append(
                            {
                                "type": tname,
                                "n": n,
                                "k": k,
                                "variant": vname,
                                "block_n": bn,
                                "warps": warps,
                                "us": ms * 1e3,
                                "GBps": raw.numel() / (ms * 1e-3) / 1e9,
                            }
                        )
    best = {}
    for r in rows:
        if "GBps" in r:
            key = f"{r['type']} {r['n']}x{r['k']}"
            if key not in best or r["GBps"] > best[key]["GBps"]:
                best[key] = r
    for key, r in best.items():
        print(key, r["variant"], r["block_n"], r["warps"], f"{r['GBps']:.0f} GB/s {r['us']:.1f} us")
    if a.out:
        Path(a.out).write_text(json.dumps({"best": best, "all": rows}, indent=1))


if __name__ == "__main__":
    main()
