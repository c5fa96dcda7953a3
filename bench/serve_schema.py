"""What structured output costs in decode: one client through HTTP, the same requests with and without a JSON schema.

    python bench/serve_schema.py [--model F] [--serve-args "..."] [--requests 6] [--tokens 128] [--out F.json]

Each request is a completion (greedy, end of text ignored), sent alternately plain and with `json_schema` (a
schema whose output can run long: an object holding an array of free strings), so that the mask's cost per token is
what differs. Decode speed is the server's own `timings.predicted_per_second` (prompt excluded) and the wall time per
generated token from the client. The ratio constrained/plain is the figure that matters.
"""

import argparse
import json
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.serve_clients import TOPICS, start_server
from installer.default_model import default_model_path

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "notes": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["title", "notes"],
}


def one(c: httpx.Client, prompt: str, tokens: int, schema: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
    if schema:
        body["json_schema"] = SCHEMA  # llama-server's field on /v1/completions
    t0 = time.perf_counter()
    r = c.post("/v1/completions", json=body)
    r.raise_for_status()
    j = r.json()
    wall = time.perf_counter() - t0
    t = j["timings"]
    return {
        "tokens": t["predicted_n"],
        "decode_tok_s": t["predicted_per_second"],
        "wall_ms_per_token": round(wall * 1e3 / max(1, t["predicted_n"]), 3),
        "text_head": j["choices"][0]["text"][:60],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path)
    ap.add_argument("--serve-args", default="")
    ap.add_argument("--requests", type=int, default=6, help="requests of each kind")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    model = a.model or default_model_path()
    proc, url = start_server(model, shlex.split(a.serve_args))
    runs: dict[str, list[dict[str, Any]]] = {"plain": [], "json_schema": []}
    try:
        with httpx.Client(base_url=url, timeout=600) as c:
            one(c, "A warm-up request.", 16, False)
            one(c, "A warm-up request.", 16, True)
            for i in range(a.requests):
                prompt = f"Request {i}: notes about {TOPICS[i % len(TOPICS)]}, as JSON."
                for kind in ("plain", "json_schema") if i % 2 == 0 else ("json_schema", "plain"):
                    r = one(c, prompt, a.tokens, kind == "json_schema")
                    runs[kind].append(r)
                    print(kind, json.dumps(r), flush=True)
    finally:
        proc.terminate()
        proc.wait(30)
    med = {k: statistics.median(r["decode_tok_s"] for r in v) for k, v in runs.items()}
    out = {
        "what": "bench/serve_schema.py: decode with and without a JSON schema, one client through HTTP",
        "server": f"strata-engine serve {a.serve_args}".strip(),
        "model": model.name,
        "machine": {"cpu_count": __import__("os").cpu_count(), "platform": platform.platform()},
        "schema": SCHEMA,
        "median_decode_tok_s": med,
        "json_schema_over_plain": round(med["json_schema"] / med["plain"], 3),
        "runs": runs,
    }
    if a.out:
        a.out.write_text(json.dumps(out, indent=1))
    print(json.dumps({"median_decode_tok_s": med, "json_schema_over_plain": out["json_schema_over_plain"]}))


if __name__ == "__main__":
    main()
