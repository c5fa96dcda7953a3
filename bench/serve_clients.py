"""Several clients at once through HTTP, as users send them: aggregate decode and latency per client count.

Each of C clients sends R requests one after another (distinct prompts, `--tokens` each, greedy, end of text
ignored), all C at once; the aggregate is every completion token over the wall time from the first request to the
last answer. The same client measures our server (started here: `strata-engine serve` with `--serve-args`) or any
OpenAI-style server already running (`--url`, e.g. llama-server), so that the two are compared with one client.

    python bench/serve_clients.py [--model F] [--clients 1,2,4,8] [--tokens 64] [--requests 2]
                                  [--serve-args "--parallel 4 --threads 2"] [--out bench/results/serve-clients.json]
    python bench/serve_clients.py --url http://127.0.0.1:8090 --clients 1,8 --out llama-server.json
Without --model or --url the embedded default model is served. `--stream` streams each answer and reports, per
request, the time to its first token and its decode rate as the client sees it ((tokens - 1) over the time from
the first piece to the last): the served decode, apart from the prompt's reading.
"""

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from installer.default_model import default_model_path

TOPICS = [
    "rivers", "glaciers", "volcanoes", "deserts", "forests", "oceans", "mountains", "islands", "caves", "storms",
    "harbors", "bridges", "castles", "gardens", "markets", "railways", "lighthouses", "libraries", "farms", "mills",
]  # fmt: skip


