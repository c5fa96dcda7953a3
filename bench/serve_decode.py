"""Decode speed through the server against direct generation on the same model, same threads.

Direct: `Runner.generate` in this process. Server: `strata-engine serve` as a subprocess, one request at a time,
whole (its `timings.predicted_per_second`) and streamed (tokens/s the client sees between its first and last
token). Runs alternate (direct, server, direct, ...) and the medians are compared.

python bench/serve_decode.py [--model F] [--tokens 128] [--rounds 5] [--threads 1] [--out bench/results/serve-decode-cpu.json]
Without --model a tiny qwen3moe (Q8_0) is written to a temporary folder.
"""

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.serve_clients import start_server as serve
from engine.layers.kv_cache import resolve_kv_type
from engine.pipeline.generate import DoneEvent, GenerationRequest, Runner
from engine.pipeline.loader import load_model
from engine.pipeline.sampling import GREEDY
from engine.testing.tiny_models import write_tiny_model

PROMPT = "The history of the city begins"


def start_server(model: Path, threads: int, ctx: int) -> tuple[subprocess.Popen[str], str]:
    return serve(model, ["--device", "cpu", "--threads", str(threads), "--max-context", str(ctx)])


def server_whole(url: str, n: int) -> float:
    body = {"prompt": PROMPT, "max_tokens": n, "temperature": 0, "ignore_eos": True, "cache_prompt": False}
    r = httpx.post(url + "/v1/completions", json=body, timeout=600).json()
    assert r["usage"]["completion_tokens"] == n, r
    return float(r["timings"]["predicted_per_second"])


def server_stream(url: str, n: int) -> tuple[float, float]:
    """-> (the server's own decode tok/s, tok/s the client sees between its first and last piece)"""
    body = {"prompt": PROMPT, "max_tokens": n, "temperature": 0, "ignore_eos": True, "cache_prompt": False}
    times = []
    server = 0.0
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and '"finish_reason":null' in line:
                times.append(time.perf_counter())
            elif line.startswith("data: {") and '"timings"' in line:
                server = float(json.loads(line[6:])["timings"]["predicted_per_second"])
    # Pieces may merge (or hold back part of a character), so the rate uses the tokens, not the pieces.
    return server, (n - 1) / (times[-1] - times[0])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    tmp = tempfile.TemporaryDirectory()
    model = (
        Path(a.model) if a.model else write_tiny_model(Path(tmp.name) / "tiny-moe.gguf", "qwen3moe", "Q8_0")
    )
    ctx = 1024
    lm = load_model(model, device="cpu")
    runner = Runner(lm.model, lm.tokenizer, ctx, resolve_kv_type("auto", lm.model.dtype))
    ids = lm.tokenizer.encode(PROMPT)
    req = GenerationRequest(ids, max_tokens=a.tokens, sampling=GREEDY, ignore_eos=True, cache_prompt=False)

    def direct() -> float:
        done = [e for e in runner.generate(req) if isinstance(e, DoneEvent)][0]
        return done.timings.generated_per_second

    proc, url = start_server(model, a.threads, ctx)
    try:
        direct(), server_whole(url, a.tokens), server_stream(url, a.tokens)  # warm-up
        d, w, ss, s = [], [], [], []
        for _ in range(a.rounds):
            d.append(direct())
            w.append(server_whole(url, a.tokens))
            own, seen = server_stream(url, a.tokens)
            ss.append(own)
            s.append(seen)
    finally:
        proc.terminate()
        proc.wait(10)
    res = {
        "model": model.name,
        "tokens": a.tokens,
        "rounds": a.rounds,
        "threads": a.threads,
        "cpu": platform.processor() or platform.machine(),
        "direct_tok_s": [round(x, 1) for x in d],
        "server_tok_s": [round(x, 1) for x in w],
        "server_stream_tok_s": [round(x, 1) for x in ss],
        "server_stream_client_tok_s": [round(x, 1) for x in s],
        "median_direct": round(statistics.median(d), 1),
        "median_server": round(statistics.median(w), 1),
        "median_server_stream": round(statistics.median(ss), 1),
        "median_server_stream_client": round(statistics.median(s), 1),
        "ratio_server": round(statistics.median(w) / statistics.median(d), 3),
        "ratio_server_stream": round(statistics.median(ss) / statistics.median(d), 3),
        "ratio_server_stream_client": round(statistics.median(s) / statistics.median(d), 3),
    }
    print(json.dumps(res, indent=1))
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
