"""Verify windows with several clients at once, through HTTP: aggregate decode with `--spec 0` and `--spec N` at
the same `--parallel`, on a request that copies much of its prompt (the case prompt lookup drafts: an assistant
sending a file back with one change), greedy; the answers are compared between the two.

    python bench/spec_slots.py [--model F] [--clients 1,4] [--spec 4] [--tokens 160]
                               [--serve-args "--parallel 4 --threads 2"] [--out bench/results/spec-slots-cpu.json]
Without --model the embedded default model is served.
"""

import argparse
import json
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.serve_clients import at_once, start_server
from installer.default_model import default_model_path

CODE = """def parse_rows(lines):
    rows = []
    for n, line in enumerate(lines):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, _, value = line.partition("=")
        if not value:
            raise ValueError(f"line {n + 1}: expected name = value")
        rows.append((name.strip(), value.strip()))
    return rows


def write_rows(rows, path):
    with open(path, "w", encoding="utf-8") as f:
        for name, value in rows:
            f.write(f"{name} = {value}\\n")
"""


def _ask(url: str, k: int, tokens: int) -> dict[str, Any]:
    body = {
        "messages": [
            {
                "role": "user",
                "content": f"Request {k}. Here is a Python file:\n\n```python\n{CODE}```\n\nAdd type hints to "
                "both functions and reply with the whole file in one code block.",
            }
        ],
        "max_tokens": tokens,
        "temperature": 0,
    }
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=600)
    r.raise_for_status()
    j = r.json()
    t = j.get("timings") or {}
    return {
        "latency_s": time.perf_counter() - t0,
        "tokens": j["usage"]["completion_tokens"],
        "text": j["choices"][0]["message"]["content"],
        "draft_n": t.get("draft_n", 0),
        "draft_n_accepted": t.get("draft_n_accepted", 0),
    }


def _round(url: str, clients: int, tokens: int) -> dict[str, Any]:
    out: list[dict[str, Any] | None] = [None] * clients

    def client(k: int) -> None:
        out[k] = _ask(url, k, tokens)

    wall = at_once(clients, client)
    done = [o for o in out if o is not None]
    total = sum(o["tokens"] for o in done)
    proposed = sum(o["draft_n"] for o in done)
    return {
        "clients": clients,
        "completion_tokens": total,
        "wall_s": round(wall, 3),
        "aggregate_tok_s": round(total / wall, 2),
        "drafts_proposed": proposed,
        "drafts_accepted": sum(o["draft_n_accepted"] for o in done),
        "texts": [o["text"] for o in done],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path)
    ap.add_argument("--clients", default="1,4")
    ap.add_argument("--spec", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=160)
    ap.add_argument("--serve-args", default="--parallel 4 --threads 2")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    model = a.model or default_model_path()
    counts = [int(c) for c in a.clients.split(",")]
    runs: dict[str, list[dict[str, Any]]] = {}
    for spec in (0, a.spec):
        proc, url = start_server(model, [*shlex.split(a.serve_args), "--spec", str(spec)])
        try:
            _round(url, 1, 8)  # warm-up: the first request's one-time costs
            runs[f"spec{spec}"] = [_round(url, c, a.tokens) for c in counts]
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    rows = []
    for i, c in enumerate(counts):
        base, spec = runs["spec0"][i], runs[f"spec{a.spec}"][i]
        rows.append({
            "clients": c,
            "spec0_tok_s": base["aggregate_tok_s"],
            f"spec{a.spec}_tok_s": spec["aggregate_tok_s"],
            "ratio": round(spec["aggregate_tok_s"] / base["aggregate_tok_s"], 3),
            "drafts_kept": f"{spec['drafts_accepted']} of {spec['drafts_proposed']}",
            "same_answers": base["texts"] == spec["texts"],
        })  # fmt: skip
        print(json.dumps(rows[-1]))
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps({
            "what": "bench/spec_slots.py: --spec 0 against --spec N at one --parallel, clients at once, greedy",
            "model": model.name, "serve_args": a.serve_args, "tokens": a.tokens, "machine": platform.node(),
            "rows": rows, "runs": runs,
        }, indent=1) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()
