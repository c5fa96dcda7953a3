"""Stage workers for the link tests: the real one (`strata-engine worker`, a subprocess) and a torch-free echo
worker (the same `StageServer`, whose compute returns its input) that starts in a fraction of a second, for the
tests that kill, freeze and restart a worker many times."""

import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from engine.link.protocol import StageInfo
from engine.testing.spawned import Spawned

TOKEN = "link-test-token-0123456789"
ROOT = Path(__file__).resolve().parents[3]
ECHO_INFO = StageInfo(
    arch="echo", n_layer=8, n_embd=16, n_head_kv=1, head_dim=16, n_vocab=32, n_expert=0, begin=4, end=8,
    header="h" * 64, data="", kv="f32", max_ctx=4096, max_tokens=64,
)  # fmt: skip


class WorkerProc(Spawned):
    """A worker program the tests can also kill, freeze and thaw."""

    def kill(self) -> None:
        if self.alive():
            self.proc.kill()
        self.proc.wait(timeout=10)

    def freeze(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        self.proc.send_signal(signal.SIGCONT)


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    # this tree first, then what the parent's path had (wheels carried beside the interpreter's own)
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, STRATA_STAGE_TOKEN=TOKEN, OMP_NUM_THREADS="1", PYTHONPATH=path)
    env.update(extra or {})
    return env


def _start(cmd: list[str], env: dict[str, str], pattern: str, timeout: float = 90.0) -> WorkerProc:
    w = WorkerProc(cmd, env, pattern, ROOT)
    w.wait_port(timeout)
    return w


def start_worker(
    model: Path, begin: int, end: int | None = None, nxt: int | None = None, port: int = 0,
    extra: list[str] | None = None, env: dict[str, str] | None = None,
) -> WorkerProc:  # fmt: skip
    cmd = [sys.executable, "-m", "engine.cli", "worker", "-m", str(model), "--device", "cpu", "--dtype", "f32",
           "--stage-worker", str(port), "--stage-begin", str(begin), "--stage-bind", "127.0.0.1", "--max-context", "256"]  # fmt: skip
    if end is not None:
        cmd += ["--stage-end", str(end)]
    if nxt is not None:
        cmd += ["--stage-next", f"127.0.0.1:{nxt}"]
    return _start(cmd + (extra or []), _env(env), r"listening on 127\.0\.0\.1:(\d+)")


def start_echo(port: int = 0, env: dict[str, str] | None = None, bind: str = "127.0.0.1") -> WorkerProc:
    cmd = [sys.executable, "-m", "tests.engine.link.echo_worker", bind, str(port)]
    return _start(cmd, _env(env), r"echo worker on \S+:(\d+)", timeout=30.0)


@contextmanager
def three_workers(
    model: Path, relay_extra: list[str] | None = None, extra: list[str] | None = None
) -> Iterator[dict[str, WorkerProc]]:
    """A 6-layer model's workers on loopback: "last3" (layers 3-5), and "relay2" (2-3) relaying to "last4" (4-5)."""
    started: dict[str, WorkerProc] = {}
    try:
        started["last3"] = start_worker(model, 3, extra=extra)
        started["last4"] = start_worker(model, 4, extra=extra)
        started["relay2"] = start_worker(
            model, 2, end=4, nxt=started["last4"].port, extra=relay_extra or extra
        )
        yield started
    finally:
        for w in started.values():
            w.stop()
