"""What a remote stage adds to a batched decode step, on the CPU: a tiny qwen3moe (little compute, so the step is
mostly the host's work) decoded by R slots in one process, then with its later half in a worker process on
loopback (1 group: the processes take turns). Reports each setting's step time, the main's round trip to the
worker and the worker's own time from receipt to reply (its `STRATA_REMOTE_TIMING` lines), and a ZeroMQ echo's
round trip with and without CURVE (the link's encryption) for a step's hidden state and a prompt chunk's.

    python bench/remote_overhead.py [--layers 4 --width 64 --rows 8 --tokens 64] [--out F.json]
"""

import argparse
import os
import re
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import engine.link.remote as remote
from bench.remote_groups import run
from bench.report import emit
from engine.link.startup import load_split_model
from engine.pipeline.generate import GenerationRequest
from engine.pipeline.loader import load_model
from engine.pipeline.sampling import GREEDY
from engine.pipeline.split import SplitOptions
from engine.testing.tiny_models import write_tiny_model
from tests.engine.link.harness import TOKEN, start_worker

_TIMING = re.compile(
    r": (\d+) token\(s\) at .*compute ([0-9.]+) ms, queued ([0-9.]+) ms, .* total ([0-9.]+) ms"
)


def echo_rtt(curve: bool, size: int, n: int) -> float:
    """Median round trip (ms) of `size` bytes through a DEALER -> ROUTER echo on loopback."""
    ctx = zmq.Context.instance()
    srv, cli = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    if curve:
        spub, ssec = zmq.curve_keypair()
        cpub, csec = zmq.curve_keypair()
        srv.curve_server, srv.curve_secretkey, srv.curve_publickey = True, ssec, spub
        cli.curve_serverkey, cli.curve_publickey, cli.curve_secretkey = spub, cpub, csec
    port = srv.bind_to_random_port("tcp://127.0.0.1")
    cli.connect(f"tcp://127.0.0.1:{port}")

    def echo() -> None:
        for _ in range(n + 1):
            srv.send_multipart(srv.recv_multipart(copy=False), copy=False)

    th = threading.Thread(target=echo)
    th.start()
    buf, times = b"x" * size, []
    cli.send(buf)
    cli.recv()
    for _ in range(n):
        t = time.perf_counter()
        cli.send(buf, copy=False)
        cli.recv(copy=False)
        times.append(time.perf_counter() - t)
    th.join()
    srv.close(0)
    cli.close(0)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--rows", type=int, default=8, help="slots decoding together")
    ap.add_argument("--tokens", type=int, default=64, help="tokens each")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out")
    a = ap.parse_args()
    torch.set_num_threads(1)
    os.environ["STRATA_STAGE_TOKEN"] = TOKEN
    os.environ["STRATA_ACTIVATIONS"] = "float"
    rtts: list[float] = []
    note = remote.RemoteStage._note

    def noting(self: remote.RemoteStage, t: object, rtt: float) -> None:
        rtts.append(rtt)
        note(self, t, rtt)

    remote.RemoteStage._note = noting  # type: ignore[method-assign]
    path = write_tiny_model(Path(tempfile.mkdtemp()) / "b.gguf", "qwen3moe", qtype="Q8_0", seed=1,
                            n_layer=a.layers, n_embd=a.width, n_ff_exp=a.width, n_head=2, head_dim=32)  # fmt: skip
    g = torch.Generator().manual_seed(3)
    reqs = [GenerationRequest(torch.randint(5, 400, (16,), generator=g).tolist(), max_tokens=a.tokens,
                              sampling=GREEDY, ignore_eos=True) for _ in range(a.rows)]  # fmt: skip
    res: dict = {"what": __doc__.split("\n\n")[0].replace("\n", " "), "layers": a.layers, "width": a.width,
                 "rows": a.rows, "tokens": a.tokens, "cpu_count": os.cpu_count()}  # fmt: skip

    def step_ms(lm: object) -> list[float]:
        run(lm, 1, reqs[:2], a.rows)  # warm-up
        out = []
        for _ in range(a.rounds):
            tok_s, _, steps = run(lm, 1, reqs, a.rows)
            out.append(round(1e3 * a.rows * a.tokens / tok_s / steps, 3))
        return out

    res["one_stage_step_ms"] = step_ms(load_model(path, torch.device("cpu"), "f32", 512))
    worker = start_worker(path, a.layers // 2, extra=["--max-context", "512", "--parallel", str(a.rows),
                          "--threads", "1"], env={"STRATA_REMOTE_TIMING": "1"})  # fmt: skip
    try:
        opts = SplitOptions(device="cpu", layer_split=(a.layers // 2,), remote=f"127.0.0.1:{worker.port}")
        lm = load_split_model(path, opts, 512, "f32", "f32", parallel=a.rows)
        res["remote_step_ms"] = step_ms(lm)
        lm.model.close()  # type: ignore[attr-defined]
    finally:
        worker.stop()
    rows = [m.groups() for m in map(_TIMING.search, worker.log) if m and int(m.group(1)) == a.rows]
    last = rows[-a.rounds * a.tokens :]
    res["main_rtt_ms_median"] = round(statistics.median(rtts[-len(last) :]), 3)
    res["worker_ms_median"] = {k: statistics.median(float(r[i]) for r in last) for i, k in
                               ((1, "compute"), (2, "queued"), (3, "receipt_to_reply"))}  # fmt: skip
    res["hidden_bytes_a_step"] = a.rows * a.width * 4
    res["echo_rtt_ms"] = {
        f"{size}_bytes": {
            "plain": round(echo_rtt(False, size, n), 3),
            "curve": round(echo_rtt(True, size, n), 3),
        }
        for size, n in ((8 * 2048 * 2, 300), (8 * 2048 * 4, 300), (512 * 2048 * 4, 30))
    }
    emit(res, a.out)


if __name__ == "__main__":
    main()
