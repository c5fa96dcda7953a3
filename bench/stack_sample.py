"""Where a process's threads spend their time, sampled: run a module under a sampling thread, or report a run.

    python bench/stack_sample.py --out F.json [--every-ms 5] -- -m engine.cli serve --model M ...
    python bench/stack_sample.py --report F.json [--since T0] [--until T1] [--thread strata-generate] [--top 15]
    python bench/stack_sample.py --report F.json --thread strata-generate --by synchronize,run_batch,_capture \
        [--rounds serve.json]

The sampler reads every thread's Python stack (sys._current_frames) every few milliseconds and writes, at exit,
each sample's wall time (time.time), thread name and stack (as an index into a table of stacks). The report counts
the stacks of one thread within a window of wall time (a slow request's start and end, as a client saw them), so
a stall names the code it sat in. Python frames only: time inside a C call counts as the frame that made it.

`--by` sorts the thread's time instead by the first of the named functions (or file names, `name.py`) found in each
stack, innermost frame first, the rest as `other`; with `--rounds` (bench/serve_clients.py's JSON) once per round of
clients, over the wall time that round's requests took (how a layer split's server spent its thread against one
stage's, prompts apart from steps)."""

import argparse
import atexit
import collections
import json
import runpy
import signal
import sys
import threading
import time
from pathlib import Path

IDLE = ("wait", "select", "poll", "_wait_for_tstate_lock", "accept", "get", "_worker", "sleep", "run_forever")


def _frames(frame: object, depth: int = 14) -> tuple[str, ...]:
    out = []
    while frame is not None and len(out) < depth:
        code = frame.f_code  # type: ignore[attr-defined]
        out.append(f"{Path(code.co_filename).name}:{code.co_name}:{frame.f_lineno}")  # type: ignore[attr-defined]
        frame = frame.f_back  # type: ignore[attr-defined]
    return tuple(out)


def sample(out: Path, every_s: float, argv: list[str]) -> None:
    stacks: dict[tuple[str, ...], int] = {}
    samples: list[tuple[float, str, int]] = []
    me = threading.get_ident()

    def loop() -> None:
        while True:
            time.sleep(every_s)
            names = {t.ident: t.name for t in threading.enumerate()}
            now = time.time()
            for ident, frame in sys._current_frames().items():
                if ident == me or ident == threading.get_ident():
                    continue
                st = _frames(frame)
                samples.append(
                    (round(now, 4), names.get(ident, str(ident)), stacks.setdefault(st, len(stacks)))
                )

    def dump() -> None:
        table = [list(s) for s, _ in sorted(stacks.items(), key=lambda kv: kv[1])]
        out.write_text(json.dumps({"every_s": every_s, "stacks": table, "samples": samples}))

    atexit.register(dump)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    threading.Thread(target=loop, name="stack-sampler", daemon=True).start()
    if argv[:1] == ["-m"]:
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        runpy.run_path(argv[0], run_name="__main__")


def _weights(samples: list[list], every: float) -> dict[float, float]:
    """Sample time -> the seconds it stands for: each round of samples the time since the round before (the sampler
    waits for the GIL, so its rounds come later than asked under a busy thread), at most ten intervals."""
    times = sorted({t for t, _, _ in samples})
    return {t: min(t - p, 10 * every) if p else every for p, t in zip([0.0, *times], times, strict=False)}


def report(path: Path, since: float, until: float, thread: str | None, top: int) -> None:
    data = json.loads(path.read_text())
    stacks = data["stacks"]
    weight = _weights(data["samples"], data["every_s"])
    per: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for t, name, sid in data["samples"]:
        if since <= t <= until and (thread is None or name == thread):
            per[name][sid] += weight[t]
    for name, secs in sorted(per.items(), key=lambda kv: -sum(kv[1].values())):
        busy = {s: w for s, w in secs.items() if stacks[s] and stacks[s][0].split(":")[1] not in IDLE}
        print(f"== {name}: {sum(secs.values()):.2f} s sampled, {sum(busy.values()):.2f} s busy")
        for sid, w in sorted(busy.items(), key=lambda kv: -kv[1])[:top]:
            print(f"  {w * 1e3:8.0f} ms  " + " < ".join(stacks[sid][:8]))


def by_names(path: Path, names: list[str], thread: str, windows: list[tuple[str, float, float]]) -> None:
    """The thread's time in each window, by the first of `names` in each stack (innermost frame first)."""
    data = json.loads(path.read_text())
    stacks = data["stacks"]
    weight = _weights(data["samples"], data["every_s"])

    def key(sid: int) -> str:
        for frame in stacks[sid]:
            file, func = frame.split(":")[:2]
            for n in names:
                if n in (func, file):
                    return n
        return "other"

    for label, since, until in windows:
        got: collections.Counter = collections.Counter()
        for t, name, sid in data["samples"]:
            if name == thread and since <= t <= until:
                got[key(sid)] += weight[t]
        total = sum(got.values())
        print(f"== {thread}, {label}: {total:.2f} s sampled")
        for n, w in got.most_common():
            print(f"  {w * 1e3:8.0f} ms  {w / max(total, 1e-9):6.1%}  {n}")


def _rounds(path: Path) -> list[tuple[str, float, float]]:
    """bench/serve_clients.py's rounds as windows of wall time: from the round's first request to its wall's end."""
    out = []
    for r in json.loads(path.read_text())["rounds"]:
        t0 = min(r["started_at"])
        out.append((f"{r['clients']} clients, {r['aggregate_tok_s']:.1f} tok/s", t0, t0 + r["wall_s"]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--every-ms", type=float, default=5.0)
    ap.add_argument("--report", type=Path)
    ap.add_argument("--since", type=float, default=0.0)
    ap.add_argument("--until", type=float, default=float("inf"))
    ap.add_argument("--thread")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument(
        "--by", help="comma-separated function or file names: the thread's time by the first in a stack"
    )
    ap.add_argument(
        "--rounds", type=Path, help="with --by: bench/serve_clients.py's JSON, a window per round"
    )
    a, rest = ap.parse_known_args()
    if a.report is not None and a.by:
        if not a.thread:
            ap.error("--by needs --thread")
        windows = _rounds(a.rounds) if a.rounds else [("all", a.since, a.until)]
        by_names(a.report, [n for n in a.by.split(",") if n], a.thread, windows)
        return
    if a.report is not None:
        report(a.report, a.since, a.until, a.thread, a.top)
        return
    if a.out is None or not rest:
        ap.error("give --out F.json -- <-m module | script> [args], or --report F.json")
    sample(a.out, a.every_ms / 1e3, rest[1:] if rest[0] == "--" else rest)


if __name__ == "__main__":
    main()
