"""What torch's CPU kernels give for one routed expert's matrix-vector products (Qwen3-30B-A3B: gate/up 768x2048,
down 2048x768, one token): the weight-only 4-bit and 8-bit kernels a CPU miss path could compute with, against a
float32 and a bf16 matmul. The expert cache's misses could be computed on the CPU beside the PCIe copies where
such a kernel reads an expert faster than a copy moves it.

Also: Q4_K blocks repacked for the 4-bit kernel (codes, and a scale and an offset per 32, from
engine.gguf.quants.q4_k_parts), and how far its product lies from x @ dequantize(W).T (gguf's decoder, in
float32), with float32 and with bf16 activations and scales.

python bench/cpu_expert_kernels.py [--threads N] [--out bench/results/cpu-expert-kernels.json]"""

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch

from engine.experts.cpu_experts import q4k_int4pack

SHAPES = {"gate_up": (768, 2048), "down": (2048, 768)}  # (rows, cols)
GROUP = 32  # Q4_K's sub-block: one scale and one offset per 32 weights


def _us(fn: Callable[[], object], reps: int) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps * 1e6


def _kernels(n: int, k: int) -> dict[str, tuple[Callable[[], object], int]]:
    """name -> (call, bytes of weights it reads)"""
    x = torch.randn(1, k, dtype=torch.bfloat16)
    q4 = torch.randint(0, 16, (n, k), dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q4, 1)
    sz = torch.randn(k // GROUP, n, 2, dtype=torch.bfloat16)
    w8, s8 = torch.randint(-127, 127, (n, k), dtype=torch.int8), torch.rand(n, dtype=torch.bfloat16)
    wb, wf, xf = torch.randn(n, k, dtype=torch.bfloat16), torch.randn(n, k), x.float()
    return {
        "int4 weight-only (_weight_int4pack_mm_for_cpu, group 32)": (
            lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP, sz),
            n * k // 2 + sz.numel() * 2,
        ),
        "int8 weight-only (_weight_int8pack_mm)": (
            lambda: torch.ops.aten._weight_int8pack_mm(x, w8, s8),
            n * k + n * 2,
        ),
        "bf16 matmul": (lambda: x @ wb.T, n * k * 2),
        "float32 matmul": (lambda: xf @ wf.T, n * k * 4),
    }


def _q4k_rows(reps: int) -> list[dict]:
    from gguf import GGMLQuantizationType as QT

    from engine.gguf.quants import dequantize
    from engine.gguf.random_blocks import random_blocks

    rows = []
    for shape, (n, k) in SHAPES.items():
        raw = torch.from_numpy(random_blocks(QT.Q4_K, n, k, seed=1))
        ref_w = dequantize(raw, QT.Q4_K).reshape(n, k)
        x = torch.randn(1, k)
        ref = x.double() @ ref_w.double().T
        for dtype in (torch.float32, torch.bfloat16):
            packed, sz = q4k_int4pack(raw, n, k, dtype)
            xd = x.to(dtype)
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(xd, packed, GROUP, sz)
            err = ((y.double() - ref).abs().max() / ref.abs().max()).item()
            us = _us(lambda xd=xd, packed=packed, sz=sz: torch.ops.aten._weight_int4pack_mm_for_cpu(
                xd, packed, GROUP, sz), reps)  # fmt: skip
            name = f"Q4_K as int4 groups of 32, {str(dtype).removeprefix('torch.')}"
            rows.append({"shape": shape, "kernel": name, "us": round(us, 1), "GBps": round(raw.numel() / us / 1e3, 2),
                         "max_rel_error_vs_dequantize": err})  # fmt: skip
            print(
                f"{shape:8s} {name:58s} {us:9.1f} us {raw.numel() / us / 1e3:7.2f} GB/s (Q4_K bytes)  err {err:.1e}"
            )
    return rows


def _mix_row(reps: int) -> dict:
    """CpuExperts.mix for one token and k = 8 distinct held experts of the Qwen3-30B-A3B shapes (Q4_K)."""
    from gguf import GGMLQuantizationType as QT

    from engine.experts.cpu_experts import CpuExperts
    from engine.gguf.random_blocks import random_blocks
    from engine.layers.qtensor import QTensor

    k = 8
    (f, d) = SHAPES["gate_up"]

    def experts(rows: int, cols: int, seed: int) -> QTensor:
        raw = torch.stack(
            [torch.from_numpy(random_blocks(QT.Q4_K, rows, cols, seed=seed * k + e)) for e in range(k)]
        )
        return QTensor(raw, QT.Q4_K, (k, rows, cols))

    gate, up, down = experts(f, d, 1), experts(f, d, 2), experts(d, f, 3)
    ce = CpuExperts(gate, up, down, range(k))
    x, ids = torch.randn(1, d), torch.arange(k).view(1, k)
    w, take = torch.softmax(torch.randn(1, k), dim=-1), torch.ones(1, k, dtype=torch.bool)
    us = _us(lambda: ce.mix(x, ids, w, take), reps)
    nbytes = gate.nbytes + up.nbytes + down.nbytes  # the Q4_K blocks of the 8 experts
    row = {"what": f"CpuExperts.mix, 1 token, k={k} Q4_K experts (D={d}, F={f})", "kernels": list(ce.kernels),
           "us": round(us, 1), "us_per_expert": round(us / k, 1), "GBps_q4k": round(nbytes / us / 1e3, 2),
           "q4k_bytes": nbytes, "repacked_bytes": ce.nbytes}  # fmt: skip
    print(f"{row['what']}: {us:.1f} us, {us / k:.1f} us an expert, {nbytes / us / 1e3:.2f} GB/s (Q4_K bytes)")
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--out")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    rows = []
    for shape, (n, k) in SHAPES.items():
        for name, (fn, nbytes) in _kernels(n, k).items():
            us = _us(fn, a.reps)
            rows.append(
                {"shape": shape, "kernel": name, "us": round(us, 1), "GBps": round(nbytes / us / 1e3, 2)}
            )
            print(f"{shape:8s} {name:58s} {us:9.1f} us {nbytes / us / 1e3:7.2f} GB/s")
    rows += _q4k_rows(a.reps)
    res = {
        "torch": torch.__version__,
        "threads": a.threads,
        "rows": rows,
        "cpu_experts_mix": _mix_row(a.reps),
    }
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
