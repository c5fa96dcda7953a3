"""How fast the decode step's miss path moves experts across PCIe: the stage kernel (engine/kernels/stage_copy.py)
at several launch shapes, against the copy engines (cudaMemcpyAsync from pinned memory, what torch's copy_ does),
on Qwen3-30B-A3B's expert size (Q4_K, 3 x 884,736 bytes), 8 missed experts a layer, 48 layers replayed from a graph.

    python bench/stage_copy_micro.py [--out bench/results/stage-copy-micro.json]"""

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.gemv_graph_micro import _graph_us
from engine.kernels.stage_copy import Stager

PROJ_BYTES = 884_736  # one 768x2048 (or 2048x768) Q4_K matrix
HOST_EXPERTS, K, LAYERS = 64, 8, 48
# (8-byte words a program copies, words a load, warps)
# fmt: off
LAUNCHES = [
    (8192, 1024, 4), (4096, 1024, 4), (2048, 1024, 4), (16384, 1024, 4), (8192, 2048, 8), (4096, 2048, 8),
    (2048, 512, 4), (8192, 512, 4), (1024, 1024, 4), (4096, 512, 2),
]
# fmt: on


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    a = ap.parse_args()
    dev = torch.device("cuda")
    host = torch.randint(0, 256, (3, HOST_EXPERTS, PROJ_BYTES), dtype=torch.uint8).pin_memory()
    host_tables = torch.tensor(
        [[host[p, e].data_ptr() for e in range(HOST_EXPERTS)] for p in range(3)],
        dtype=torch.int64,
        device=dev,
    )
    tables = host_tables.clone()  # every expert a miss
    nbytes = torch.full((3,), PROJ_BYTES, dtype=torch.int64, device=dev)
    gen = torch.Generator().manual_seed(0)
    ids = [torch.randperm(HOST_EXPERTS, generator=gen)[:K].view(1, K).to(dev) for _ in range(LAYERS)]
    st = Stager(dev, K, PROJ_BYTES, HOST_EXPERTS)
    moved = 3 * K * PROJ_BYTES
    rows = []
    for launch in LAUNCHES:
        us = _graph_us(
            lambda i, launch=launch: st.stage(ids[i], tables, host_tables, nbytes, launch=launch), LAYERS
        )
        ok = all(  # distinct misses: staged in the order the step chose them
            torch.equal(st.area[p, j, :PROJ_BYTES].cpu(), host[p, int(ids[-1][0, j])])
            for p in range(3)
            for j in (0, K - 1)
        )
        rows.append({"launch": list(launch), "us_per_layer": round(us, 1), "GBps": round(moved / us / 1e3, 1),
                     "copied_right": ok})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    # the copy engines: the same bytes as 24 cudaMemcpyAsync a layer (the host knows the ids here)
    area = torch.empty(3, K, PROJ_BYTES, dtype=torch.uint8, device=dev)
    hids = [i[0].tolist() for i in ids]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(2):  # the first warms the copy path
        start.record()
        for i in range(LAYERS):
            for p in range(3):
                for j, e in enumerate(hids[i]):
                    area[p, j].copy_(host[p, e], non_blocking=True)
        end.record()
        torch.cuda.synchronize()
    us = start.elapsed_time(end) * 1e3 / LAYERS
    rows.append(
        {"launch": "cudaMemcpyAsync", "us_per_layer": round(us, 1), "GBps": round(moved / us / 1e3, 1)}
    )
    print(json.dumps(rows[-1]), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps({"what": __doc__.splitlines()[0], "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
