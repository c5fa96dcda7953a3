"""The CPU's routed experts from their blocks (engine.kernels.cpu_blocks.BlockExperts.mix): milliseconds for one
token's 8 experts of Qwen3-30B-A3B's shape (gate and up 768 x 2048, down 2048 x 768), random blocks of each type,
as JSON.

    python bench/cpu_mix_experts.py [--types Q8_0,Q4_K,Q5_0] [--reps 30] [--out F.json]

The card's CPU share of misses and CPU-only MoE runs compute their experts this way."""

import argparse
import sys
import time
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QT

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.report import emit
from engine.gguf.random_blocks import random_blocks
from engine.kernels import cpu_blocks

E, F, D, TOP = 16, 768, 2048, 8


def time_type(qt: QT, reps: int) -> float:
    gate = random_blocks(qt, E * F, D, seed=1).reshape(E, F, -1)
    up = random_blocks(qt, E * F, D, seed=2).reshape(E, F, -1)
    down = random_blocks(qt, E * D, F, seed=3).reshape(E, D, -1)
    experts = cpu_blocks.BlockExperts(gate, up, down, (qt, qt, qt), D, F)
    x = np.random.default_rng(0).standard_normal(D).astype(np.float32)
    out = np.empty(D, np.float32)
    ids, w = np.arange(TOP), np.full(TOP, 1.0 / TOP, np.float32)
    experts.mix(ids, w, x, out)  # compiles (or loads the cache)
    t0 = time.perf_counter()
    for _ in range(reps):
        experts.mix(ids, w, x, out)
    return (time.perf_counter() - t0) / reps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--types", default="Q8_0,Q4_K,Q5_0")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out")
    a = ap.parse_args()
    res = {t: round(time_type(QT[t], a.reps), 3) for t in a.types.split(",")}
    emit({"ms_per_token_of_8_experts": res, "shape": {"experts": E, "f": F, "d": D, "top_k": TOP}}, a.out)


if __name__ == "__main__":
    main()
