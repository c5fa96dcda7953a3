"""bench/stack_sample.py: a script run under the sampler, and the report naming where its thread spent the time."""

import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_report_names_the_function_a_thread_was_busy_in(tmp_path: Path) -> None:
    script = tmp_path / "work.py"
    script.write_text(
        "import threading, time\n"
        "def spin_here(s):\n"
        "    t = time.perf_counter()\n"
        "    while time.perf_counter() - t < s:\n"
        "        pass\n"
        "th = threading.Thread(target=spin_here, args=(0.6,), name='worker')\n"
        "th.start(); th.join()\n"
    )
    out = tmp_path / "stacks.json"
    t0 = time.time()
    subprocess.run([sys.executable, str(REPO / "bench" / "stack_sample.py"), "--out", str(out), "--every-ms", "5",
                    "--", str(script)], check=True, timeout=60)  # fmt: skip
    data = json.loads(out.read_text())
    assert data["samples"] and all(t >= t0 - 1 for t, _, _ in data["samples"])
    report = subprocess.run([sys.executable, str(REPO / "bench" / "stack_sample.py"), "--report", str(out),
                             "--thread", "worker", "--top", "3"], check=True, capture_output=True, text=True,
                            timeout=60).stdout  # fmt: skip
    head, first = report.splitlines()[:2]
    assert head.startswith("== worker:")
    assert "work.py:spin_here" in first  # the busiest stack is the spinning function
    busy_ms = float(first.split()[0])
    assert busy_ms >= 300  # most of its 0.6 s


def test_by_names_sorts_a_threads_time_by_the_first_named_function_in_each_stack(tmp_path: Path) -> None:
    """--by: the innermost named function of each stack takes the sample (a nested one before its caller); a stack
    with none of them is `other`; --rounds cuts the time into bench/serve_clients.py's rounds."""
    script = tmp_path / "work.py"
    script.write_text(
        "import threading, time\n"
        "def spin(s):\n"
        "    t = time.perf_counter()\n"
        "    while time.perf_counter() - t < s:\n"
        "        pass\n"
        "def inner():\n"
        "    spin(0.4)\n"
        "def outer():\n"
        "    spin(0.3)\n"
        "    inner()\n"
        "def work():\n"
        "    outer()\n"
        "    spin(0.3)\n"
        "th = threading.Thread(target=work, name='worker')\n"
        "th.start(); th.join()\n"
    )
    out = tmp_path / "stacks.json"
    subprocess.run([sys.executable, str(REPO / "bench" / "stack_sample.py"), "--out", str(out), "--every-ms", "5",
                    "--", str(script)], check=True, timeout=60)  # fmt: skip
    t0 = min(t for t, _, _ in json.loads(out.read_text())["samples"])
    rounds = tmp_path / "serve.json"
    rounds.write_text(json.dumps({"rounds": [{"clients": 1, "aggregate_tok_s": 1.0, "started_at": [t0 - 1],
                                              "wall_s": 100.0}]}))  # fmt: skip
    report = subprocess.run([sys.executable, str(REPO / "bench" / "stack_sample.py"), "--report", str(out),
                             "--thread", "worker", "--by", "outer,inner", "--rounds", str(rounds)], check=True,
                            capture_output=True, text=True, timeout=60).stdout  # fmt: skip
    lines = report.splitlines()
    assert lines[0].startswith("== worker, 1 clients, 1.0 tok/s:")
    ms = {ln.split()[-1]: float(ln.split()[0]) for ln in lines[1:]}
    assert set(ms) == {"inner", "outer", "other"}
    assert 250 <= ms["inner"] <= 600  # its 0.4 s, though outer() called it
    assert 150 <= ms["outer"] <= 450  # outer's own 0.3 s
    assert 150 <= ms["other"] <= 450  # work()'s last 0.3 s
