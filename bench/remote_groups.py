"""Groups of slots pipelined through a remote stage: a main process (layers 0..K-1 and the head) and a worker (K
onward, another process on loopback, as on another PC) decode N requests together, with the slots in 1 group (the
two processes take turns) and in G groups (a group's step goes out while the worker computes another's). Both
processes compute with one thread each, as two PCs would each use their own cores; greedy tokens must be the
same in every setting (float activations, whose rounding does not depend on the rows beside a row).

    python bench/remote_groups.py [--layers 8 --width 512 --requests 8 --tokens 48 --groups 1,2,4] [--out F]
"""

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.report import emit
from engine.link.startup import load_split_model
from engine.pipeline.batch import BatchRunner
from engine.pipeline.generate import DoneEvent, Event, GenerationRequest
from engine.pipeline.sampling import GREEDY
from engine.pipeline.split import SplitOptions
from engine.testing.tiny_models import write_tiny_model
from tests.engine.link.harness import TOKEN, start_worker


def run(
    lm: object, groups: int, reqs: list[GenerationRequest], slots: int
) -> tuple[float, list[list[int]], int]:
    """All requests admitted at once (in slots as they free up) -> (generated tok/s, tokens per request, steps)."""
    br = BatchRunner(lm.model, lm.tokenizer, 512, "f32", slots=slots, groups=groups)  # type: ignore[attr-defined]
    assert br.groups == groups, (br.groups, groups)
    got: list[list[Event]] = [[] for _ in reqs]
    waiting = list(range(len(reqs)))
    steps = 0
    t = time.perf_counter()
    with torch.inference_mode():
        while waiting or br.busy or br.in_flight:
            while waiting and br.free:
                i = waiting.pop(0)
                br.admit(reqs[i], got[i].append)
            br.step()
            steps += 1
    wall = time.perf_counter() - t
    tokens = [next(e for e in ev if isinstance(e, DoneEvent)).tokens for ev in got]
    return sum(len(x) for x in tokens) / wall, tokens, steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--groups", default="1,2,4")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out")
    a = ap.parse_args()
    torch.set_num_threads(1)
    os.environ["STRATA_STAGE_TOKEN"] = TOKEN
    # exact float products in both processes: the CPU's 8-bit kernels round a row by the rows beside it, and the
    # groups change which rows share a step (tokens are then compared bit for bit)
    os.environ["STRATA_ACTIVATIONS"] = "float"
    k = a.layers // 2
    tmp = Path(tempfile.mkdtemp())
    path = write_tiny_model(tmp / "bench.gguf", "qwen3moe", qtype="Q8_0", seed=1, n_layer=a.layers,
                            n_embd=a.width, n_ff_exp=a.width, n_head=8, head_dim=64)  # fmt: skip
    worker = start_worker(
        path, k, extra=["--max-context", "512", "--parallel", str(a.requests), "--threads", "1"]
    )
    res: dict = {
        "host": platform.node(),
        "cpu_threads_per_process": 1,
        "cpu_count": os.cpu_count(),
        "layers": a.layers,
        "width": a.width,
        "k": k,
        "requests": a.requests,
        "tokens": a.tokens,
        "runs": {},
    }
    try:
        opts = SplitOptions(device="cpu", layer_split=(k,), remote=f"127.0.0.1:{worker.port}")
        lm = load_split_model(path, opts, 512, "f32", "f32", parallel=a.requests)
        g = torch.Generator().manual_seed(3)
        prompts = [torch.randint(5, 400, (16,), generator=g).tolist() for _ in range(a.requests)]
        reqs = [GenerationRequest(p, max_tokens=a.tokens, sampling=GREEDY, ignore_eos=True) for p in prompts]
        run(lm, 1, reqs[:2], a.requests)  # warm-up
        want = None
        for groups in [int(x) for x in a.groups.split(",")]:
            best, steps = 0.0, 0
            for _ in range(a.rounds):
                tok_s, tokens, steps = run(lm, groups, reqs, a.requests)
                want = want if want is not None else tokens
                assert tokens == want, f"groups {groups} changed the tokens"
                best = max(best, tok_s)
            res["runs"][str(groups)] = {"tok_s": round(best, 2), "steps": steps}
            print(f"groups {groups}: {best:.1f} tok/s in total ({steps} steps)", flush=True)
        base = res["runs"]["1"]["tok_s"] if "1" in res["runs"] else None
        if base:
            res["ratio_to_one_group"] = {g: round(r["tok_s"] / base, 3) for g, r in res["runs"].items()}
        lm.model.close()  # type: ignore[attr-defined]
    finally:
        worker.stop()
    emit(res, a.out)


if __name__ == "__main__":
    main()
