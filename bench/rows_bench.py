"""Decode steps of several slots at once, in the engine (no HTTP): tokens/s and each step's kernels per row count.

    python bench/rows_bench.py --model M.gguf [--rows 1,2,4,8] [--steps 64] [--profile] [--out rows.json]
                               [--layer-split K]

The model loads as the server loads it (all experts in VRAM where they fit, the decode graphs), the slots' caches
are rows of one shared cache (DecoderLM.new_caches), and each step decodes one row of each of T slots
(DecoderLM.decode_rows) with the next tokens read back to the host, as the server's scheduler does. The figures
say what a step of T rows costs against one row, and (--profile) which kernels take the time. `--layer-split K` runs
the model as two stages on the one card (`--split-device 0`, as the server does: each stage's fused path from its
own slot graphs, the hand-off between them), through the split's forward_batch, with each stage's host time per
step, to set beside the one-stage figure of another run."""

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.engine_bench import _kernel_table
from bench.report import emit
from engine.experts.policy import ExpertPolicy
from engine.link.startup import load_split_model
from engine.models.family_base import BatchPart
from engine.pipeline.loader import load_model
from engine.pipeline.split import SplitOptions


def steps(model, caches, n: int, start: int) -> float:
    """n decode steps of len(caches) slots from position `start` -> seconds."""
    tok = torch.randint(100, 10000, (len(caches),))
    run = (
        getattr(model, "decode_rows", None) or model.forward_batch
    )  # a split: its fused rows through each stage
    torch.cuda.synchronize()
    t = time.perf_counter()
    for p in range(start, start + n):
        logits = run([BatchPart(tok[j : j + 1], c, p) for j, c in enumerate(caches)])
        tok = logits.argmax(-1).cpu()  # the next tokens depend on these: a real step
    torch.cuda.synchronize()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--max-context", type=int, default=1024)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--layer-split", type=int, help="two stages on the one card, the second from layer K")
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.layer_split:
        opts = SplitOptions(device="cuda", layer_split=(a.layer_split,), split_device=("0",))
        lm = load_split_model(a.model, opts, max_context=a.max_context, kv="bf16", dtype="bf16", parallel=16)
    else:
        lm = load_model(a.model, device="cuda", dtype="bf16", experts=ExpertPolicy(), cuda_graphs=True)
    model = lm.model
    rows = [int(x) for x in a.rows.split(",")]
    caches = model.new_caches(max(rows), a.max_context, "bf16")
    if caches[0].shared is None:
        raise SystemExit("this model's decode rows do not share one cache (no fused decode path here)")
    res: dict = {"model": Path(a.model).name, "steps": a.steps, "layer_split": a.layer_split, "rounds": []}
    for t in rows:
        cs = caches[:t]
        steps(model, cs, 4, 0)  # captures this row count's graph
        secs = steps(model, cs, a.steps, 4)
        r = {
            "rows": t,
            "step_ms": round(1000 * secs / a.steps, 3),
            "tok_s": round(t * a.steps / secs, 1),
        }
        timing = getattr(model, "timing", None)
        if timing is not None:  # a split: each stage's host time in the last step (launch and hand-off)
            r["stage_host_ms"] = [round(x, 3) for x in timing.ms]
        if a.profile:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                steps(model, cs, 4, 4 + a.steps)
            r["kernels_per_step"] = _kernel_table(prof, 4)
        res["rounds"].append(r)
        print(f"{t} rows: {r['step_ms']} ms a step, {r['tok_s']} tok/s", flush=True)
        for c in cs:
            c.length = 0
    one = res["rounds"][0]["step_ms"]
    res["step_time_over_one_row"] = {r["rows"]: round(r["step_ms"] / one, 2) for r in res["rounds"]}
    emit(res, a.out)


if __name__ == "__main__":
    main()
