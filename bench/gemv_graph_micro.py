"""The decode GEMVs as the model runs them: one launch per layer on that layer's own weights (48 layers, so the
weights come from HBM, not L2), replayed from a CUDA graph (no launch overhead), for each kernel variant and launch
shape. Shapes: Qwen3-30B-A3B's fused q/k/v and output projections, its Q6_K head, its float32 router, and the
routed experts (8 of 128) gate/up with the fused activation and down with the weighted combine.

python bench/gemv_graph_micro.py [--out bench/results/gemv_graph_micro.json] [--tuned engine/kernels/gemv_tuned.json]"""

import argparse
import itertools
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from gguf import GGMLQuantizationType as QT

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from engine.kernels.gemv import APPROXIMATE, KERNEL_TYPES, gemv, moe_down_combine, moe_gemv, quantize_q8

LAYERS, E, TOPK, D, F = 48, 128, 8, 2048, 768
# 12, 13: on 8-bit activations (APPROXIMATE)
VARIANTS = {"Q4_K": (0, 5, 10, 12), "Q6_K": (1, 11, 13), "F32": (6,)}
SHAPES = [  # name, type, rows, cols, kind
    ("qkv", "Q4_K", 5120, 2048, "dense"),
    ("o", "Q4_K", 2048, 4096, "dense"),
    ("router", "F32", 128, 2048, "dense"),
    ("head", "Q6_K", 151936, 2048, "dense"),
    ("gate_up", "Q4_K", F, D, "moe"),
    ("down", "Q4_K", D, F, "moe_down"),
]
LAUNCH = list(
    itertools.product((1, 2, 4, 8), (2, 4, 8), (1, 2, 4))
)  # rows a program, super-blocks a step, warps
LAUNCH_HEAD = list(itertools.product((4, 8, 16, 32), (4, 8), (1, 2, 4, 8)))


def _row_bytes(tname: str, k: int) -> int:
    if tname == "F32":
        return 4 * k
    _, elems, nbytes = KERNEL_TYPES[QT[tname]]
    return k // elems * nbytes


def _graph_us(fn: Callable[[int], object], layers: int) -> float:
    """Mean microseconds of one call, from a graph of `layers` calls replayed 10 times."""
    for i in range(layers):
        fn(i)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(layers):
            fn(i)
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (10 * layers)


def _expert_tables(
    layers: int, n: int, rb: int, up: bool
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor] | None]:
    """Every expert of every layer as the cache holds them (random blocks), and each layer's address tables of its
    own (the gate's, and the up projection's where `up`) -> (the weights to keep alive, tables, up tables)."""
    w = torch.randint(0, 256, (layers, E, n, rb), dtype=torch.uint8, device="cuda")
    u = torch.randint(0, 256, (layers, E, n, rb), dtype=torch.uint8, device="cuda") if up else None
    tables = [torch.tensor([w[i, e].data_ptr() for e in range(E)], device="cuda") for i in range(layers)]
    utables = (
        [torch.tensor([u[i, e].data_ptr() for e in range(E)], device="cuda") for i in range(layers)]
        if u is not None
        else None
    )
    return [w] if u is None else [w, u], tables, utables


