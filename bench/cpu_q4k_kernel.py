"""The CPU's time for one token's routed experts (Qwen3-30B-A3B shapes, Q4_K: gate/up 768x2048, down 2048x768),
n = 1..4 experts a request: the in-place Q4_K kernels (engine/experts/cpu_q4k.py) against torch's 4-bit kernel on
a repacked copy (engine/experts/cpu_experts.py with the in-place kernels switched off), on the same blocks, and
what the host's RAM reads with the same threads (a parallel sum over 2 GiB). Expert ids change every call, so the
blocks come from RAM, not the caches.

python bench/cpu_q4k_kernel.py [--threads N] [--reps 300] [--out bench/results/cpu-q4k-kernel.json]"""

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as QT

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.report import emit

E, D, F = 64, 2048, 768  # 64 experts: ~170 MB of blocks, beyond the host's caches


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--out")
    a = ap.parse_args()
    os.environ.setdefault("NUMBA_NUM_THREADS", str(a.threads))
    torch.set_num_threads(a.threads)
    import numba

    from engine.experts import cpu_q4k
    from engine.experts.cpu_experts import CpuExperts
    from engine.gguf.random_blocks import random_blocks
    from engine.layers.qtensor import QTensor

    ok, why = cpu_q4k.available()
    if not ok:
        raise SystemExit(f"the in-place kernels cannot run here: {why}")
    rng = np.random.default_rng(0)

    def store(rows: int, cols: int, seed: int) -> QTensor:
        raw = np.stack([random_blocks(QT.Q4_K, rows, cols, seed=seed * 1000 + e) for e in range(E)])
        return QTensor(torch.from_numpy(raw), QT.Q4_K, (E, rows, cols))

    g, u, dn = store(F, D, 1), store(F, D, 2), store(D, F, 3)
    per_expert = sum(t.raw[0].numel() for t in (g, u, dn))
    inplace = CpuExperts(g, u, dn, range(E))
    avail = cpu_q4k.available
    cpu_q4k.available = lambda: (False, "switched off for the comparison")  # type: ignore[assignment]
    try:
        repacked = CpuExperts(g, u, dn, range(E))
    finally:
        cpu_q4k.available = avail  # type: ignore[assignment]
    assert inplace.kernels == ("q4k", "q4k") and repacked.kernels[0] == "int4"
    x = torch.from_numpy(rng.standard_normal(D).astype(np.float32))
    xn, out = x.numpy(), np.zeros(D, np.float32)
    res: dict = {"what": __doc__.split("\n\n")[0].replace("\n", " "), "threads": a.threads,
                 "numba_threads": numba.get_num_threads(), "threading_layer": None, "bytes_per_expert": per_expert}  # fmt: skip
    for n in (1, 2, 3, 4):
        w = np.full(n, 1.0 / n, np.float32)
        ids = [(np.arange(n) * 7 + i * 3) % E for i in range(a.reps)]
        inplace.mix_into(ids[0], w, xn, out)
        t = time.perf_counter()
        for i in range(a.reps):
            inplace.mix_into(ids[i], w, xn, out)
        t_in = (time.perf_counter() - t) / a.reps
        repacked.mix_into(ids[0], w, xn, out)
        t = time.perf_counter()
        for i in range(a.reps):
            repacked.mix_into(ids[i], w, xn, out)
        t_re = (time.perf_counter() - t) / a.reps
        res[f"experts_{n}"] = {
            "in_place_us_per_request": 1e6 * t_in, "in_place_GBps": n * per_expert / t_in / 1e9,
            "repacked_us_per_request": 1e6 * t_re, "repacked_GBps": n * per_expert / t_re / 1e9,
            "speedup": t_re / t_in,
        }  # fmt: skip
        print(f"{n} experts: in place {1e6 * t_in:.0f} us, repacked {1e6 * t_re:.0f} us ({t_re / t_in:.2f}x)")
    res["threading_layer"] = numba.threading_layer()

    @numba.njit(parallel=True, fastmath=True)
    def psum(v: np.ndarray) -> float:
        s = 0.0
        for i in numba.prange(v.shape[0]):
            s += v[i]
        return s

    big = np.ones(2 * 2**30 // 4, np.float32)
    psum(big)
    t = time.perf_counter()
    psum(big)
    res["host_ram_read_GBps"] = big.nbytes / (time.perf_counter() - t) / 1e9
    emit(res, a.out)


if __name__ == "__main__":
    main()
