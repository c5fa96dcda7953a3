"""A prompt far beyond the context, as JSON: how long its 400 takes, how long /health takes meanwhile, and the
server's resident memory before, after each request and a few seconds later (memory must come back).

    python bench/serve_big_prompt.py [--model F] [--mib 10] [--rounds 1] [--out bench/results/serve-big-prompt.json]
Without --model the embedded default model is served (its 262k-token vocabulary is the slowest to tokenize).
"""

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.serve_clients import start_server
from installer.default_model import default_model_path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path)
    ap.add_argument("--mib", type=float, default=10.0)
    ap.add_argument(
        "--rounds", type=int, default=1, help="send the three requests this many times (memory must level)"
    )
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    model = a.model or default_model_path()
    proc, url = start_server(model, ["--device", "cpu", "--max-body-mib", str(int(a.mib) + 2)])
    text = "lorem ipsum dolor sit amet " * int(a.mib * (1 << 20) / 27)
    health: list[float] = []
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            t = time.perf_counter()
            httpx.get(url + "/health", timeout=120)
            health.append(time.perf_counter() - t)
            time.sleep(0.05)

    rows = []
    server = psutil.Process(proc.pid)
    rss = lambda: round(server.memory_info().rss / 2**20, 1)  # noqa: E731
    httpx.post(url + "/v1/completions", json={"prompt": "warm up", "max_tokens": 4}, timeout=300)
    rss_start = rss()
    try:
        th = threading.Thread(target=poll)
        th.start()
        for path, body in a.rounds * (
            ("/v1/completions", {"prompt": text, "max_tokens": 1}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}], "max_tokens": 1}),
            ("/v1/completions", {"prompt": text, "max_tokens": 1}),
        ):
            t = time.perf_counter()
            r = httpx.post(url + path, json=body, timeout=300)
            rows.append({"path": path, "status": r.status_code, "seconds": round(time.perf_counter() - t, 3),
                         "message": r.json().get("error", {}).get("message", "")[:120], "rss_mib": rss()})  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
        stop.set()
        th.join()
        time.sleep(3)
        rss_end = rss()
    finally:
        stop.set()
        proc.terminate()
        proc.wait(30)
    out = {
        "what": "bench/serve_big_prompt.py: a prompt far beyond the context; its 400 and /health meanwhile",
        "model": model.name,
        "prompt_bytes": len(text.encode()),
        "requests": rows,
        "health_max_s": round(max(health), 3) if health else None,
        "health_polls": len(health),
        "rss_mib": {"start": rss_start, "end_3s_later": rss_end},
    }
    if a.out:
        a.out.write_text(json.dumps(out, indent=1))
    print(json.dumps({k: out[k] for k in ("prompt_bytes", "health_max_s", "rss_mib")}))


if __name__ == "__main__":
    main()
