"""A long shared prefix read once: time to first token of a request whose prompt starts with an earlier request's.

    python bench/serve_prefix.py [--model F] [--prefix 30000] [--serve-args "..."] [--out bench/results/prefix.json]
    python bench/serve_prefix.py --url http://127.0.0.1:8090 --prefix 30000     (a server already running)

An agent sends the same tools, system prompt and history again and again with a few new tokens at the end. Here
request 1 is a prefix of about `--prefix` tokens (numbered lines of text) and a question; request 2 the same prefix
and another question; request 3, for comparison, a prefix of the same length with other lines (nothing to reuse);
request 4 the first prefix again with a third question (after another conversation came between).
Each asks for one token, so its latency is its time to first token; the usage says how many prompt tokens came
from the cache (`prompt_tokens_details.cached_tokens`). Done when request 2's time is at most 10% of request 1's."""

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.serve_clients import server_for


def prefix_text(tokens: int, seed: str) -> str:
    """About `tokens` tokens of numbered lines (~18 tokens a line for the usual BPE vocabularies)."""
    lines = [
        f"{seed} line {i}: the tool returned record {i * 7 % 1000} with status ok."
        for i in range(tokens // 18)
    ]
    return "\n".join(lines) + "\n"


def ask(client: httpx.Client, prompt: str) -> dict[str, Any]:
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0}
    t0 = time.perf_counter()
    r = client.post("/v1/completions", json=body)
    if r.status_code != 200:
        raise SystemExit(f"the server answered {r.status_code}: {r.text[:500]}")
    usage = r.json()["usage"]
    return {
        "ttft_s": round(time.perf_counter() - t0, 4),
        "prompt_tokens": usage["prompt_tokens"],
        "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path)
    ap.add_argument("--url")
    ap.add_argument("--serve-args", default="")
    ap.add_argument("--prefix", type=int, default=30000)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    room = [] if "--max-context" in a.serve_args else ["--max-context", str(a.prefix * 5 // 4 + 1024)]
    proc, url, model = server_for(
        a.url, a.model, a.serve_args, a.out.with_suffix(".log") if a.out else None, room
    )
    try:
        with httpx.Client(base_url=url, timeout=1800) as client:
            ask(client, "A warm-up request.")
            shared = prefix_text(a.prefix, "alpha")
            first = ask(client, shared + "Question: how many records were returned?")
            second = ask(client, shared + "Question: which record came last?")
            other = ask(client, prefix_text(a.prefix, "omega") + "Question: which record came last?")
            again = ask(client, shared + "Question: was any status not ok?")
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    res = {
        "what": "bench/serve_prefix.py: a second request sharing a long prefix, against the first and an unshared one",
        "server": url if a.url else f"strata-engine serve {a.serve_args}".strip(),
        "model": model,
        "machine": platform.platform(),
        "first": first,
        "shared_prefix": second,
        "unshared": other,
        "shared_again": again,
        "shared_over_first": round(second["ttft_s"] / first["ttft_s"], 4),
        "shared_again_over_first": round(again["ttft_s"] / first["ttft_s"], 4),
    }
    print(json.dumps(res, indent=1))
    if a.out:
        a.out.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
