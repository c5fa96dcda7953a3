"""`strata-engine serve` on a layer split: three in-process stages (`--layer-split 2,4 --split-device cpu,cpu`) and
a remote stage (`--remote-stage` to a `strata-engine worker` subprocess on loopback) answer the official openai client
with the single-process server's greedy text; /stats and /events show each stage; a killed worker gives a 502 that
names it and /health says degraded, a restarted one serves again. Also the config keys that become split flags."""

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest

from engine.cli import main as engine_main
from engine.testing.tiny_models import write_tiny_model
from installer.engine_options import EngineOptions, resolve
from tests.engine.link.harness import TOKEN, WorkerProc, start_worker
from tests.engine.serve.harness import ServerProc, start_server

N_LAYER, K = 6, 3  # the remote worker runs layers 3-5
CONTEXT = "512"
MESSAGES = [{"role": "user", "content": "Split the layers, please."}]
PROMPTS = ["The layers of a model", "count to ten"]


@pytest.fixture(scope="module")
def model6(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Six layers: the last stage of an in-process split keeps two at least.
    return write_tiny_model(
        tmp_path_factory.mktemp("split-serve") / "tiny-moe6.gguf",
        "qwen3moe",
        qtype="Q8_0",
        seed=3,
        n_layer=N_LAYER,
    )


class Servers:
    def __init__(self, model: Path) -> None:
        self.model = model
        self.worker: WorkerProc = start_worker(model, K, extra=["--max-context", CONTEXT])
        common = ("--device", "cpu", "--threads", "1", "--max-context", CONTEXT)
        self.plain = start_server(model, *common, wait_ready=False)
        self.split = start_server(
            model, *common, "--layer-split", "2,4", "--split-device", "cpu,cpu", wait_ready=False
        )
        self.remote = start_server(
            model,
            *common,
            "--layer-split",
            str(K),
            "--remote-stage",
            f"127.0.0.1:{self.worker.port}",
            wait_ready=False,
            env={"STRATA_STAGE_TOKEN": TOKEN},
        )
        for s in (self.plain, self.split, self.remote):
            s.wait_status({"ready"})

    def stop(self) -> None:
        for s in (self.plain, self.split, self.remote):
            s.stop()
        self.worker.stop()


@pytest.fixture(scope="module")
def servers(model6: Path) -> Iterator[Servers]:
    s = Servers(model6)
    try:
        yield s
    finally:
        s.stop()


def _client(server: ServerProc) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=server.key, max_retries=0, timeout=60)


def _chat(server: ServerProc, max_tokens: int = 12) -> str:
    r = _client(server).chat.completions.create(
        model="tiny-moe6", messages=MESSAGES, max_tokens=max_tokens, temperature=0
    )
    assert r.choices[0].message.content
    return r.choices[0].message.content


def _complete(server: ServerProc, prompt: str) -> str:
    r = _client(server).completions.create(model="tiny-moe6", prompt=prompt, max_tokens=12, temperature=0)
    return r.choices[0].text


def test_in_process_split_answers_like_one_process(servers: Servers) -> None:
    want = [_complete(servers.plain, p) for p in PROMPTS]
    # The second round finds the first's prompts cached (KV kept on three stages): each in the slot it took, or
    # restored from the host's prompt cache
    for round in range(2):
        got = [
            _client(servers.split).completions.create(
                model="tiny-moe6", prompt=p, max_tokens=12, temperature=0
            )
            for p in PROMPTS
        ]
        assert [r.choices[0].text for r in got] == want
        cached = [r.usage.prompt_tokens_details.cached_tokens for r in got]  # type: ignore[union-attr]
        assert all(c > 0 for c in cached) if round else cached == [0, 0]
    assert _chat(servers.split) == _chat(servers.plain)
    stats = servers.split.get("/stats").json()
    stages = stats["stages"]
    assert [(s["stage"], s["layers"], s["device"]) for s in stages] == [
        (0, [0, 2], "cpu"),
        (1, [2, 4], "cpu"),
        (2, [4, 6], "cpu"),
    ]
    steps = {s["step_ms"]["count"] for s in stages}
    assert len(steps) == 1 and steps.pop() >= 11  # every stage runs every step
    assert all(s["prompt_chunk_ms"]["count"] >= 1 and s["step_ms"]["mean"] > 0 for s in stages)
    assert "remote_stages" not in servers.split.get("/health").json()


