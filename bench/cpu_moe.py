"""CPU decode of a small random MoE (the tests' tiny qwen3moe, Q4_K, or a GGUF given) with float copies of the
weights (the default budget) and with every weight in blocks (`--cpu-weights-mib 0`), each with exact float
products (`--activations float`) and with the experts computed from their Q4_K/Q6_K blocks in place by the 8-bit
kernels (`--activations int8`, the default; engine/experts/cpu_q4k.py).

    python bench/cpu_moe.py [--model M.gguf] [--threads 2] [--out bench/results/cpu-moe.json]"""

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.report import emit
from engine.pipeline.loader import load_model
from engine.testing.tiny_models import write_tiny_model


def decode_tok_s(path: Path, mib: int | None, activations: str, steps: int = 160) -> float:
    os.environ["STRATA_ACTIVATIONS"] = activations  # read at every MoE block
    m = load_model(str(path), device="cpu", dtype="f32", cpu_weights_mib=mib).model
    cache = m.new_cache(steps + 64, "f32")
    m.forward(torch.arange(1, 9), cache, 0)
    tok = torch.tensor([5])
    for p in range(8, 40):  # the float copies are made on first use: not timed
        tok = m.forward(tok, cache, p)[-1].argmax().view(1)
    t = time.perf_counter()
    for p in range(40, 40 + steps):
        tok = m.forward(tok, cache, p)[-1].argmax().view(1)
    return steps / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    path = (
        Path(a.model)
        if a.model
        else write_tiny_model(Path(tempfile.mkdtemp()) / "moe.gguf", "qwen3moe", qtype="Q4_K")
    )
    res = {
        "model": Path(a.model).name if a.model else "tiny qwen3moe (2 layers, 8 experts, top-2, Q4_K)",
        "threads": a.threads,
        "decode_tok_s_float_copies": round(decode_tok_s(path, None, "float"), 1),
        "decode_tok_s_blocks_only": round(decode_tok_s(path, 0, "float"), 1),
        "decode_tok_s_in_place": round(decode_tok_s(path, None, "int8"), 1),
        "decode_tok_s_in_place_blocks_only": round(decode_tok_s(path, 0, "int8"), 1),
    }
    emit(res, a.out)


if __name__ == "__main__":
    main()
