"""Time to first token through HTTP for prompt lengths the server has not seen, against lengths it has.

    python bench/serve_ttft.py [--model F] [--lengths 20] [--serve-args "..."] [--out bench/results/ttft.json]
    python bench/serve_ttft.py --url http://127.0.0.1:8090 ...     (a server already running, e.g. llama-server)

For each of N distinct prompt lengths (9 to ~1,000 tokens, one word a token), one request of that length the
server has never had (first seen), then one of the same length with other words (seen: no prompt-cache hit, since
the words differ from the first word on). Each request asks for one token, so its latency is its time to first
token. The figure that matters is the worst first-seen / seen ratio: a server that captures or compiles something
for a new length makes that request wait."""

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.serve_clients import server_for

WORDS = ["river", "stone", "cloud", "field", "light", "north", "table", "green", "water", "sound"]


def lengths(n: int) -> list[int]:
    """n distinct lengths from 9 to ~1,000, spread geometrically, none a multiple of 8."""
    out: list[int] = []
    x = 9.0
    while len(out) < n:
        t = int(x)
        t += 1 if t % 8 == 0 else 0
        if not out or t > out[-1]:
            out.append(t)
        x *= (1000 / 9) ** (1 / max(n - 1, 1))
    return out


def ask(client: httpx.Client, words: int, word: str) -> float:
    body = {"prompt": " ".join([word] * words), "max_tokens": 1, "temperature": 0, "cache_prompt": False}
    t0 = time.perf_counter()
    r = client.post("/v1/completions", json=body)
    r.raise_for_status()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path)
    ap.add_argument("--url")
    ap.add_argument("--serve-args", default="")
    ap.add_argument("--lengths", type=int, default=20)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    proc, url, model = server_for(a.url, a.model, a.serve_args, a.out.with_suffix(".log") if a.out else None)
    rows = []
    try:
        with httpx.Client(base_url=url, timeout=600) as client:
            ask(client, 5, "hello")  # the server's first request ever (lazy set-up a client never sees twice)
            for n, t in enumerate(lengths(a.lengths)):
                first = ask(client, t, WORDS[n % len(WORDS)])
                seen = ask(client, t, WORDS[(n + 5) % len(WORDS)])
                rows.append({"words": t, "first_s": round(first, 4), "seen_s": round(seen, 4),
                             "ratio": round(first / seen, 2)})  # fmt: skip
                print(json.dumps(rows[-1]), flush=True)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    res = {
        "what": __doc__.splitlines()[0],
        "server": a.url or f"strata-engine serve {a.serve_args}".strip(),
        "model": model,
        "machine": {"platform": platform.platform()},
        "rows": rows,
        "worst_ratio": max(r["ratio"] for r in rows),
        "median_ratio": statistics.median(r["ratio"] for r in rows),
    }
    print(json.dumps({k: res[k] for k in ("worst_ratio", "median_ratio")}))
    if a.out:
        a.out.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