def _measure(
    name: str, tname: str, n: int, k: int, kind: str, variants: set[int] | None = None, quick: bool = False
) -> list[dict]:
    """Every variant and launch shape of one matrix shape."""
    rows: list[dict] = []
    qt = QT[tname]
    rb = _row_bytes(tname, k)
    layers = 2 if name == "head" else LAYERS
    if kind == "dense":
        w = torch.randint(0, 256, (layers, n, rb), dtype=torch.uint8, device="cuda")
        x = torch.randn(1, k, device="cuda", dtype=torch.float32 if tname == "F32" else torch.bfloat16)
        nbytes = n * rb

        xq = (
            quantize_q8(x) if k % 256 == 0 else x
        )  # the 8-bit bodies' activations, made once (as a step would)

        def call(i: int, lc: tuple[int, int, int], v: int) -> object:
            q8 = v in APPROXIMATE
            return gemv(
                w[i], qt, n, k, xq if q8 else x, block_n=lc[0], sb=lc[1], num_warps=lc[2], variant=v, q8=q8
            )
    else:
        # Every expert of every layer, as the cache holds them; the table of each layer points at its own.
        up = kind == "moe"
        _keep, tables, utables = _expert_tables(
            layers, n, rb, up
        )  # the tables hold addresses: keep the weights
        ids = [torch.randperm(E, device="cuda")[:TOPK].view(1, TOPK) for _ in range(layers)]
        wts = torch.rand(1, TOPK, device="cuda")
        x = torch.randn(1 if up else TOPK, k, device="cuda", dtype=torch.bfloat16)
        res = torch.randn(1, n, device="cuda")
        nbytes = TOPK * n * rb * (2 if up else 1)

        xq = quantize_q8(x)

        def call(i: int, lc: tuple[int, int, int], v: int) -> object:
            q8 = v in APPROXIMATE
            xi = xq if q8 else x
            if utables is not None:
                return moe_gemv(tables[i], qt, rb, ids[i], xi, n, k, TOPK, up_table=utables[i], act="silu",
                                launch=lc, variant=v, q8=q8)  # fmt: skip
            return moe_down_combine(
                tables[i], qt, rb, ids[i], wts, xi, res, n, k, launch=lc, variant=v, q8=q8
            )

    launches = LAUNCH_HEAD if name == "head" else LAUNCH
    if quick:
        launches = [lc for lc in launches if lc[1] > 2 and (lc[0] > 1 or kind != "dense")]
    for v in VARIANTS[tname]:
        if variants is not None and v not in variants:
            continue
        for lc in launches:
            row = {"shape": name, "type": tname, "kind": kind, "variant": v, "launch": list(lc)}
            try:
                us = _graph_us(lambda i, lc=lc, v=v: call(i, lc, v), layers)
            except Exception as e:  # a launch shape that does not compile is reported, not fatal
                rows.append({**row, "error": str(e)[:100]})
                continue
            rows.append({**row, "us": round(us, 2), "GBps": round(nbytes / (us * 1e-6) / 1e9, 1)})
    if kind == "dense" and tname == "F32":  # the torch matmul it replaces
        wf = w.view(torch.float32)  # [layers, n, k]
        us = _graph_us(lambda i: x @ wf[i].T, layers)
        rows.append({"shape": name, "type": "F32", "kind": "torch", "us": round(us, 2)})
    return rows


# int8 tensor-core launches of dense rows (engine/kernels/rows_mma.py): (columns a program, split along K, warps)
LAUNCH_MMA = [(bn, sp, w) for bn in (16, 32, 64) for sp in (1, 2, 4) for w in (2, 4)]
# batched launches (--tokens): (rows a program, super-blocks a step, warps, G)
LAUNCH_ROWS = [(bn, sb, w, g) for bn in (1, 2, 4) for g in (1, 2, 4, 8) if 4 <= bn * g <= 16 for sb in (2, 4)
               for w in (1, 2, 4)]  # fmt: skip


