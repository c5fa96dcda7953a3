"""bench/switch_ab.py: fresh processes alternating a switch's values, each run's figures and the means."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_alternates_the_switch_and_compares_the_means(tmp_path: Path) -> None:
    script = tmp_path / "fake_bench.py"
    script.write_text(
        "import json, os, sys\n"
        "out = sys.argv[sys.argv.index('--out') + 1]\n"
        "v = int(os.environ['STRATA_AB_TEST'])\n"
        "json.dump({'decode_tok_s': 100.0 + 10 * v, 'deep': {'x': v}}, open(out, 'w'))\n"
    )
    out = tmp_path / "ab.json"
    p = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "switch_ab.py"), "--switch", "STRATA_AB_TEST", "--values", "0,1",
         "--rounds", "2", "--keys", "decode_tok_s,deep.x,missing", "--out", str(out), "--", str(script)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    res = json.loads(out.read_text())
    assert [r["value"] for r in res["runs"]] == ["0", "1", "0", "1"]
    s = res["summary"]
    assert s["decode_tok_s"]["mean"] == {"0": 100.0, "1": 110.0}
    assert s["decode_tok_s"]["over_first"]["1"] == 1.1
    assert s["deep.x"]["mean"] == {"0": 0.0, "1": 1.0}
    assert s["missing"]["mean"] == {"0": None, "1": None}


def test_a_failing_run_is_recorded_not_hidden(tmp_path: Path) -> None:
    script = tmp_path / "broken.py"
    script.write_text("import sys\nsys.exit('no model given')\n")
    p = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "switch_ab.py"), "--switch", "X", "--rounds", "1", "--keys", "a",
         "--", str(script)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert p.returncode == 0
    res = json.loads(p.stdout)
    assert all(r["rc"] != 0 and "no model given" in r["stderr_tail"] for r in res["runs"])
