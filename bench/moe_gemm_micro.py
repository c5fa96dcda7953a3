"""The prompt path's grouped expert kernels the way a chunk runs them: one gate/up launch (with the activation) and
one down launch per layer, on 48 layers' own experts (Qwen3-30B-A3B's shapes, Q4_K, 128 experts, top-8, random
routing), replayed from a CUDA graph, for each tile decoder of the type; chunks of 512 and 4,096 tokens.

    python bench/moe_gemm_micro.py [--out bench/results/moe_gemm_micro.json] [--tuned engine/kernels/gemv_tuned.json]

--tuned adds the fastest decoder to the tuning file ("Q4_K": {"moe_gemm": [variant]}), keeping its other entries."""

import argparse
import json
import sys
from pathlib import Path

import torch
from gguf import GGMLQuantizationType as QT

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.gemv_graph_micro import _graph_us
from engine.kernels.moe_gemm import TILE_VARIANTS, Blocks, moe_gemm

LAYERS, E, TOPK, D, F = 48, 128, 8, 2048, 768
RB_GU, RB_DN = D // 256 * 144, F // 256 * 144


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--tuned")
    ap.add_argument("--tokens", default="512,4096")
    a = ap.parse_args()
    gate = torch.randint(0, 256, (LAYERS, E, F, RB_GU), dtype=torch.uint8, device="cuda")
    up = torch.randint(0, 256, (LAYERS, E, F, RB_GU), dtype=torch.uint8, device="cuda")
    down = torch.randint(0, 256, (LAYERS, E, D, RB_DN), dtype=torch.uint8, device="cuda")

    def table(w: torch.Tensor, i: int) -> torch.Tensor:
        return torch.tensor([w[i, e].data_ptr() for e in range(E)], device="cuda")

    tables = [(table(gate, i), table(up, i), table(down, i)) for i in range(LAYERS)]
    rows: list[dict] = []
    for t in [int(x) for x in a.tokens.split(",")]:
        ids = torch.stack([torch.randperm(E, device="cuda")[:TOPK] for _ in range(t)])
        blocks = Blocks(ids, E)
        x = torch.randn(t, D, device="cuda", dtype=torch.bfloat16)
        for v in TILE_VARIANTS[QT.Q4_K]:

            def call(
                i: int, v: int = v, blocks: Blocks = blocks, x: torch.Tensor = x, s: int = t * TOPK
            ) -> torch.Tensor:
                g, u, dn = tables[i]
                h = moe_gemm(blocks, g, QT.Q4_K, RB_GU, x, F, D, TOPK, s, up_table=u, act="silu",
                             out_dtype=torch.bfloat16, variant=v)  # fmt: skip
                return moe_gemm(blocks, dn, QT.Q4_K, RB_DN, h, D, F, TOPK, s, x_per_slot=True, variant=v)

            us = _graph_us(call, LAYERS)
            nbytes = E * (2 * F * RB_GU + D * RB_DN)  # every expert is read at these chunk sizes
            rows.append({"tokens": t, "variant": v, "us_per_layer": round(us, 1),
                         "weights_GBps": round(nbytes / (us * 1e-6) / 1e9, 1)})  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=1) + "\n")
    if a.tuned:
        total = {v: sum(r["us_per_layer"] for r in rows if r["variant"] == v) for v in TILE_VARIANTS[QT.Q4_K]}
        best = min(total, key=total.__getitem__)
        path = Path(a.tuned)
        tuned = json.loads(path.read_text()) if path.exists() else {}
        tuned.setdefault("Q4_K", {})["moe_gemm"] = [best]
        path.write_text(json.dumps(tuned, indent=1) + "\n")
        print("moe_gemm tile decoder:", best)


if __name__ == "__main__":
    main()