def _measure_rows(
    name: str,
    tname: str,
    n: int,
    k: int,
    kind: str,
    tokens: int,
    quick: bool,
    warm: tuple[int, int] | None = None,
) -> list[dict]:
    """A step of `tokens` rows (distinct random routing per layer) through the batched launches at every launch
    shape, and through each row's own launches (the tuned per-row shape: "launch": "per-row"). `warm` (i, n):
    only compile the i-th of every n shapes (run once, not timed), so that n processes fill Triton's cache at
    once before the timed run."""
    import engine.kernels.gemv as gm

    qt, rb = QT[tname], _row_bytes(tname, k)
    variant = gm._config(qt, n, k, kind)[3]
    if variant not in APPROXIMATE:
        return []
    layers = 2 if name == "head" else LAYERS
    if kind == "dense":
        w = torch.randint(0, 256, (layers, n, rb), dtype=torch.uint8, device="cuda")
        xq = quantize_q8(torch.randn(tokens, k, device="cuda"))
        nbytes = n * rb

        def call(i: int) -> object:
            return gemv(w[i], qt, n, k, xq, q8=True)
    else:
        up = kind == "moe"
        _keep, tables, utables = _expert_tables(
            layers, n, rb, up
        )  # the tables hold addresses: keep the weights
        ids = [
            torch.stack([torch.randperm(E, device="cuda")[:TOPK] for _ in range(tokens)])
            for _ in range(layers)
        ]
        distinct = sum(len(set(t.flatten().tolist())) for t in ids) / layers
        wts = torch.rand(tokens, TOPK, device="cuda")
        xq = quantize_q8(torch.randn(tokens if up else tokens * TOPK, k, device="cuda"))
        res = torch.randn(tokens, n, device="cuda")
        nbytes = int(distinct * n * rb * (2 if up else 1))

        def call(i: int) -> object:
            if utables is not None:
                return moe_gemv(
                    tables[i], qt, rb, ids[i], xq, n, k, TOPK, up_table=utables[i], act="silu", q8=True
                )
            return moe_down_combine(tables[i], qt, rb, ids[i], wts, xq, res, n, k, q8=True)

    rows: list[dict] = []
    real, real_mma = gm.rows_config, gm.mma_config
    launches: list = [None] + (LAUNCH_ROWS[::3] if quick else LAUNCH_ROWS)
    if kind == "dense" and gm.mma_takes(qt, k, tokens):  # int8 tensor cores: ("mma", columns, split, warps)
        launches += [("mma", *lc) for lc in (LAUNCH_MMA[::2] if quick else LAUNCH_MMA)]
    try:
        for j, lc in enumerate(launches):
            mma = lc is not None and lc[0] == "mma"
            if lc is not None and not mma and kind != "dense" and lc[3] > tokens:
                continue
            if warm is not None and j % warm[1] != warm[0]:
                continue
            gm.rows_config = (
                (lambda *a: None)
                if lc is None
                else (lambda *a: (2, 2, 1, variant, 2))  # any: the MMA launch replaces it
                if mma
                else (lambda *a, lc=lc: (lc[0], lc[1], lc[2], variant, lc[3]))
            )
            gm.mma_config = (lambda *a, lc=lc: lc[1:]) if mma else (lambda *a: None)
            row = {"shape": name, "type": tname, "kind": kind, "tokens": tokens, "variant": variant,
                   "launch": "per-row" if lc is None else list(lc)}  # fmt: skip
            try:
                if warm is not None:
                    call(0)
                    torch.cuda.synchronize()
                    continue
                us = _graph_us(call, layers)
            except Exception as e:  # a launch shape that does not compile is reported, not fatal
                rows.append({**row, "error": str(e)[:100]})
                continue
            rows.append({**row, "us": round(us, 2), "GBps": round(nbytes / (us * 1e-6) / 1e9, 1)})
    finally:
        gm.rows_config, gm.mma_config = real, real_mma
    done = [r for r in rows if "us" in r]
    per_row = next((r["us"] for r in done if r["launch"] == "per-row"), None)
    best = min((r for r in done if r["launch"] != "per-row"), key=lambda r: r["us"], default=None)
    if best is not None:
        print(
            f"{name:8s} {tokens:2d} rows: per-row {per_row} us, batched {best['us']} us {best['launch']}",
            flush=True,
        )
    return rows


