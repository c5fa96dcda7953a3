"""What the layer split costs on one card: the unsplit model against two stages on the same card
(`--layer-split K --split-device 0`), decode tok/s and prompt tok/s, measured in interleaved rounds in one run.

    python bench/split_bench.py --model M.gguf [--split 24] [--prompt 4096] [--decode 128] [--rounds 3]
                                [--out bench/results/split-one-card.json]

The issue's bar: two stages on one H200 cost <= 3% decode and <= 5% prompt 4096. The split is measured with the
pinned-host hand-off (the path two cards use) and with a direct hand-off (no copy: what is left is the stage
boundary itself), and once more with the host hand-off but without the stage clock (`host-noclock`: what measuring
each stage's compute, waiting and transfer costs). Ratios are split / unsplit from the best of each arm's rounds."""

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.report import emit
from engine.link.startup import load_split_model
from engine.pipeline.handoff import Handoff
from engine.pipeline.loader import load_model
from engine.pipeline.split import SplitOptions
from engine.pipeline.stages import SplitModel


def prompt_tok_s(model: object, n: int, chunk: int) -> float:
    ids = torch.randint(100, 10000, (n,), generator=torch.Generator().manual_seed(n))
    cache = model.new_cache(n + 8, "bf16")  # type: ignore[attr-defined]
    torch.cuda.synchronize()
    t = time.perf_counter()
    with torch.inference_mode():
        for s in range(0, n, chunk):
            model.forward(ids[s : s + chunk], cache, s)  # type: ignore[attr-defined]
    torch.cuda.synchronize()
    return n / (time.perf_counter() - t)


def decode_tok_s(model: object, n: int) -> float:
    cache = model.new_cache(n + 64, "bf16")  # type: ignore[attr-defined]
    with torch.inference_mode():
        model.forward(torch.arange(1, 17), cache, 0)  # type: ignore[attr-defined]
        tok = torch.tensor([42])
        for p in range(16, 20):  # graph captures
            tok = model.forward(tok, cache, p)[-1].argmax().view(1).cpu()  # type: ignore[attr-defined]
        torch.cuda.synchronize()
        t = time.perf_counter()
        for p in range(20, 20 + n):
            tok = model.forward(tok, cache, p)[-1].argmax().view(1).cpu()  # type: ignore[attr-defined]
        torch.cuda.synchronize()
    return n / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--split", type=int, default=24, help="first layer of the second stage")
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--chunk", type=int, default=4096, help="prompt tokens per forward")
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out")
    a = ap.parse_args()
    t0 = time.perf_counter()
    base = load_model(a.model, "cuda", "bf16").model
    split_lm = load_split_model(
        a.model,
        SplitOptions(device="cuda", layer_split=(a.split,), split_device=("0",)),
        a.prompt + 64,
        "bf16",
        "bf16",
    )
    sm = split_lm.model
    assert isinstance(sm, SplitModel)
    dev = sm.devices[0]
    host, direct = sm.handoffs[0], Handoff(dev, dev, "direct")
    load_s = time.perf_counter() - t0

    arms: dict[str, dict[str, list[float]]] = {
        k: {"decode": [], "prompt": []} for k in ("unsplit", "host", "direct", "host-noclock")
    }
    for _ in range(a.rounds):
        for name in arms:
            model = base
            if name != "unsplit":
                sm.handoffs[0] = direct if name == "direct" else host
                sm.measure = name != "host-noclock"
                model = sm
            arms[name]["decode"].append(decode_tok_s(model, a.decode))
            arms[name]["prompt"].append(prompt_tok_s(model, a.prompt, a.chunk))
    best = {k: {m: max(v) for m, v in d.items()} for k, d in arms.items()}
    res = {
        "model": Path(a.model).name,
        "device": torch.cuda.get_device_name(dev),
        "split": f"layers 0-{a.split - 1} / {a.split}-end on one card",
        "load_s": load_s,
        "rounds": a.rounds,
        "tok_s": arms,
        "best_tok_s": best,
        "ratio_split_host": {m: best["host"][m] / best["unsplit"][m] for m in ("decode", "prompt")},
        "ratio_split_direct": {m: best["direct"][m] / best["unsplit"][m] for m in ("decode", "prompt")},
        "ratio_stage_clock": {m: best["host"][m] / best["host-noclock"][m] for m in ("decode", "prompt")},
        "bar": {"decode": 0.97, "prompt": 0.95},
        "prompt_tokens": a.prompt,
        "prompt_chunk": a.chunk,
        "decode_tokens": a.decode,
    }
    emit(res, a.out)


if __name__ == "__main__":
    main()
