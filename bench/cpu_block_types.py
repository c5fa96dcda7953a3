"""The CPU's block kernels per block type: a decode-sized product (one activation row) and prompt chunks (--rows)
with a weight of Qwen2.5-0.5B's down projection shape (896 x 4864), random blocks, as JSON.

    python bench/cpu_block_types.py [--types IQ3_S,IQ3_XXS,...] [--rows 1,64] [--threads N] [--reps 30] [--out F]

Each figure is the median of --reps calls of engine.kernels.cpu_blocks.matmul after one warm-up call (Numba
compiles at the first); GB/s counts the weight's bytes once a call."""

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from gguf import GGMLQuantizationType as QT

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.gguf.random_blocks import random_blocks
from engine.kernels import cpu_blocks

N_OUT, K = 896, 4864


def _time(raw: torch.Tensor, qt: QT, x: torch.Tensor, reps: int) -> float:
    cpu_blocks.matmul(raw, qt, N_OUT, K, x)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        cpu_blocks.matmul(raw, qt, N_OUT, K, x)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--types", default=",".join(sorted(q.name for q in cpu_blocks.KINDS)))
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--rows", default="1,64", help="activation rows a product (comma-separated)")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    os.environ.setdefault("NUMBA_NUM_THREADS", str(a.threads))
    rows = []
    for name in a.types.split(","):
        qt = QT[name]
        raw = torch.from_numpy(random_blocks(qt, N_OUT, K, seed=1))
        nbytes = raw.numel()
        row: dict = {"type": name, "weight_mib": round(nbytes / 2**20, 2)}
        for t in (int(v) for v in a.rows.split(",")):
            s = _time(raw, qt, torch.randn(t, K), a.reps)
            row[f"rows_{t}_us"] = round(s * 1e6, 1)
            row[f"rows_{t}_GBps"] = round(nbytes / s / 1e9, 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
    out = {
        "what": "bench/cpu_block_types.py: engine.kernels.cpu_blocks.matmul per block type, 896 x 4864",
        "threads": a.threads,
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform()},
        "rows": rows,
    }
    if a.out:
        a.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