def _norm_route_rows() -> list[dict]:
    """The FFN norm + router + top-k of a decode step: three launches (rms_norm_q8, the router's GEMV, route)
    against fused.norm_route at each launch shape, with the top-k in its launch and in a route launch after it,
    each over 48 layers' own router weights in a graph."""
    from engine.kernels.fused import norm_route, rms_norm_q8, route

    h = [torch.randn(1, D, device="cuda") for _ in range(LAYERS)]
    nw = torch.rand(D, device="cuda") + 0.5
    wr = torch.randn(LAYERS, E, D, device="cuda") * 0.05
    raw = wr.view(torch.uint8)  # [layers, E, 4D]: the router as the GEMV reads F32 blocks
    counts = torch.zeros(E, dtype=torch.int64, device="cuda")
    done = torch.zeros(8, dtype=torch.int32, device="cuda")

    def three(i: int) -> object:
        _, x32, _ = rms_norm_q8(h[i], nw, 1e-6, torch.bfloat16, f32_copy=True)
        return route(gemv(raw[i], QT.F32, E, D, x32), TOPK, True, counts)

    rows = []
    us = _graph_us(three, LAYERS)
    rows.append({"shape": "norm+router+route", "kind": "route", "us": round(us, 2)})
    print(f"norm+router+route {us:8.2f} us")
    for lc in itertools.product((1, 2, 4), (1, 2, 4)):  # router rows a program, warps
        for select in (True, False):  # the top-k in the launch, or in a route launch after it

            def one(i: int, lc: tuple[int, int] = lc, select: bool = select) -> object:
                return norm_route(
                    h[i], nw, 1e-6, wr[i], TOPK, True, counts, done, None, False, True, lc, select
                )

            us = _graph_us(one, LAYERS)
            name = "norm_route" if select else "norm_router+route"
            rows.append({"shape": name, "kind": "route", "launch": list(lc), "us": round(us, 2)})
            print(f"{name:18s} {lc} {us:8.2f} us")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument(
        "--tuned", help="write the best launch per type and class into this tuning file (others kept)"
    )
    ap.add_argument("--shapes", help="comma-separated subset of: " + ", ".join(s[0] for s in SHAPES))
    ap.add_argument(
        "--variants", help="comma-separated kernel variants to measure (default: all of the type's)"
    )
    ap.add_argument("--quick", action="store_true", help="fewer launch shapes (12-16 a variant)")
    ap.add_argument("--warm", help="i/n: with --tokens, only compile every n-th launch shape from the i-th")
    ap.add_argument(
        "--tokens", help="comma-separated token rows a step: the batched launches (e.g. 2,4,8,16)"
    )
    a = ap.parse_args()
    rows: list[dict] = []
    if a.tokens:
        _rows_main(a)
        return
    for shape in SHAPES:
        if a.shapes and shape[0] not in a.shapes.split(","):
            continue
        chosen = {int(v) for v in a.variants.split(",")} if a.variants else None
        rows += _measure(*shape, variants=chosen, quick=a.quick)
        torch.cuda.empty_cache()
    if a.variants is None or APPROXIMATE & {int(v) for v in a.variants.split(",")}:
        # what the 8-bit bodies add where no norm kernel writes their activations: one rounding launch (the
        # output projection's input, and each slot's input of the down projection)
        for name, t, k in (("q8 o-input", 1, 2 * D), ("q8 down-input", TOPK, F)):
            xs = [torch.randn(t, k, device="cuda", dtype=torch.bfloat16) for _ in range(LAYERS)]
            us = _graph_us(lambda i, xs=xs: quantize_q8(xs[i]), LAYERS)
            rows.append({"shape": name, "kind": "q8", "us": round(us, 2)})
            print(f"{name:14s} {us:8.2f} us")
    if a.shapes is None or "norm_route" in a.shapes.split(","):
        rows += _norm_route_rows()
    best: dict[str, dict] = {}
    for r in rows:
        if "us" in r and r["kind"] not in ("torch", "q8", "route"):
            key = f"{r['shape']} v{r['variant']}"
            if key not in best or r["us"] < best[key]["us"]:
                best[key] = r
    for key, r in best.items():
        print(f"{key:14s} launch {r['launch']} {r['us']:8.2f} us {r['GBps']:7.0f} GB/s")
    for r in rows:
        if r["kind"] == "torch":
            print(f"router torch matmul {r['us']:.2f} us")
    if a.out:
        Path(a.out).write_text(json.dumps({"best": best, "all": rows}, indent=1))
    if a.tuned:  # per type and class the fastest (variant, launch) of the shapes measured
        tuned: dict[str, dict] = {}
        cls_of = {
            "qkv": "small",
            "o": "small",
            "router": "small",
            "head": "large",
            "gate_up": "moe",
            "down": "moe_down",
        }
        for r in best.values():
            # the 8-bit bodies' picks go under "<class>:q8" (used with --activations int8), the float ones under
            # the class itself (--activations float, and the types without an 8-bit body)
            cls = cls_of[r["shape"]] + (":q8" if r["variant"] in APPROXIMATE else "")
            cur = tuned.setdefault(r["type"], {}).get(cls)
            if cur is None or r["us"] < cur[1]:
                tuned[r["type"]][cls] = (r["launch"] + [r["variant"]], r["us"])
        out = {t: {c: v[0] for c, v in d.items()} for t, d in tuned.items()}
        fused = [r for r in rows if r["shape"] in ("norm_route", "norm_router+route")]
        # the FFN norm + router launch: [router rows a program, warps, top-k in the launch (1) or not]
        if fused:
            r = min(fused, key=lambda r: r["us"])
            out.setdefault("F32", {})["norm_route"] = r["launch"] + [int(r["shape"] == "norm_route")]
        # into the file's own entries: the classes and types not measured here (Q8_0, "moe_gemm") stay as they were
        path = Path(a.tuned)
        merged = json.loads(path.read_text()) if path.exists() else {}
        for t, classes in out.items():
            merged.setdefault(t, {}).update(classes)
        path.write_text(json.dumps(merged, indent=1) + "\n")
        print(json.dumps(out))


