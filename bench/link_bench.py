"""The stage link measured: a 2-stage split over the link (the worker in a network namespace behind a veth pair
limited to 1 Gbit/s with tbf, plus 0.2 ms each way where the kernel has netem) against the same 2-stage split in
one process, decode and prompt tok/s; and CURVE's throughput for one prompt chunk's hidden state on loopback.

    sudo python bench/link_bench.py [--layers 8 --width 512] [--out bench/results/link-netns-cpu.json]

CPU only (the point is the link, not the math): the model is a tiny qwen3moe written here. Without root it
measures the link on loopback instead of across namespaces."""

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.report import emit
from engine.link import protocol as P
from engine.link.client import StageClient
from engine.link.keys import client_keys, server_keys
from engine.link.server import StageServer
from engine.link.startup import load_split_model
from engine.link.transport import Endpoint
from engine.pipeline.split import SplitOptions
from engine.testing.tiny_models import write_tiny_model
from tests.engine.link.echo_worker import Echo
from tests.engine.link.harness import TOKEN, _env, _start, start_worker

ENV = {"STRATA_STAGE_TOKEN": TOKEN}


def decode_tok_s(model: object, n: int) -> float:
    cache = model.new_cache(n + 64, "f32")  # type: ignore[attr-defined]
    with torch.inference_mode():
        model.forward(torch.arange(1, 17), cache, 0)  # type: ignore[attr-defined]
        tok = torch.tensor([42])
        t = time.perf_counter()
        for p in range(16, 16 + n):
            tok = model.forward(tok, cache, p)[-1].argmax().view(1)  # type: ignore[attr-defined]
    return n / (time.perf_counter() - t)


def prompt_tok_s(model: object, n: int) -> float:
    ids = torch.randint(5, 400, (n,), generator=torch.Generator().manual_seed(n))
    cache = model.new_cache(n + 8, "f32")  # type: ignore[attr-defined]
    t = time.perf_counter()
    with torch.inference_mode():
        model.forward(ids, cache, 0)  # type: ignore[attr-defined]
    return n / (time.perf_counter() - t)


def curve_throughput(tokens: int, width: int, reps: int) -> dict[str, float]:
    info = P.StageInfo("echo", 8, width, 1, 64, 32, 0, 4, 8, "h" * 64, "", "f32", 8192, tokens)
    srv = StageServer(info, Echo(), server_keys(None, [], ENV), "127.0.0.1", 0).start()
    c = StageClient(
        Endpoint("127.0.0.1", srv.port), client_keys(None, None, ENV), tokens * width * 4, stall_s=60
    )
    try:
        c.connect(info)
        payload = os.urandom(tokens * width * 4)
        best = 1e9
        for _ in range(reps):
            t = time.perf_counter()
            c.wait(c.submit(payload, "f32", (tokens, width), 0))
            best = min(best, time.perf_counter() - t)
        mb = len(payload) / 1e6
        return {"chunk_mb": mb, "round_trip_s": best, "mb_per_s_each_way": mb / (best / 2)}
    finally:
        c.close()
        srv.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--piece", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out")
    a = ap.parse_args()
    torch.set_num_threads(1)
    os.environ.update(ENV)
    k = a.layers // 2
    tmp = Path(tempfile.mkdtemp())
    path = write_tiny_model(tmp / "bench.gguf", "qwen3moe", qtype="Q8_0", seed=1, n_layer=a.layers,
                            n_embd=a.width, n_ff_exp=a.width, n_head=8, head_dim=64)  # fmt: skip
    res: dict = {
        "host": platform.node(),
        "cpu_threads_per_process": 1,
        "layers": a.layers,
        "width": a.width,
        "k": k,
    }
    res["curve_prompt_chunk_4096x2048"] = curve_throughput(4096, 2048, 3)

    peer = None
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        from tests.engine.link.netns import Peer

        peer = Peer.create("b")
        res["netem_0.2ms"] = peer.shape("delay", "0.2ms")
        if not res["netem_0.2ms"]:
            res["rate_1gbit_tbf"] = peer.rate("1gbit")
        else:
            res["rate_1gbit_tbf"] = (
                False  # netem and tbf are both root qdiscs; with netem the rate rides on it
            )
            peer.shape("delay", "0.2ms", "rate", "1gbit")
    try:
        if peer is not None:
            cmd = [*peer.exec_prefix(), sys.executable, "-m", "engine.cli", "worker", "-m", str(path), "--device",
                   "cpu", "--dtype", "f32", "--stage-worker", "0", "--stage-begin", str(k), "--stage-bind",
                   peer.peer_addr, "--max-context", str(a.prompt + a.decode + 64)]  # fmt: skip
            w = _start(cmd, _env(), r"listening on [\d.]+:(\d+)")
            addr = f"{peer.peer_addr}:{w.port}"
            res["link"] = "veth between network namespaces"
        else:
            w = start_worker(path, k)
            addr = f"127.0.0.1:{w.port}"
            res["link"] = "loopback"
        local = load_split_model(
            path, SplitOptions(device="cpu", layer_split=(k,), pipeline=True, pipe_chunk=a.piece), a.prompt + 128,
            "f32", "f32",
        ).model  # fmt: skip
        remote = load_split_model(
            path, SplitOptions(device="cpu", layer_split=(k,), remote=addr, pipe_chunk=a.piece), a.prompt + 128,
            "f32", "f32",
        ).model  # fmt: skip
        arms: dict[str, dict[str, list[float]]] = {"in_process": {"decode": [], "prompt": []},
                                                   "remote": {"decode": [], "prompt": []}}  # fmt: skip
        for _ in range(a.rounds):
            for name, m in (("in_process", local), ("remote", remote)):
                arms[name]["decode"].append(decode_tok_s(m, a.decode))
                arms[name]["prompt"].append(prompt_tok_s(m, a.prompt))
        best = {n: {m: max(v) for m, v in d.items()} for n, d in arms.items()}
        res["tok_s"] = arms
        res["best_tok_s"] = best
        res["ratio_remote_over_in_process"] = {
            m: best["remote"][m] / best["in_process"][m] for m in ("decode", "prompt")
        }
        res["target"] = {"decode": 0.9}
        remote.close()  # type: ignore[attr-defined]
        w.stop()
    finally:
        if peer is not None:
            peer.close()
    emit(res, a.out)


if __name__ == "__main__":
    main()
