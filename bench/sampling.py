"""Milliseconds per sampled token for the sampler's settings on a full vocabulary (Qwen's 151,936; Gemma's 262,144),
with the logits on the CPU and, where there is one, on the GPU (the filtering then runs there).

    python bench/sampling.py [--threads N] [--out bench/results/sampling-cpu.json]"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from engine.pipeline.sampling import Sampler, SamplingParams

SETTINGS = {
    "defaults (top-k 40, top-p 0.95, min-p 0.05, T 0.8)": SamplingParams(seed=1),
    "top-p 0.9 only (top-k off)": SamplingParams(seed=1, top_k=0, min_p=0.0, top_p=0.9),
    "greedy": SamplingParams(temperature=0.0),
}


def per_sample_ms(params: SamplingParams, logits: torch.Tensor, n: int = 30) -> float:
    s = Sampler(params)
    history = list(range(100, 164))
    s.sample(logits, history)
    if logits.is_cuda:
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        s.sample(logits, history)
    return (time.perf_counter() - t) / n * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    res: dict = {"torch_threads": torch.get_num_threads(), "ms_per_token": {}}
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for vocab in (151936, 262144):
        logits = torch.randn(vocab, generator=torch.Generator().manual_seed(0)) * 3
        for dev in devices:
            for name, params in SETTINGS.items():
                ms = per_sample_ms(params, logits.to(dev))
                res["ms_per_token"][f"{vocab} {dev} {name}"] = round(ms, 3)
                print(f"vocab {vocab} {dev:4s} {name}: {ms:.3f} ms")
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
