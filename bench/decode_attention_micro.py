"""Decode attention deep in the cache, the kernel alone: microseconds a layer and the bytes it reads per second.

    python bench/decode_attention_micro.py [--depth 32768] [--layers 48] [--kv-types bf16,int8,q4_0]
        [--per-sm 1,2,4] [--block-s 64,128] [--warps 4,8] [--stages 2,3] [--merge-block 0,32]
        [--qk8 0,1] [--rows 1] [--slots] [--profile] [--out F.json]

Each layer has a cache of its own (Qwen3-30B-A3B's heads by default: 32 query heads, 4 key heads of 128), filled
with random values, so the step reads `--layers` caches from memory as a decode step does, not one from L2. For each
KV type and each launch shape (engine.kernels.attention.DecodeTune) the layers' calls are captured in one CUDA graph
and replayed: the time is the device's, launches included, the merge of the splits included. Each shape's output
is compared with the default shape's (`max_err`). `--slots`: the rows are as many slots, each its own sequence at
that depth in one shared cache (the server's steps), instead of one sequence's rows. `--profile`: each kernel's own
time (torch's profiler over eager calls) for the default shape and each type's best, to tell the split kernel from
the merge and the gaps between them."""

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.report import emit
from engine.kernels.attention import DEFAULT_TUNE, DecodeTune, decode_attention
from engine.layers.kv_cache import quantize_kv


def caches(kind: str, layers: int, ctx: int, hkv: int, d: int, dev: str) -> list[tuple]:
    """(k, v, k_scale, v_scale) of each layer, in the engine's layouts."""
    out = []
    for _ in range(layers):
        k = torch.randn(ctx, hkv, d, device=dev, dtype=torch.bfloat16)
        v = torch.randn(ctx, hkv, d, device=dev, dtype=torch.bfloat16)
        (kq, ks), (vq, vs) = quantize_kv(kind, k), quantize_kv(kind, v)
        out.append((kq, vq, ks, vs))
        del k, v
    return out


def bytes_read(layer: tuple, span: int) -> int:
    return sum(t[:span].numel() * t.element_size() for t in layer if t is not None)


def time_shape(
    q, pos, base, layers, span: int, scale: float, tune: DecodeTune, reps: int
) -> tuple[float, torch.Tensor]:
    """-> (microseconds a layer, the first layer's output)."""

    def body() -> torch.Tensor:
        first = None
        for k, v, ks, vs in layers:
            o = decode_attention(q, k, v, pos, span, 0, scale, k_scale=ks, v_scale=vs, tune=tune, base=base)
            first = o if first is None else first
        return first

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):  # compile and warm outside the capture
            body()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = body()
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        g.replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1e3 / reps / len(layers), out.clone()


def _dev_us(e) -> float:
    return getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)


def kernel_times(q, pos, base, layers, span: int, scale: float, tune: DecodeTune) -> dict[str, float]:
    """Each kernel's device time a layer (microseconds), from torch's profiler over 5 eager passes."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            for k, v, ks, vs in layers:
                decode_attention(q, k, v, pos, span, 0, scale, k_scale=ks, v_scale=vs, tune=tune, base=base)
        torch.cuda.synchronize()
    n = 5 * len(layers)
    return {
        e.key[:40]: round(e.device_time_total / n, 2) for e in prof.key_averages() if e.device_time_total > 0
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--depth", type=int, default=32768)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--rows", type=int, default=1, help="query rows (one sequence's verify window or slots)")
    ap.add_argument("--kv-types", default="bf16,int8,q4_0")
    ap.add_argument("--per-sm", default="1,2,4")
    ap.add_argument("--block-s", default="64,128", help="0: the kernel's default for the KV type")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--stages", default="2,3", help="0: Triton's default")
    ap.add_argument("--merge-block", default="0,32", help="0: a merging program per head")
    ap.add_argument("--qk8", default="0", help="DecodeTune.qk8: 0, 1 or 0,1 (int8 caches)")
    ap.add_argument("--slots", action="store_true", help="each row its own sequence (the server's slots)")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--out")
    a = ap.parse_args()
    dev = "cuda"
    span = -(-(a.depth + 1) // 256) * 256  # the decode graphs' span bucket
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    q = torch.randn(a.rows, a.heads, a.head_dim, device=dev, dtype=torch.bfloat16)
    pos = torch.full((a.rows,), a.depth, device=dev, dtype=torch.int64)
    base = torch.arange(a.rows, device=dev, dtype=torch.int64) * span if a.slots else None
    ctx = span * (a.rows if a.slots else 1)
    scale = a.head_dim**-0.5
    results = []
    for kind in a.kv_types.split(","):
        layers = caches(kind, a.layers, ctx, a.kv_heads, a.head_dim, dev)
        nbytes = bytes_read(layers[0], a.depth + 1) * (a.rows if a.slots else 1)
        base_us, ref = time_shape(q, pos, base, layers, span, scale, DEFAULT_TUNE, a.reps)
        row = {
            "kv": kind,
            "tune": "default",
            "us_layer": round(base_us, 2),
            "GBps": round(nbytes / base_us / 1e3, 1),
        }
        results.append(row)
        print(row, flush=True)
        shapes = itertools.product(
            ints(a.per_sm),
            ints(a.block_s),
            ints(a.warps),
            ints(a.stages),
            ints(a.merge_block),
            ints(a.qk8),
        )
        best_tune, best_us = DEFAULT_TUNE, base_us
        for per_sm, bs, w, st, mb, qk8 in shapes:
            tune = DecodeTune(
                per_sm=per_sm,
                block_s=bs or None,
                warps=w,
                stages=st or None,
                merge_block=mb or None,
                qk8=bool(qk8),
            )
            try:
                us, out = time_shape(q, pos, base, layers, span, scale, tune, a.reps)
            except Exception as e:  # a shape the compiler or shared memory refuses
                results.append({"kv": kind, "tune": tune.__dict__, "error": str(e)[:200]})
                continue
            err = (out.float() - ref.float()).abs().max().item()
            row = {"kv": kind, "tune": tune.__dict__, "us_layer": round(us, 2), "GBps": round(nbytes / us / 1e3, 1),
                   "vs_default": round(base_us / us, 3), "max_err": err}  # fmt: skip
            results.append(row)
            print(row, flush=True)
            if us < best_us:
                best_tune, best_us = tune, us
        if a.profile:
            for name, tune in (("default", DEFAULT_TUNE), ("best", best_tune)):
                row = {"kv": kind, "profile": name, "tune": tune.__dict__,
                       "kernels_us": kernel_times(q, pos, base, layers, span, scale, tune)}  # fmt: skip
                results.append(row)
                print(row, flush=True)
        del layers
        torch.cuda.empty_cache()
    best = {}
    for r in results:
        if "us_layer" in r and (r["kv"] not in best or r["us_layer"] < best[r["kv"]]["us_layer"]):
            best[r["kv"]] = r
    emit({"depth": a.depth, "span": span, "layers": a.layers, "rows": a.rows, "slots": a.slots, "device": torch.cuda.get_device_name(),
          "results": results, "best": best}, a.out)  # fmt: skip


if __name__ == "__main__":
    main()