def _rows_main(a: argparse.Namespace) -> None:
    """--tokens: the batched launches' sweep; with --tuned, the best shape per type, class and row bucket goes
    into the tuning file as "<class>:q8:r<bucket>" = [rows a program, super-blocks a step, warps, variant, G]."""
    from engine.kernels.gemv import row_bucket

    cls_of = {"qkv": "small", "o": "small", "head": "large", "gate_up": "moe", "down": "moe_down"}
    rows: list[dict] = []
    for tokens in (int(t) for t in a.tokens.split(",")):
        for shape in SHAPES:
            if shape[0] not in cls_of or (a.shapes and shape[0] not in a.shapes.split(",")):
                continue
            warm = tuple(int(v) for v in a.warm.split("/")) if a.warm else None
            rows += _measure_rows(*shape, tokens=tokens, quick=a.quick, warm=warm)  # type: ignore[arg-type]
            torch.cuda.empty_cache()
    if a.warm:
        return
    if a.out:
        Path(a.out).write_text(json.dumps({"all": rows}, indent=1))
    if a.tuned:
        # per (type, class, bucket): the shape whose summed time over the class's shapes is least; an int8
        # tensor-core ("mma") entry only where its best beats the GEMV bodies' best
        total: dict[tuple, float] = {}
        for r in rows:
            if "us" in r and r["launch"] != "per-row":
                cls = f"{cls_of[r['shape']]}:q8:r{row_bucket(r['tokens'])}"
                key = (r["type"], cls, tuple(r["launch"]), r["variant"])
                total[key] = total.get(key, 0.0) + r["us"]
        best: dict[tuple, tuple] = {}
        best_mma: dict[tuple, tuple] = {}
        for (t, cls, lc, v), us in total.items():
            into = best_mma if lc[0] == "mma" else best
            if (t, cls) not in into or us < into[(t, cls)][0]:
                into[(t, cls)] = (us, list(lc[1:]) if lc[0] == "mma" else [lc[0], lc[1], lc[2], v, lc[3]])
        path = Path(a.tuned)
        merged = json.loads(path.read_text()) if path.exists() else {}
        for (t, cls), (us, entry) in best.items():
            merged.setdefault(t, {})[cls] = entry
            mma_key = cls.replace(":q8:", ":q8:mma:")
            got = best_mma.get((t, cls))
            if got is not None and got[0] < us:
                merged[t][mma_key] = got[1]
            else:
                merged[t].pop(mma_key, None)
        path.write_text(json.dumps(merged, indent=1) + "\n")
        print(json.dumps({f"{t} {c}": e for (t, c), (_, e) in best.items()}))
        print(
            json.dumps(
                {
                    f"{t} {c} mma": [e, round(u, 1), round(best[(t, c)][0], 1)]
                    for (t, c), (u, e) in best_mma.items()
                }
            )
        )


if __name__ == "__main__":
    main()