def start_server(
    model: Path, args: list[str], log: Path | None = None, stacks: Path | None = None
) -> tuple[subprocess.Popen[str], str]:
    """Our server on `model` -> (its process, its URL) once it is ready; its log goes to `log` where given, its
    threads' sampled stacks to `stacks` (bench/stack_sample.py)."""
    # serve's auto context would take VRAM from the expert cache that earlier runs had
    if "--max-context" not in args:
        args = ["--max-context", "4096", *args]
    cmd = [sys.executable, "-m", "engine.cli", "serve", "--model", str(model), "--port", "0", *args]
    if stacks is not None:
        cmd[1:1] = [str(Path(__file__).with_name("stack_sample.py")), "--out", str(stacks), "--"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    assert proc.stderr is not None
    sink = log.open("w") if log is not None else None
    seen: list[str] = []
    for line in proc.stderr:
        seen = [*seen[-19:], line]
        if sink is not None:
            sink.write(line)
        if "listening on http://" in line:
            url = line.split("listening on ", 1)[1].split()[0]
            break
    else:
        raise SystemExit("the server did not start; its last lines:\n" + "".join(seen))

    def drain() -> None:
        for line in proc.stderr:  # type: ignore[union-attr]
            if sink is not None:
                sink.write(line)
                sink.flush()

    threading.Thread(target=drain, daemon=True).start()
    deadline = time.monotonic() + 600
    while httpx.get(url + "/health", timeout=10).json()["status"] == "loading":
        if time.monotonic() > deadline:
            raise SystemExit("the model did not load within 10 minutes")
        time.sleep(0.2)
    return proc, url


def server_for(
    url: str | None, model: Path | None, serve_args: str, log: Path | None, first: list[str] | None = None
) -> tuple[subprocess.Popen[str] | None, str, str]:
    """The server a bench measures: the one running at `url`, or ours started on `model` (the embedded default
    model) with `first` and then `serve_args` -> (our process or None, its URL, the model's name)."""
    if url:
        return None, url, "(the server's)"
    path = model or default_model_path()
    proc, url = start_server(path, [*(first or []), *shlex.split(serve_args)], log)
    return proc, url, path.name


def ask(client: httpx.Client, prompt: str, tokens: int) -> dict[str, Any]:
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
    t0, wall = time.perf_counter(), time.time()
    r = client.post("/v1/completions", json=body)
    r.raise_for_status()
    j = r.json()
    return {"latency_s": time.perf_counter() - t0, "tokens": j["usage"]["completion_tokens"], "at": wall}


def ask_streamed(client: httpx.Client, prompt: str, tokens: int) -> dict[str, Any]:
    """ask, streamed: with the time to the first piece and the decode rate between the first piece and the last
    (pieces may merge, so the rate counts the tokens the usage or, without one, max_tokens says)."""
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    t0, wall = time.perf_counter(), time.time()
    times: list[float] = []
    n = tokens
    with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            j = json.loads(line[6:])
            if (j.get("usage") or {}).get("completion_tokens"):
                n = int(j["usage"]["completion_tokens"])
            if any(c.get("text") for c in j.get("choices") or []):
                times.append(time.perf_counter())
    if len(times) < 2:
        raise RuntimeError(f"a streamed answer came in {len(times)} piece(s): no decode rate")
    return {
        "latency_s": time.perf_counter() - t0,
        "tokens": n,
        "at": wall,
        "ttft_s": times[0] - t0,
        "decode_tok_s": (n - 1) / (times[-1] - times[0]),
    }


def at_once(clients: int, client: Callable[[int], None]) -> float:
    """Run client(k) for k < clients in threads that all start together -> the wall time until the last ends."""
    start = threading.Barrier(clients + 1)

    def run(k: int) -> None:
        start.wait()
        client(k)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def round_of(
    url: str, clients: int, requests: int, tokens: int, offset: int, stream: bool = False
) -> dict[str, Any]:
    results: list[dict[str, Any]] = []
    send = ask_streamed if stream else ask
    errors: list[str] = []

    def client(k: int) -> None:
        with httpx.Client(base_url=url, timeout=600) as c:
            for i in range(requests):
                topic = TOPICS[(offset + k * requests + i) % len(TOPICS)]
                try:
                    results.append(
                        send(c, f"Request {offset + k * requests + i}: a short essay about {topic}.", tokens)
                    )
                except Exception as e:  # counted and reported
                    errors.append(f"{type(e).__name__}: {e}")

    wall = at_once(clients, client)
    total = sum(r["tokens"] for r in results)
    lat = [r["latency_s"] for r in results]
    streamed = (
        {
            "ttft_s": [round(r["ttft_s"], 3) for r in results],
            "decode_tok_s": [round(r["decode_tok_s"], 2) for r in results],
            "decode_tok_s_median": round(statistics.median(r["decode_tok_s"] for r in results), 2),
            "ttft_median_s": round(statistics.median(r["ttft_s"] for r in results), 3),
        }
        if stream and results
        else {}
    )
    return {
        "clients": clients,
        "requests": len(results),
        "errors": errors,
        "completion_tokens": total,
        "wall_s": round(wall, 3),
        "aggregate_tok_s": round(total / wall, 2),
        "latency_median_s": round(statistics.median(lat), 3) if lat else None,
        "latency_max_s": round(max(lat), 3) if lat else None,
        "latencies_s": [round(x, 3) for x in lat],
        "started_at": [round(r["at"], 3) for r in results],  # wall clock (time.time), to match sampled stacks
        **streamed,
    }


def _steps(url: str) -> tuple[float, float, float]:
    """Our server's step counters: (steps, their milliseconds, rows) so far (/stats)."""
    st = httpx.get(url + "/stats", timeout=30).json()
    ms = st["stages"][0]["step_ms"] if st.get("stages") else {"count": 0, "total": 0.0}
    rows = (st.get("slots") or {}).get("rows_per_step") or {"total": 0.0}
    return float(ms["count"]), float(ms["total"]), float(rows["total"])


def _round_steps(before: tuple[float, float, float], after: tuple[float, float, float], wall: float) -> dict:
    """What the server's steps took of a round: their count, mean time and rows, and their share of the wall
    time (the rest went to the server's own work between steps, HTTP and the clients)."""
    n, ms, rows = (b - a for a, b in zip(before, after, strict=True))
    return {
        "steps": int(n),
        "step_ms_mean": round(ms / n, 3) if n else None,
        "rows_per_step": round(rows / n, 2) if n else None,
        "steps_share_of_wall": round(ms / 1e3 / wall, 3) if wall else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path)
    ap.add_argument("--url", help="measure this running server instead of starting ours")
    ap.add_argument("--serve-args", default="", help="flags for strata-engine serve (one string)")
    ap.add_argument("--clients", default="1,2,4,8")
    ap.add_argument("--requests", type=int, default=2, help="requests per client, one after another")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--server-log", type=Path, help="our server's log, whole")
    ap.add_argument(
        "--stream", action="store_true", help="stream: time to first token and decode per request"
    )
    ap.add_argument(
        "--stacks", type=Path, help="sample our server's stacks into this file (bench/stack_sample.py)"
    )
    a = ap.parse_args()
    proc = None
    url = a.url
    if url is None:
        model = a.model or default_model_path()
        proc, url = start_server(model, shlex.split(a.serve_args), a.server_log, a.stacks)
    try:
        with httpx.Client(base_url=url, timeout=600) as c:
            ask(c, "A warm-up request.", 8)
            stats = c.get("/stats").json() if a.url is None else None
        rounds = []
        for n, clients in enumerate(int(x) for x in a.clients.split(",")):
            before = _steps(url) if a.url is None else None
            r = round_of(url, clients, a.requests, a.tokens, offset=100 * n, stream=a.stream)
            if before is not None:
                r["server_steps"] = _round_steps(before, _steps(url), r["wall_s"])
            rounds.append(r)
            print(json.dumps(r), flush=True)
        after = httpx.get(url + "/stats", timeout=30).json() if a.url is None else None
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    one = next((r["aggregate_tok_s"] for r in rounds if r["clients"] == 1), None)
    out = {
        "what": "bench/serve_clients.py: C clients at once through HTTP, each sending requests one after another",
        "server": url if a.url else f"strata-engine serve {a.serve_args}".strip(),
        "model": (a.model or default_model_path()).name if not a.url else "(the server's)",
        "slots": (stats or {}).get("slots", {}) and stats["slots"]["total"],  # type: ignore[index]
        "tokens": a.tokens,
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform()},
        # the routing our server replayed in place of the router's (engine/experts/replay.py), if any
        "route_trace": Path(os.environ["STRATA_ROUTE_TRACE"]).name
        if not a.url and os.environ.get("STRATA_ROUTE_TRACE")
        else None,
        "rounds": rounds,
        "stats_after": after,
        "over_one_client": {str(r["clients"]): round(r["aggregate_tok_s"] / one, 3) for r in rounds}
        if one
        else None,
    }
    if a.out:
        a.out.write_text(json.dumps(out, indent=1))
    print(json.dumps(out["over_one_client"]))


if __name__ == "__main__":
    main()
