"""An A/B of one environment switch (STRATA_PDL, STRATA_STEP_OVERLAP, ...) on a bench script that writes JSON:
the script runs in fresh processes, alternating the switch's values for several rounds, and one JSON holds every
run's figures and the mean of each value.

    python bench/switch_ab.py --switch STRATA_PDL --values 0,1 --rounds 2 --keys decode_tok_s [--out F.json] \\
        -- bench/engine_bench.py --model M.gguf --prompts 64 --decode 128

Alternating (0, 1, 0, 1, ...) rather than all of one value first keeps a drift of the machine (clocks, other
work) from reading as the switch's effect. `--keys`: the result's numbers to compare (dotted paths into the JSON
the script writes with --out)."""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.report import emit


def pick(res: dict, key: str) -> float | None:
    """A dotted path into a result (`decode_depth_32768_int8.decode_tok_s`); None where it is missing."""
    cur: object = res
    for part in key.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return None
        cur = cur[part]
    return float(cur) if isinstance(cur, int | float) else None


def summarize(runs: list[dict], values: list[str], keys: list[str]) -> dict:
    """Mean of each key for each value, and each value's mean over the first value's."""
    out: dict = {}
    for key in keys:
        means = {}
        for v in values:
            got = [r["figures"][key] for r in runs if r["value"] == v and r["figures"].get(key) is not None]
            means[v] = round(sum(got) / len(got), 3) if got else None
        first = means[values[0]]
        out[key] = {
            "mean": means,
            "over_first": {v: round(m / first, 4) for v, m in means.items() if m is not None and first},
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--switch", required=True, help="the environment variable, e.g. STRATA_PDL")
    ap.add_argument("--values", default="0,1")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--keys", required=True, help="comma-separated dotted paths into the script's JSON")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds a run may take")
    ap.add_argument("--out")
    ap.add_argument("script", nargs=argparse.REMAINDER, help="-- then the bench script and its arguments")
    a = ap.parse_args()
    script = a.script[1:] if a.script[:1] == ["--"] else a.script
    if not script:
        ap.error("give the bench script after --, e.g. -- bench/engine_bench.py --model M.gguf")
    if "--out" in script:
        ap.error("leave --out off the script's arguments: each run writes its own file")
    values = [v for v in a.values.split(",") if v != ""]
    keys = [k for k in a.keys.split(",") if k]
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(a.rounds):
            for v in values:
                out = Path(tmp) / f"run-{rnd}-{v}.json"
                env = dict(os.environ, **{a.switch: v})
                t0 = time.monotonic()
                p = subprocess.run(
                    [sys.executable, *script, "--out", str(out)],
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=a.timeout,
                )
                run = {
                    "round": rnd + 1,
                    "value": v,
                    "rc": p.returncode,
                    "wall_s": round(time.monotonic() - t0, 1),
                }
                if p.returncode == 0 and out.exists():
                    res = json.loads(out.read_text())
                    run["figures"] = {k: pick(res, k) for k in keys}
                else:
                    run["figures"] = {}
                    run["stderr_tail"] = p.stderr[-2000:]
                runs.append(run)
                print(json.dumps(run), file=sys.stderr, flush=True)
    emit(
        {
            "switch": a.switch,
            "values": values,
            "command": " ".join(script),
            "runs": runs,
            "summary": summarize(runs, values, keys),
        },
        a.out,
    )


if __name__ == "__main__":
    main()
