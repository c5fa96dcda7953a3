"""--parallel N: requests decoded together in shared steps, as a client sees it through HTTP (the slots, the rows of
each step, the answers), and the flag's checks."""

import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.engine.serve.harness import start_server

PROMPTS = ["amber birch cedar", "delta ember", "fjord grove harbor island", "jade"]


def test_requests_share_steps_and_each_gets_its_answer_alone(tiny_model: Path) -> None:
    srv = start_server(
        tiny_model, "--device", "cpu", "--threads", "1", "--parallel", "3", "--prompt-cache-mib", "0"
    )
    try:
        assert any("3 slots" in line for line in srv.log), srv.log
        body = {"max_tokens": 24, "temperature": 0, "ignore_eos": True}
        with srv.client() as c:
            alone = {p: c.post("/v1/completions", json={**body, "prompt": p}).json() for p in PROMPTS}
            st = c.get("/stats").json()["slots"]
            assert st["total"] == 3 and st["busy"] == 0 and len(st["slots"]) == 3
        got: dict[str, dict] = {}
        seen_busy: list[int] = []

        def ask(p: str) -> None:
            with srv.client() as c:
                got[p] = c.post("/v1/completions", json={**body, "prompt": p}).json()

        threads = [threading.Thread(target=ask, args=(p,)) for p in PROMPTS]
        for t in threads:
            t.start()
        with srv.client() as c:
            while any(t.is_alive() for t in threads):
                seen_busy.append(c.get("/stats").json()["slots"]["busy"])
                time.sleep(0.01)
        for t in threads:
            t.join()
        for p in PROMPTS:
            assert got[p]["choices"][0]["text"] == alone[p]["choices"][0]["text"], p
            for k in ("prompt_tokens", "completion_tokens"):  # cached_tokens: what the slot it got held
                assert got[p]["usage"][k] == alone[p]["usage"][k]
        assert max(seen_busy) == 3  # three at once; the fourth waited for a slot
        with srv.client() as c:
            stats = c.get("/stats").json()
            metrics = c.get("/metrics").text
            health = c.get("/health").json()
        rows = stats["slots"]["rows_per_step"]
        assert rows["max"] >= 3 and stats["slots"]["busy"] == 0
        assert "strata_slots 3" in metrics and "strata_slots_busy 0" in metrics
        assert "strata_step_rows_count" in metrics
        assert health["queue"] == {"waiting": 0, "active": 0}
    finally:
        srv.stop()


def test_one_slot_serves_one_request_at_a_time(tiny_model: Path) -> None:
    srv = start_server(tiny_model, "--device", "cpu", "--threads", "1", "--parallel", "1")
    try:
        with srv.client() as c:
            r = c.post("/v1/completions", json={"prompt": "jade", "max_tokens": 3, "temperature": 0})
            assert r.status_code == 200
            assert c.get("/stats").json()["slots"] is None
    finally:
        srv.stop()


def test_a_bad_parallel_is_refused_at_start(tiny_model: Path) -> None:
    for bad in ("0", "65"):
        r = subprocess.run(
            [sys.executable, "-m", "engine.cli", "serve", "--model", str(tiny_model), "--parallel", bad],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode != 0
        assert f"--parallel must be 1..64 slots (or left out: auto), not {bad}" in r.stderr
