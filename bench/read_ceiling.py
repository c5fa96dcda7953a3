"""What a decode GEMV could reach if reading the weights were all it did: a Triton kernel that only reads the same
bytes with the same program shapes (rows a program, 16-byte loads, the experts through address tables) and writes
one checksum a program, timed like bench/gemv_graph_micro.py (one launch per layer on 48 layers' own weights,
replayed from a CUDA graph). Against the GEMV figures it says whether the kernels lose their time to memory access
or to the instructions that decode the blocks.

    python bench/read_ceiling.py [--out bench/results/read_ceiling.json]"""

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.gemv_graph_micro import LAYERS, TOPK, _graph_us

E = 128
SHAPES = [  # name, rows, row bytes, experts (0: dense)
    ("qkv", 5120, 1152, 0),
    ("o", 2048, 2304, 0),
    ("head", 151936, 1680, 0),
    ("gate_up", 2 * 768, 1152, 8),  # gate and up rows of 8 experts
    ("down", 2048, 432, 8),
]


@triton.jit
def _read_kernel(table_ptr, ids_ptr, out_ptr, row_words, N, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr):
    """Program (row block, slot): sum the int32 words of BLOCK_N rows of the slot's matrix."""
    pid = tl.program_id(0)
    s = tl.program_id(1)
    base = tl.load(table_ptr + tl.load(ids_ptr + s)).to(tl.pointer_type(tl.int32))
    base = tl.multiple_of(base, 16)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.int32)
    for w0 in range(0, row_words, BLOCK_W):
        w = w0 + tl.arange(0, BLOCK_W)
        m = (rows[:, None] < N) & (w[None, :] < row_words)
        acc += tl.load(base + rows[:, None].to(tl.int64) * row_words + w[None, :], mask=m, other=0)
    tl.store(out_ptr + s * tl.num_programs(0) + pid, tl.sum(tl.sum(acc, axis=1), axis=0))


def read_rows(table: torch.Tensor, ids: torch.Tensor, n: int, row_bytes: int, block_n: int, block_w: int,
              warps: int) -> torch.Tensor:  # fmt: skip
    """int32 checksums [slots, programs] of rows 0..n-1 of the matrices at table[ids]."""
    s = ids.numel()
    grid = (triton.cdiv(n, block_n), s)
    out = torch.empty(s * grid[0], dtype=torch.int32, device=ids.device)
    _read_kernel[grid](table, ids, out, row_bytes // 4, n, BLOCK_N=block_n, BLOCK_W=block_w, num_warps=warps)
    return out.view(s, grid[0])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    a = ap.parse_args()
    rows: list[dict] = []
    for name, n, rb, experts in SHAPES:
        layers = 2 if name == "head" else LAYERS
        mats = max(1, E if experts else 1)
        w = torch.randint(0, 256, (layers, mats, n, rb), dtype=torch.uint8, device="cuda")
        tables = [
            torch.tensor([w[i, e].data_ptr() for e in range(mats)], device="cuda") for i in range(layers)
        ]
        ids = [
            (
                torch.randperm(E, device="cuda")[:TOPK]
                if experts
                else torch.zeros(1, dtype=torch.long, device="cuda")
            )
            for _ in range(layers)
        ]
        nbytes = n * rb * (experts or 1)
        for bn, bw, warps in itertools.product((1, 4, 16), (64, 256), (4, 8)):
            if bw * 4 > rb * 2:  # wider than a row: the same as the next narrower
                continue

            def call(i: int, bn: int = bn, bw: int = bw, warps: int = warps) -> torch.Tensor:
                return read_rows(tables[i], ids[i], n, rb, bn, bw, warps)  # noqa: B023  (timed at once, in this loop)

            try:
                us = _graph_us(call, layers)
            except Exception as e:  # a shape that does not build is reported, not fatal
                rows.append({"shape": name, "launch": [bn, bw, warps], "error": str(e)[:100]})
                continue
            rows.append({"shape": name, "launch": [bn, bw, warps], "us": round(us, 2),
                         "GBps": round(nbytes / (us * 1e-6) / 1e9, 1)})  # fmt: skip
        del w
        torch.cuda.empty_cache()
    best: dict[str, dict] = {}
    for r in rows:
        if "us" in r and (r["shape"] not in best or r["us"] < best[r["shape"]]["us"]):
            best[r["shape"]] = r
    for name, r in best.items():
        print(f"{name:8s} read only: launch {r['launch']} {r['us']:8.2f} us {r['GBps']:7.0f} GB/s")
    if a.out:
        Path(a.out).write_text(json.dumps({"best": best, "all": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
