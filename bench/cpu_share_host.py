"""What the host adds around its experts when it answers a decode step's request (`--cpu-experts`): one mailbox
request of c Qwen3-30B-A3B experts (gate/up 768x2048, down 2048x768, random Q4_K) answered by
`CpuMisses.serve_posts` (one call without the GIL, or request by request from Python with
STRATA_CPU_STEP_SERVE=0), against the same pairs computed and summed outside the mailbox (`CpuExperts.mix_rows`).
Runs on a CPU-only machine (the mailbox is then plain memory): the host side does the same work either way.

A batched step (`--rows T`, e.g. 8 clients): T rows each choosing K of `--layer-experts` experts at random (seeded),
the CPU taking every pair of `--experts` of the distinct experts chosen.

A step of several layers (`--layers L`): L mailboxes, each with the same request, answered by one `serve_posts`
(us_serve is then a request's share).

python bench/cpu_share_host.py [--threads N] [--experts 2] [--rows 1] [--layer-experts 8] [--layers 1] [--out F]"""

import argparse
import os
import sys
import timeit
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as QT

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.report import emit
from engine.experts.cache import ExpertCache
from engine.experts.cpu_misses import CpuMisses
from engine.gguf.random_blocks import random_blocks
from engine.kernels import cpu_handoff as ho
from engine.layers.moe import ExpertWeights
from engine.layers.qtensor import QTensor

F, D, K = 768, 2048, 8


def _layer(E: int) -> ExpertWeights:
    def stack(n: int, k: int, seed: int) -> QTensor:
        raw = torch.stack([torch.from_numpy(random_blocks(QT.Q4_K, n, k, seed=seed + e)) for e in range(E)])
        return QTensor(raw, QT.Q4_K, (E, n, k))

    router = QTensor(torch.randn(E, D).view(torch.uint8).view(E, 4 * D), QT.F32, (E, D))
    return ExpertWeights(router=router, gate=stack(F, D, 1), up=stack(F, D, 50), down=stack(D, F, 99))


def _us(fn: object, n: int) -> float:
    return 1e6 * min(timeit.repeat(fn, number=n, repeat=5)) / n  # type: ignore[arg-type]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--experts", type=int, default=2, help="experts in the request (the CPU's c of 8)")
    ap.add_argument("--rows", type=int, default=1, help="rows of the step (decode rows of that many slots)")
    ap.add_argument("--layer-experts", type=int, default=8, help="experts of the layer (Qwen3-30B-A3B: 128)")
    ap.add_argument("--layers", type=int, default=1, help="layers a step posts (each the same request)")
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    one = _layer(a.layer_experts)
    cache = ExpertCache(
        {i: one for i in range(a.layers)}, torch.device("cpu"), {i: 0 for i in range(a.layers)}
    )
    cm = CpuMisses(cache, 1.0, K, "silu", ratio=1.0)
    row, lay, t = cm._box[0], cm.layout, a.rows
    rng = np.random.default_rng(0)
    chosen = np.stack([rng.choice(a.layer_experts, K, replace=False) for _ in range(t)])  # [T, K]
    distinct = np.unique(chosen)
    if a.experts > distinct.size:
        raise SystemExit(
            f"the {t} rows chose {distinct.size} distinct experts: --experts {a.experts} is more"
        )
    taken = np.isin(chosen, distinct[: a.experts]).reshape(-1)  # every pair of the CPU's experts
    row[ho.IDS : ho.IDS + t * K] = chosen.reshape(-1)
    row[ho.IDS + lay.pairs : ho.IDS + lay.pairs + t * K] = taken
    row[ho.HDR_TAKE] = int(taken.sum())
    row[ho.HDR_ROWS] = t
    cm._boxf[0, ho.IDS + 2 * lay.pairs : ho.IDS + 2 * lay.pairs + t * K] = 0.1
    cm.box[0, lay.x : lay.x + t * D].view(torch.float32).copy_(torch.randn(t * D))
    ce = cm.layers[0]
    ids, tok = chosen.reshape(-1)[taken], np.flatnonzero(taken) // K
    w = np.full(ids.size, 0.1, np.float32)
    x, y = np.random.default_rng(0).standard_normal((t, D)).astype(np.float32), np.zeros((t, D), np.float32)

    cm._box[1:] = row  # every layer's mailbox the same request
    posts = list(range(a.layers))

    def serve() -> (
        None
    ):  # a replayed step's posts, all made: the server's path (STRATA_CPU_STEP_SERVE picks it)
        cm._box[:, ho.HDR_REQ] += 1
        cm.serve_posts(posts)

    def kernels() -> None:  # the request's experts and their weighted sums, outside the mailbox
        ce.mix_rows(ids, tok, w, x, y)

    res = {
        "what": __doc__.split("\n\n")[0],
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "kernels": list(ce.kernels),
        "experts_in_request": a.experts,
        "rows": t,
        "pairs_in_request": int(taken.sum()),
        "layers": a.layers,
        "us_serve": _us(serve, a.reps) / a.layers,
        "us_kernels_alone": _us(kernels, a.reps),
        "step_server": cm._fast is not None,
    }
    res["us_host_beyond_kernels"] = res["us_serve"] - res["us_kernels_alone"]
    emit(res, a.out)


if __name__ == "__main__":
    main()
