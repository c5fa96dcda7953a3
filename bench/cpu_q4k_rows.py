"""The CPU's routed experts for a batched decode step (a card's share of misses with 8 clients): T rows each
choosing K of E experts of Qwen3-30B-A3B's shape (gate/up 768x2048, down 2048x768; Q4_K, down Q4_K or Q6_K as
Q4_K_M files mix them), every row's pairs in one `Q4KExperts.mix_rows` call. E x 2.65 MB of blocks lie beyond the
host's caches, and the choice changes every call, so the blocks come from RAM as a step's misses do.

    python bench/cpu_q4k_rows.py [--rows 1,8] [--experts 128] [--k 8] [--reps 30] [--threads N] [--out F.json]"""

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QT

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.report import emit

D, F = 2048, 768


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,8", help="rows of the step, comma-separated")
    ap.add_argument("--experts", type=int, default=128, help="experts of the layer")
    ap.add_argument("--k", type=int, default=8, help="experts a row chooses")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out")
    a = ap.parse_args()
    os.environ.setdefault("NUMBA_NUM_THREADS", str(a.threads))
    import numba

    from engine.experts.cpu_q4k import Q4KExperts
    from engine.gguf.random_blocks import random_blocks

    def store(qt: QT, rows: int, cols: int, seed: int) -> np.ndarray:
        return np.stack([random_blocks(qt, rows, cols, seed=seed * 1000 + e) for e in range(a.experts)])

    gate, up = store(QT.Q4_K, F, D, 1), store(QT.Q4_K, F, D, 2)
    rng = np.random.default_rng(0)
    res: dict = {"what": __doc__.split("\n\n")[0].replace("\n", " "), "threads": numba.get_num_threads(),
                 "experts": a.experts, "k": a.k}  # fmt: skip
    for down_kind in (QT.Q4_K, QT.Q6_K):
        down = store(down_kind, D, F, 3)
        ex = Q4KExperts(gate, up, down, D, F, down_q6k=down_kind == QT.Q6_K)
        per_expert = gate[0].nbytes + up[0].nbytes + down[0].nbytes
        for t in (int(r) for r in a.rows.split(",")):
            x = rng.standard_normal((t, D)).astype(np.float32)
            out = np.zeros((t, D), np.float32)
            times, distinct = [], []
            for i in range(a.reps + 1):
                ids = np.concatenate([rng.choice(a.experts, a.k, replace=False) for _ in range(t)])
                tok = np.repeat(np.arange(t), a.k)
                w = np.full(ids.size, 1.0 / a.k, np.float32)
                s = time.perf_counter()
                ex.mix_rows(ids, tok, w, x, out)
                if i:  # the first call compiles
                    times.append(time.perf_counter() - s)
                    distinct.append(len(set(ids.tolist())))
            ms = statistics.median(times) * 1e3
            res[f"down_{down_kind.name}_rows_{t}"] = {
                "ms_median": round(ms, 3), "ms_min": round(min(times) * 1e3, 3),
                "distinct_experts": round(statistics.mean(distinct), 1),
                "GBps": round(statistics.mean(distinct) * per_expert / (ms / 1e3) / 1e9, 2),
            }  # fmt: skip
    emit(res, a.out)


if __name__ == "__main__":
    main()
