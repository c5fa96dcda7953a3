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
