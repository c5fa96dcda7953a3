"""Decode steps of several slots at once, in the engine (no HTTP): tokens/s and each step's kernels per row count.

    python bench/rows_bench.py --model M.gguf [--rows 1,2,4,8] [--steps 64] [--profile] [--out rows.json]
                               [--layer-split K]
                               [--vram-process-mib MIB [--vram-reserve-mib 0] [--threads T] [--profile-from-trace]
                                [--cpu-experts F] [--cpu-ratio R]]

The model loads as the server loads it (all experts in VRAM where they fit, the decode graphs), the slots' caches
are rows of one shared cache (DecoderLM.new_caches), and each step decodes one row of each of T slots
(DecoderLM.decode_rows) with the next tokens read back to the host, as the server's scheduler does. The figures
say what a step of T rows costs against one row, and (--profile) which kernels take the time. `--layer-split K` runs
the model as two stages on the one card (`--split-device 0`, as the server does: each stage's fused path from its
own slot graphs, the hand-off between them), through the split's forward_batch, with each stage's host time per
step, to set beside the one-stage figure of another run. `--vram-process-mib` holds the process to another program's
VRAM (llama-server `-ncmoe 36`'s), as bench/engine_bench.py does: the experts that do not fit stay in host RAM, the
steps stage their misses and give the CPU its share (STRATA_ROUTE_TRACE replays a trace; `realistic-x8` is 8
conversations), so that --profile says where a step of 8 rows goes at that budget."""

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.engine_bench import _kernel_table, _kv_bytes, _trace_profile, cuda_context_mib
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


def _policy(a: argparse.Namespace, rows: int) -> ExpertPolicy:
    """The expert cache as the server sizes it for `rows` slots; within --vram-process-mib where given."""
    if not a.vram_process_mib:
        return ExpertPolicy()
    return ExpertPolicy(
        vram_budget_mib=a.vram_process_mib - cuda_context_mib(),
        reserve_mib=a.vram_reserve_mib,
        kv_bytes=rows * _kv_bytes(a.model, a.max_context),
        profile=_trace_profile(a.model) if a.profile_from_trace else None,
        cpu_share=a.cpu_experts,
        cpu_ratio=a.cpu_ratio,
        rows=rows,
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--max-context", type=int, default=1024)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--layer-split", type=int, help="two stages on the one card, the second from layer K")
    ap.add_argument("--out")
    ap.add_argument(
        "--vram-process-mib",
        type=int,
        help="VRAM for the whole process as nvidia-smi counts it (another program's figure), less our CUDA context",
    )
    ap.add_argument("--vram-reserve-mib", type=int, default=512, help="the engine's --vram-reserve-mib")
    ap.add_argument("--threads", type=int, help="torch's CPU threads (the CPU's share of the misses)")
    ap.add_argument(
        "--profile-from-trace",
        action="store_true",
        help="with STRATA_ROUTE_TRACE: fill the cache from the counts of the trace's second half",
    )
    ap.add_argument("--cpu-experts", type=float, help="the engine's --cpu-experts F (default: auto)")
    ap.add_argument(
        "--cpu-ratio", type=float, help="the CPU's share of a step's misses, fixed (default: tuned)"
    )
    a = ap.parse_args()
    rows = [int(x) for x in a.rows.split(",")]
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.layer_split:
        opts = SplitOptions(device="cuda", layer_split=(a.layer_split,), split_device=("0",))
        lm = load_split_model(a.model, opts, max_context=a.max_context, kv="bf16", dtype="bf16", parallel=16)
    else:
        lm = load_model(a.model, device="cuda", dtype="bf16", experts=_policy(a, max(rows)), cuda_graphs=True)
    model = lm.model
    caches = model.new_caches(max(rows), a.max_context, "bf16")
    if caches[0].shared is None:
        raise SystemExit("this model's decode rows do not share one cache (no fused decode path here)")
    res: dict = {"model": Path(a.model).name, "steps": a.steps, "layer_split": a.layer_split, "rounds": []}
    ec = getattr(model, "expert_cache", None)
    if a.vram_process_mib:
        res.update(
            vram_process_mib=a.vram_process_mib,
            vram_reserve_mib=a.vram_reserve_mib,
            threads=torch.get_num_threads(),
            route_trace=Path(os.environ["STRATA_ROUTE_TRACE"]).name
            if os.environ.get("STRATA_ROUTE_TRACE")
            else None,
            experts_in_vram=ec.stats().experts_in_vram if ec is not None else None,
        )
    for t in rows:
        cs = caches[:t]
        steps(model, cs, 4, 0)  # captures this row count's graph
        before = ec.stats() if ec is not None else None
        secs = steps(model, cs, a.steps, 4)
        r = {
            "rows": t,
            "step_ms": round(1000 * secs / a.steps, 3),
            "tok_s": round(t * a.steps / secs, 1),
        }
        if ec is not None and before is not None:  # the timed steps' hits (selections of cached experts)
            now = ec.stats()
            hits, misses = now.hits - before.hits, now.misses - before.misses
            r["expert_hit_rate"] = round(hits / max(1, hits + misses), 4)
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
