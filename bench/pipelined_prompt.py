"""A long prompt read through two PCs: a remote stage pipelining the prompt's pieces, against one PC alone.

    python bench/pipelined_prompt.py [--model F] [--prompt 4096] [--split K] [--out bench/results/F.json]

Two PCs are emulated on one machine as two processes pinned to a core each (the main on core 0, the worker on
core 1), joined by the stage link on loopback; "one PC" is the same server alone on core 0. A third arm, the server
alone on both cores, says what the second core gives without a second process. Each arm answers the same prompt
(numbered lines of about `--prompt` tokens, nothing cached) with one token, `--rounds` times; the figure is the
server's own prompt rate (`timings.prompt_per_second`) and the client's time to the answer. The worker runs layers
K.. (`--split`, default half) and the main the rest; a chunk alone in its step crosses in pieces, up to two in flight
(docs/remote-stage.md), so the two processes read at once.
Linux (core pinning); without the embedded model, --model."""

import argparse
import json
import os
import platform
import secrets
import shlex
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.report import emit
from bench.serve_clients import start_server
from bench.serve_prefix import prefix_text
from engine.gguf.reader import GGUFFile
from engine.testing.spawned import Spawned
from installer.default_model import default_model_path

ROOT = Path(__file__).resolve().parent.parent
TOKEN = secrets.token_hex(16)  # the stage link's shared token between the two emulated PCs


@contextmanager
def started_on(cores: set[int], env: dict[str, str]) -> Iterator[None]:
    """Programs started inside run on `cores` with `env` added (they inherit both); the bench returns to its own."""
    before, old = os.sched_getaffinity(0), dict(os.environ)
    os.sched_setaffinity(0, cores)
    os.environ.update(env)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
        os.environ.clear()
        os.environ.update(old)


def measure(url: str, prompt: str, rounds: int) -> dict[str, Any]:
    out: dict[str, list[float]] = {"prompt_tok_s": [], "answer_s": []}
    n = 0
    with httpx.Client(base_url=url, timeout=1800) as c:
        for _ in range(rounds):
            body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, "cache_prompt": False}
            t0 = time.perf_counter()
            r = c.post("/v1/completions", json=body)
            if r.status_code != 200:
                raise SystemExit(f"the server answered {r.status_code}: {r.text[:500]}")
            j = r.json()
            out["answer_s"].append(round(time.perf_counter() - t0, 3))
            out["prompt_tok_s"].append(round(j["timings"]["prompt_per_second"], 2))
            n = j["usage"]["prompt_tokens"]
    best = max(out["prompt_tok_s"])
    return {"prompt_tokens": n, **out, "prompt_tok_s_best": best}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path)
    ap.add_argument("--prompt", type=int, default=4096, help="about this many prompt tokens")
    ap.add_argument("--split", type=int, help="the worker's first layer (default: half of the layers)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument(
        "--two-pc-args", default="", help="more flags for the main of the two PCs (e.g. --prefill N)"
    )
    ap.add_argument("--arms", default="one_pc_one_core,two_pcs_one_core_each,one_pc_two_cores")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("two cores are needed: one for each emulated PC")
    model = a.model or default_model_path()
    gf = GGUFFile.open(model)
    n_layer = int(gf.metadata[f"{gf.architecture}.block_count"])
    k = a.split or n_layer // 2
    ctx = str(2 * a.prompt + 512)  # the text's tokens are counted only roughly
    prompt = prefix_text(a.prompt, "pipelined")
    common = ["--device", "cpu", "--max-context", ctx, "--parallel", "1"]
    arms: dict[str, Any] = {}

    def serve(name: str, cores: set[int], args: list[str]) -> None:
        with started_on(cores, {"STRATA_STAGE_TOKEN": TOKEN}):
            proc, url = start_server(model, [*common, *args])
        try:
            arms[name] = measure(url, prompt, a.rounds)
            print(name, json.dumps(arms[name]), flush=True)
        finally:
            proc.terminate()
            proc.wait(30)

    want = a.arms.split(",")
    if "one_pc_one_core" in want:
        serve("one_pc_one_core", {0}, ["--threads", "1"])
    if "two_pcs_one_core_each" in want:
        cmd = [sys.executable, "-m", "engine.cli", "worker", "-m", str(model), "--device", "cpu", "--threads", "1",
               "--stage-worker", "0", "--stage-begin", str(k), "--stage-bind", "127.0.0.1", "--max-context", ctx]  # fmt: skip
        with started_on({1}, {"STRATA_STAGE_TOKEN": TOKEN}):
            worker = Spawned(cmd, dict(os.environ), r"listening on 127\.0\.0\.1:(\d+)", ROOT)
        try:
            worker.wait_port(300)
            remote = [
                "--layer-split",
                str(k),
                "--remote-stage",
                f"127.0.0.1:{worker.port}",
                "--batch-groups",
                "1",
            ]
            serve("two_pcs_one_core_each", {0}, ["--threads", "1", *remote, *shlex.split(a.two_pc_args)])
        finally:
            worker.stop()
    if "one_pc_two_cores" in want:
        serve("one_pc_two_cores", {0, 1}, ["--threads", "2"])
    one = arms.get("one_pc_one_core", {}).get("prompt_tok_s_best")
    out = {
        "what": "bench/pipelined_prompt.py: a long prompt through a remote stage (two processes, a core each) "
        "against one process on one core and on both",
        "model": model.name,
        "layers": n_layer,
        "worker_layers": [k, n_layer],
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform()},
        "arms": arms,
        "two_pc_args": a.two_pc_args,
        "over_one_pc": {name: round(arm["prompt_tok_s_best"] / one, 3) for name, arm in arms.items()}
        if one
        else {},
    }
    emit(out, str(a.out) if a.out else None)


if __name__ == "__main__":
    main()
