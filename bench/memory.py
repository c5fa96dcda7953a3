"""Resident memory (CPU) or VRAM (CUDA) of a loaded model after a short generation, against its file size.

python bench/memory.py [--model F] [--device cpu|cuda] [--max-context 4096] [--out bench/results/memory-cpu.json]
"""

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.pipeline.generate import DoneEvent, GenerationRequest, Runner
from engine.pipeline.loader import load_model
from engine.pipeline.sampling import GREEDY
from installer.default_model import default_model_path

GiB = 1 << 30


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-context", type=int, default=4096)
    ap.add_argument(
        "--cpu-weights-mib", type=int, help="0: weights stay in blocks (default: automatic budget)"
    )
    ap.add_argument("--out")
    a = ap.parse_args()
    path = Path(a.model) if a.model else default_model_path()
    proc = psutil.Process()
    rss0 = proc.memory_info().rss
    lm = load_model(path, device=a.device, cpu_weights_mib=a.cpu_weights_mib)
    kv = resolve = "f32" if lm.model.dtype == torch.float32 else "bf16"
    runner = Runner(lm.model, lm.tokenizer, a.max_context, resolve)
    ids = lm.tokenizer.encode("The capital of France is the city of", add_special=True, parse_special=False)
    t = time.perf_counter()
    done = [
        e
        for e in runner.generate(GenerationRequest(ids, max_tokens=16, sampling=GREEDY))
        if isinstance(e, DoneEvent)
    ][0]
    file_size = sum(p.stat().st_size for p in lm.gguf.paths)
    res = {
        "model": path.name,
        "device": a.device,
        "file_bytes": file_size,
        "kv_bytes": runner.cache.nbytes,
        "kv_type": kv,
        "cpu_weights_mib": a.cpu_weights_mib,
        "rss_before_load": rss0,
        "rss_after": proc.memory_info().rss,
        "decode_tok_s": done.timings.generated_per_second,
        "prompt_tok_s": done.timings.prompt_per_second,
        "seconds": time.perf_counter() - t,
        "host": platform.node(),
    }
    res["rss_limit"] = int(1.15 * file_size + res["kv_bytes"] + 0.5 * GiB)
    if a.device.startswith("cuda"):
        res["vram_allocated"] = torch.cuda.memory_allocated()
        res["vram_peak"] = torch.cuda.max_memory_allocated()
        res["weights_on_device"] = sum(
            t.nbytes for lw in lm.model.layers.values() for t in vars(lw).values() if hasattr(t, "nbytes")
        )
    text = json.dumps(res, indent=2)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