def test_in_process_split_shared_steps_report_each_stages_own_time(servers: Servers) -> None:
    """Two requests decoding together cross the stages in shared steps: each stage's step events carry its own
    compute, waiting and transfer in that step (the step's clock, read once the step is), as a request alone's do,
    not the host's time around the stage's launches."""
    with ThreadPoolExecutor(1) as pool:
        other = pool.submit(
            _client(servers.split).completions.create,
            model="tiny-moe6",
            prompt="keep going",
            max_tokens=300,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        deadline = time.monotonic() + 30
        while not any(s["state"] == "decode" for s in servers.split.get("/stats").json()["slots"]["slots"]):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        events, _ = servers.split.events_of({"prompt": "stage by stage", "max_tokens": 6, "ignore_eos": True})
        assert other.result().usage.completion_tokens == 300  # type: ignore[union-attr]
    steps = [e for e in events if e["type"] == "step"]
    assert any(e["tokens"] == 2 for e in steps)  # steps both requests shared
    assert {e["stage"] for e in steps} == {0, 1, 2}
    for e in steps:
        assert e["ms"] == e["compute_ms"] > 0 and e["wait_ms"] >= 0 and e["transfer_ms"] >= 0, e


def test_remote_stage_answers_like_one_process(servers: Servers) -> None:
    assert _chat(servers.remote) == _chat(servers.plain)
    assert [_complete(servers.remote, p) for p in PROMPTS] == [_complete(servers.plain, p) for p in PROMPTS]
    address = f"127.0.0.1:{servers.worker.port}"
    health = servers.remote.get("/health").json()
    assert health["status"] == "ready" and health["remote_stages"] == [{"address": address, "status": "ok"}]

    stages = servers.remote.get("/stats").json()["stages"]
    assert len(stages) == 2
    here, there = stages
    assert here["layers"] == [0, K] and here["device"] == "cpu" and "host" not in here
    assert there["layers"] == [K, N_LAYER] and there["host"] == address and there["status"] == "ok"
    for kind in ("step", "prompt_chunk"):
        for key in (f"{kind}_ms", f"{kind}_wait_ms", f"{kind}_transfer_ms"):
            assert there[key]["count"] >= 1 and there[key]["min"] >= 0, key
    assert there["step_ms"]["count"] == here["step_ms"]["count"]

    events, _ = servers.remote.events_of({"prompt": "stage by stage", "max_tokens": 4, "ignore_eos": True})
    steps = [e for e in events if e["type"] == "step"]
    chunks = [e for e in events if e["type"] == "prompt_chunk"]
    # 4 tokens: 3 decode steps (numbered by the server's slots, which count every step), each reported by both
    # stages
    first = min(e["index"] for e in steps)
    assert sorted((e["index"], e["stage"]) for e in steps) == [
        (first + i, s) for i in range(3) for s in (0, 1)
    ]
    assert {e["stage"] for e in chunks} == {0, 1}
    for e in steps + chunks:
        if e["stage"] == 1:
            assert e["host"] == address and e["layers"] == f"{K}-{N_LAYER - 1}"
            assert e["ms"] == e["compute_ms"] > 0 and e["wait_ms"] >= 0 and e["transfer_ms"] >= 0
        else:  # this process's stage: its own compute, waiting and transfer (stage_clock)
            assert e["layers"] == f"0-{K - 1}" and e["ms"] == e["compute_ms"] > 0
            assert e["wait_ms"] >= 0 and e["transfer_ms"] == 0.0 and "host" not in e


def test_clients_at_once_share_the_remote_stages_steps(servers: Servers) -> None:
    """Four clients at once through the remote stage: each gets the plain server's text, the server ran them in
    its slots together (the worker keeps a KV cache for each)."""
    prompts = [*PROMPTS, "a third prompt, longer than the others are", "four"]
    want = [_complete(servers.plain, p) for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(lambda p: _complete(servers.remote, p), prompts))
    assert got == want
    slots = servers.remote.get("/stats").json()["slots"]
    assert slots["total"] == 4, slots  # --parallel auto on the CPU, and the worker holds as many
    assert slots["groups"] == 2  # --batch-groups auto with a remote stage: one group computes here, one there
    log = "\n".join(servers.remote.log)
    assert "4 slots" in log and "requests are decoded together" in log
    assert "the worker's decode rows are warm" in log  # at load, not in the first request's time


def test_a_killed_worker_fails_the_request_and_a_restarted_one_serves(servers: Servers) -> None:
    """Runs last: it replaces the module's worker."""
    want = _chat(servers.plain)
    address = f"127.0.0.1:{servers.worker.port}"
    servers.worker.kill()
    # noticed between requests (the server checks its idle links each second), before any request fails on it
    deadline = time.monotonic() + 10
    while servers.remote.get("/health").json()["status"] != "degraded" and time.monotonic() < deadline:
        time.sleep(0.1)
    health = servers.remote.get("/health").json()
    assert health["status"] == "degraded" and address in health["error"], health
    with pytest.raises(openai.APIStatusError) as err:
        _chat(servers.remote)
    assert err.value.status_code == 502
    body = err.value.body
    assert isinstance(body, dict) and body["code"] == "stage_unavailable" and body["type"] == "server_error"
    assert address in body["message"]
    health = servers.remote.get("/health").json()
    assert health["status"] == "degraded" and address in health["error"]
    assert health["remote_stages"][0]["status"].startswith("down:")
    assert servers.remote.get("/stats").json()["stages"][1]["status"].startswith("down:")

    servers.worker = start_worker(
        servers.model, K, port=servers.worker.port, extra=["--max-context", CONTEXT]
    )
    assert _chat(servers.remote) == want
    assert servers.remote.get("/health").json()["status"] == "ready"


# ---- the config's split keys and the flags checked at start -------------------------------------------------


def _from_config(tmp_path: Path, cfg: dict[str, Any], *argv: str) -> EngineOptions:
    path = tmp_path / "strata-tiny.json"
    path.write_text(json.dumps(cfg))
    return resolve(["serve", "--config", str(path), *argv], env={})


def test_config_split_keys_become_flags(tmp_path: Path) -> None:
    a = _from_config(
        tmp_path, {"model": "m.gguf", "gpu": [0, 2], "layer_split": [20], "gpu_order": "as_given"}
    )
    assert (a.gpus, a.layer_split, a.gpu_order, a.gpu) == ("0,2", "20", "as_given", None)
    assert a.model == str(tmp_path / "m.gguf")
    one = _from_config(tmp_path, {"model": "m.gguf", "gpu": [1]})
    assert (one.gpu, one.gpus, one.device) == (1, None, "auto")
    workers = [{"host": "192.168.1.20", "port": 7070, "begin": 24, "end": 40}]
    w = _from_config(tmp_path, {"model": "m.gguf", "workers": workers, "args": ["--max-queue", "5"]})
    assert (w.remote_stage, w.layer_split, w.max_queue) == ("192.168.1.20:7070", "24", 5)
    # "args" win over the keys, the command line over both.
    over = _from_config(tmp_path, {"model": "m.gguf", "gpu": [0, 1], "args": ["--layer-split", "12"]})
    assert (over.gpus, over.layer_split) == ("0,1", "12")
    cli = _from_config(tmp_path, {"model": "m.gguf", "gpu": [0, 1]}, "--layer-split", "8")
    assert cli.layer_split == "8"


def test_bad_split_flags_are_refused_at_start(
    model6: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["serve", "--model", str(model6), "--port", "0"]
    assert engine_main([*base, "--layer-split", "2;4"]) == 2
    assert (
        "--layer-split '2;4': expected auto or the first layer of each later card" in capsys.readouterr().err
    )
    monkeypatch.delenv("STRATA_STAGE_TOKEN", raising=False)
    assert engine_main([*base, "--layer-split", "3", "--remote-stage", "127.0.0.1:9"]) == 2
    assert "no key for the stage link: set STRATA_STAGE_TOKEN" in capsys.readouterr().err
