"""--parallel N: requests decoded together in shared steps, as a client sees it through HTTP (the slots, the rows of
each step, the answers), and the flag's checks."""

import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

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
    """--parallel 1 is one slot of the scheduler (its steps overlap the host's work on a card): requests sent
    together are answered one after the other, each as it is alone."""
    srv = start_server(tiny_model, "--device", "cpu", "--threads", "1", "--parallel", "1")
    try:
        with srv.client() as c:
            body = {"prompt": "jade", "max_tokens": 6, "temperature": 0}
            alone = c.post("/v1/completions", json=body).json()["choices"][0]["text"]

            def ask(_: int) -> httpx.Response:
                with srv.client() as own:
                    return own.post("/v1/completions", json=body)

            with ThreadPoolExecutor(3) as pool:
                answers = list(pool.map(ask, range(3)))
            assert [r.status_code for r in answers] == [200] * 3
            assert [r.json()["choices"][0]["text"] for r in answers] == [alone] * 3
            slots = c.get("/stats").json()["slots"]
            assert slots["total"] == 1 and slots["busy"] == 0
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
