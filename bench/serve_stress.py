"""Many clients, mixed lengths and cancels, as JSON: every request answered or cancelled by its client, no 5xx, the
server's memory after the run.

64 clients each send 4 requests one after another: prompts of 1 to ~200 tokens, 1 to 64 tokens to generate, half
streamed; every fifth streamed request is dropped by its client after its first tokens. Counted: answers, cancels,
errors by status, answers that did not arrive (lost), and the server's resident memory before, after a first
round and after each later one (--rounds; a leak grows between them; the prompt cache's own growth, up to
--prompt-cache-mib, is given beside it).

    python bench/serve_stress.py [--model F] [--clients 64] [--requests 4] [--serve-args "..."] [--out F]
Without --model a tiny qwen3moe is written to a temporary folder (the server's speed is not what is measured).
"""

import argparse
import json
import random
import shlex
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.serve_clients import start_server
from engine.testing.tiny_models import write_tiny_model

WORDS = "amber birch cedar delta ember fjord grove harbor island jade kelp lumen marsh north ochre".split()


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def one(c: httpx.Client, rng: random.Random, tally: dict[str, Any], lock: threading.Lock) -> None:
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 150)))
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": rng.randint(1, 64), "temperature": 0}
    stream = rng.random() < 0.5
    drop = stream and rng.random() < 0.2
    outcome = "lost"
    try:
        if not stream:
            r = c.post("/v1/completions", json=body)
            outcome = "ok" if r.status_code == 200 and r.json()["choices"] else f"http {r.status_code}"
        else:
            with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                if r.status_code != 200:
                    outcome = f"http {r.status_code}"
                else:
                    for line in r.iter_lines():
                        if drop and line.startswith("data: {"):
                            outcome = "cancelled"
                            break
                        if line == "data: [DONE]":
                            outcome = "ok"
    except Exception as e:  # counted by kind
        outcome = f"client {type(e).__name__}"
    with lock:
        tally[outcome] = tally.get(outcome, 0) + 1


def round_of(url: str, clients: int, requests: int, seed: int) -> tuple[dict[str, Any], float]:
    tally: dict[str, Any] = {}
    lock = threading.Lock()

    def client(k: int) -> None:
        rng = random.Random(seed * 1000 + k)
        with httpx.Client(base_url=url, timeout=600) as c:
            for _ in range(requests):
                one(c, rng, tally, lock)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return tally, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--serve-args", default="--device cpu --threads 1 --max-queue 256")
    ap.add_argument(
        "--rounds", type=int, default=2, help="rounds of every client's requests (memory after each)"
    )
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = a.model or write_tiny_model(Path(tmp) / "tiny.gguf", "qwen3moe", "Q8_0", seed=0)
        proc, url = start_server(model, shlex.split(a.serve_args))
        try:
            httpx.post(url + "/v1/completions", json={"prompt": "warm up", "max_tokens": 4}, timeout=60)
            rss = [rss_mib(proc.pid)]
            rounds = []
            for seed in range(1, a.rounds + 1):
                tally, wall = round_of(url, a.clients, a.requests, seed)
                time.sleep(1.0)  # the cancelled requests' slots are freed at the next step
                stats = httpx.get(url + "/stats", timeout=30).json()
                rss.append(rss_mib(proc.pid))
                pc = stats.get("prompt_cache") or {}
                rounds.append({"outcomes": tally, "wall_s": round(wall, 1), "queue_after": stats["queue"],
                               "slots_busy_after": (stats["slots"] or {}).get("busy"),
                               "prompt_cache_mib_after": round(pc.get("bytes", 0) / 2**20, 1)})  # fmt: skip
                print(json.dumps(rounds[-1]), flush=True)
        finally:
            proc.terminate()
            proc.wait(30)
    total = a.clients * a.requests
    out = {
        "what": "bench/serve_stress.py: clients x requests of mixed lengths, half streamed, a fifth of those dropped",
        "server": f"strata-engine serve {a.serve_args}",
        "clients": a.clients,
        "requests_per_client": a.requests,
        "rounds": rounds,
        "lost": sum(r["outcomes"].get("lost", 0) for r in rounds),
        "http_5xx": sum(n for r in rounds for k, n in r["outcomes"].items() if k.startswith("http 5")),
        "answered_or_cancelled": [
            r["outcomes"].get("ok", 0) + r["outcomes"].get("cancelled", 0) for r in rounds
        ],
        "of": total,
        "rss_mib": {"before": round(rss[0], 1), "after_rounds": [round(r, 1) for r in rss[1:]]},
        # what the process grew by over the last half of the rounds, less what the prompt cache counted in that time
        "rss_growth_late_less_cache_mib": _late_growth(
            rss[1:], [r["prompt_cache_mib_after"] for r in rounds]
        ),
    }
    if a.out:
        a.out.write_text(json.dumps(out, indent=1))
    print(json.dumps({k: out[k] for k in ("lost", "http_5xx", "answered_or_cancelled", "of", "rss_mib")}))


def _late_growth(rss: list[float], cache: list[float]) -> float | None:
    """Resident memory's growth from the middle round to the last, less the prompt cache's own (a leak shows here;
    the first rounds fill caches and pools)."""
    if len(rss) < 2:
        return None
    mid = len(rss) // 2
    return round((rss[-1] - rss[mid - 1]) - (cache[-1] - cache[mid - 1]), 1)


if __name__ == "__main__":
    main()
