"""The prompt path's grouped expert kernels the way a chunk runs them: one gate/up launch (with the activation) and
one down launch per layer, on 48 layers' own experts (Qwen3-30B-A3B's shapes, Q4_K, 128 experts, top-8, random
routing), replayed from a CUDA graph, for each tile decoder of the type; chunks of 512 and 4,096 tokens.

    python bench/moe_gemm_micro.py [--out bench/results/moe_gemm_micro.json] [--tuned engine/kernels/gemv_tuned.json]

--tuned adds the fastest decoder to the tuning file ("Q4_K": {"moe_gemm": [variant]}), keeping its other entries."""

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from gguf import GGMLQuantizationType as QT

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.gemv_graph_micro import _graph_us
from engine.kernels.moe_blocks import BLOCK_M
from engine.kernels.moe_gemm import TILE_VARIANTS, Blocks, moe_gemm

LAYERS, E, TOPK, D, F = 48, 128, 8, 2048, 768
RB_GU, RB_DN = D // 256 * 144, F // 256 * 144


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--tuned")
    ap.add_argument("--tokens", default="512,4096")
    ap.add_argument(
        "--sweep",
        action="store_true",
        help="launch shapes (block rows, BLOCK_N, warps, stages) of the tuned decoder",
    )
    a = ap.parse_args()
    gate = _blocks((LAYERS, E, F, RB_GU))
    up = _blocks((LAYERS, E, F, RB_GU))
    down = _blocks((LAYERS, E, D, RB_DN))

    def table(w: torch.Tensor, i: int) -> torch.Tensor:
        return torch.tensor([w[i, e].data_ptr() for e in range(E)], device="cuda")

    tables = [(table(gate, i), table(up, i), table(down, i)) for i in range(LAYERS)]
    if a.sweep:
        return _sweep(a, tables)
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
        # keeps a launch shape the sweep chose
        print("moe_gemm:", _write_entry(Path(a.tuned), lambda old: [best, *old[1:]]))


def _write_entry(path: Path, make: Callable[[list[int]], list[int]]) -> list[int]:
    """Replace the tuning file's "Q4_K" "moe_gemm" entry with make(the old one), keeping everything else."""
    tuned = json.loads(path.read_text()) if path.exists() else {}
    entry = tuned.setdefault("Q4_K", {})
    entry["moe_gemm"] = make(entry.get("moe_gemm", []))
    path.write_text(json.dumps(tuned, indent=1) + "\n")
    return entry["moe_gemm"]


def _blocks(shape: tuple[int, ...]) -> torch.Tensor:
    """Random Q4_K rows with sane scales (random bytes there are often NaN or huge, which some decoders slow on)."""
    w = torch.randint(0, 256, shape, dtype=torch.uint8, device="cuda")
    sb = w.view(*shape[:-1], -1, 144)
    sb[..., 0:4] = torch.tensor([0.01, 0.004], dtype=torch.float16).view(torch.uint8).cuda()
    return w


# (block rows, BLOCK_N, warps, stages; 0 = Triton's default)
# fmt: off
SWEEP = [
    (64, 64, 8, 0), (64, 128, 8, 0), (64, 128, 8, 3), (64, 128, 8, 4), (64, 128, 4, 0), (64, 256, 8, 0),
    (64, 256, 16, 0), (32, 128, 4, 0), (32, 256, 8, 0), (64, 64, 4, 0), (32, 64, 4, 0), (128, 32, 4, 0),
]
# fmt: on


def _sweep(a: argparse.Namespace, tables: list) -> None:
    from engine.kernels.moe_gemm import block_table, expert_order, tile_variant

    v = tile_variant(QT.Q4_K)
    rows: list[dict] = []
    for t in [int(x) for x in a.tokens.split(",")]:
        ids = torch.stack([torch.randperm(E, device="cuda")[:TOPK] for _ in range(t)])
        x = torch.randn(t, D, device="cuda", dtype=torch.bfloat16)
        for bm, bn, w, st in SWEEP:
            blocks = Blocks(ids, E, block_table, expert_order, block_m=bm)

            def call(i: int, blocks: Blocks = blocks, x: torch.Tensor = x, s: int = t * TOPK,
                     launch: tuple = (bn, w, st)) -> torch.Tensor:  # fmt: skip
                g, u, dn = tables[i]
                h = moe_gemm(blocks, g, QT.Q4_K, RB_GU, x, F, D, TOPK, s, up_table=u, act="silu",
                             out_dtype=torch.bfloat16, variant=v, launch=launch)  # fmt: skip
                return moe_gemm(blocks, dn, QT.Q4_K, RB_DN, h, D, F, TOPK, s, x_per_slot=True, variant=v,
                                launch=launch)  # fmt: skip

            try:
                us = _graph_us(call, LAYERS)
            except Exception as e:  # a shape this GPU cannot build (registers, shared memory)
                rows.append({"tokens": t, "launch": [bm, bn, w, st], "error": str(e).splitlines()[0][:120]})
            else:
                rows.append({"tokens": t, "launch": [bm, bn, w, st], "us_per_layer": round(us, 1)})
            print(json.dumps(rows[-1]), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps({"variant": v, "rows": rows}, indent=1) + "\n")
    if (
        a.tuned
    ):  # the launch shape with the least time over the chunk sizes, at the block rows the engine uses
        total: dict[tuple, float] = {}
        for r in rows:
            if "us_per_layer" in r and r["launch"][0] == BLOCK_M:
                key = tuple(r["launch"][1:])
                total[key] = total.get(key, 0.0) + r["us_per_layer"]
        best = min(total, key=total.__getitem__)
        print("moe_gemm:", _write_entry(Path(a.tuned), lambda _old: [v, *best]))


if __name__ == "__main__":
    main()
