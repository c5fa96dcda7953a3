"""/metrics read by prometheus_client's parser, /events read by an SSE client (httpx-sse), /stats, and the
telemetry pieces on their own."""

import math
import threading
import time
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.telemetry.prometheus import Family, render, summary
from engine.telemetry.stats import RunningStat, Telemetry
from tests.engine.serve.harness import ServerProc

N_LAYER, N_EXPERT_USED = 2, 2  # the tiny qwen3moe


def _metrics(server: ServerProc) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    r = server.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def _one(m: dict[tuple[tuple[str, str], ...], float]) -> float:
    assert len(m) == 1
    return next(iter(m.values()))


def test_metrics_follow_a_request(server: ServerProc) -> None:
    before = _metrics(server)
    r = server.post(
        "/v1/completions", {"prompt": "count the experts", "max_tokens": 5, "ignore_eos": True}
    ).json()
    after = _metrics(server)
    t = r["timings"]
    assert t["predicted_n"] == 5

    def delta(name: str, labels: tuple[tuple[str, str], ...] = ()) -> float:
        return after[name].get(labels, 0.0) - before.get(name, {}).get(labels, 0.0)

    assert delta("strata_requests_total", (("endpoint", "completions"), ("outcome", "ok"))) == 1
    assert delta("strata_prompt_tokens_total") == r["usage"]["prompt_tokens"]
    assert delta("strata_prompt_tokens_cached_total") == t["cache_n"]
    assert delta("strata_tokens_predicted_total") == 5
    assert math.isclose(
        delta("strata_prompt_seconds_total"), t["prompt_ms"] / 1e3, rel_tol=1e-3, abs_tol=1e-6
    )
    assert math.isclose(delta("strata_tokens_predicted_seconds_total"), t["predicted_ms"] / 1e3, rel_tol=1e-3)
    # A step is one decode forward: each generated token but the last is fed back (the first comes from the
    # prompt's logits), so 5 tokens take 4 steps.
    assert delta("strata_step_seconds_count", (("stage", "0"),)) == 4
    assert delta("strata_prompt_chunk_seconds_count", (("stage", "0"),)) >= 1
    assert _one(after["strata_queue_waiting"]) == 0 and _one(after["strata_requests_active"]) == 0
    assert _one(after["strata_model_ready"]) == 1
    assert after["strata_expert_cache_hits_total"] == {(("stage", "0"),): 0.0}
    assert after["strata_expert_cache_misses_total"] == {(("stage", "0"),): 0.0}
    for name in ("swaps", "bytes_moved", "cpu_computed"):  # a CPU model has no expert cache: zeros, labelled
        assert after[f"strata_expert_cache_{name}_total"] == {(("stage", "0"),): 0.0}
    assert not after.get("strata_expert_cache_cpu_share")  # no CPU share of a card's misses: no sample
    # Every token that went through the model chose top-2 experts in each layer: the prompt tokens read, and
    # each generated token but the last (which is sampled, never fed back).
    forwarded = t["prompt_n"] + t["predicted_n"] - 1
    for layer in range(N_LAYER):
        assert delta("strata_expert_selections_total", (("layer", str(layer)),)) == forwarded * N_EXPERT_USED
    info = after["strata_info"]
    labels = dict(next(iter(info)))
    assert labels["model"] == "tiny-moe" and labels["arch"] == "qwen3moe" and labels["device"] == "cpu"


def test_stats(server: ServerProc) -> None:
    server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "stats"}], "max_tokens": 3})
    s = server.get("/stats").json()
    assert (
        s["status"] == "ready"
        and s["model"] == "tiny-moe"
        and s["arch"] == "qwen3moe"
        and s["device"] == "cpu"
    )
    assert s["queue"] == {"waiting": 0, "active": 0, "max": 256, "active_request": None}
    assert s["kv_host_layers"] == []  # all of the KV where the model runs (--kv-resident moves layers' KV)
    st = s["stages"][0]
    assert st["stage"] == 0 and st["layers"] == [0, N_LAYER] and st["device"] == "cpu"
    assert st["step_ms"]["count"] >= 1 and st["step_ms"]["mean"] > 0
    assert st["prompt_chunk_ms"]["count"] >= 1
    assert st["expert_cache"]["cpu_share"] is None
    assert s["totals"]["requests"] >= 1 and s["totals"]["generated_tokens"] >= 1
    last = s["last_request"]
    for key in (
        "prompt_n",
        "prompt_ms",
        "prompt_per_second",
        "predicted_n",
        "predicted_ms",
        "predicted_per_second",
        "cache_n",
    ):
        assert key in last
    ex = s["experts"]
    assert ex["routed"] == N_LAYER * 8 and ex["in_vram"] == 0 and ex["n_expert_used"] == N_EXPERT_USED
    assert len(ex["selections_per_layer"]) == N_LAYER and ex["selections_total"] == sum(
        ex["selections_per_layer"]
    )
    assert "counts" not in ex
    full = server.get("/stats", params={"experts": "full"}).json()["experts"]
    assert len(full["counts"]) == N_LAYER and all(len(row) == 8 for row in full["counts"])
    assert [sum(row) for row in full["counts"]] == full["selections_per_layer"]


def test_event_stream(server: ServerProc) -> None:
    events, r = server.events_of({"prompt": "events please", "max_tokens": 6, "ignore_eos": True})
    steps = [e for e in events if e["type"] == "step"]
    chunks = [e for e in events if e["type"] == "prompt_chunk"]
    req = events[-1]
    assert req["type"] == "request"
    # One step per decode forward: 6 tokens, the first from the prompt's logits, then 5 forwards of one token.
    # (index: the step's in its request, or with --parallel the server's count of shared steps)
    assert len(steps) == 5 and [e["index"] - steps[0]["index"] for e in steps] == list(range(5))
    assert all(e["tokens"] == 1 for e in steps)
    assert all(e["stage"] == 0 and e["ms"] > 0 and e["t"] > 0 for e in steps + chunks)
    assert sum(e["tokens"] for e in chunks) == r["timings"]["prompt_n"]
    assert req["predicted_n"] == 6 and req["prompt_n"] == r["timings"]["prompt_n"] and req["outcome"] == "ok"
    ts = [e["t"] for e in events]
    assert ts == sorted(ts)


def test_running_stat() -> None:
    s = RunningStat()
    for x in (4.0, 2.0, 6.0):
        s.add(x)
    d = s.to_dict()
    assert d["count"] == 3 and d["total"] == 12.0 and d["mean"] == 4.0
    assert d["min"] == 2.0 and d["max"] == 6.0 and d["last"] == 6.0
    assert RunningStat().to_dict()["mean"] is None


def test_telemetry_only_builds_events_for_listeners() -> None:
    got: list[dict[str, Any]] = []
    listening = False
    tel = Telemetry(listener=got.append, wants_events=lambda: listening)
    tel.step(0, 1.5)
    assert got == []
    listening = True
    tel.step(0, 2.5, index=3)
    tel.prompt_chunk(0, 10, 7.0, start=0)
    tel.request_done(
        "chat", "ok", {"prompt_n": 10, "cache_n": 2, "prompt_ms": 7.0, "predicted_n": 1, "predicted_ms": 2.5}
    )
    assert [e["type"] for e in got] == ["step", "prompt_chunk", "request"]
    snap = tel.snapshot()
    assert snap["stages"][0]["step_ms"]["count"] == 2
    assert snap["totals"]["prompt_tokens"] == 12 and snap["totals"]["prompt_cached_tokens"] == 2


def test_prometheus_rendering_round_trips() -> None:
    fams = [
        Family("x_total", "counter", "A counter with a tricky label.").add(3, {"name": 'a"b\\c\nd'}),
        Family("g", "gauge", "A gauge.").add(0.25),
        summary("s_seconds", "A summary.", [({"stage": 0}, 4, 1.5), ({"stage": 1}, 0, 0.0)]),
    ]
    parsed = {f.name: f for f in text_string_to_metric_families(render(fams))}
    assert parsed["x"].samples[0].labels == {"name": 'a"b\\c\nd'} and parsed["x"].samples[0].value == 3
    assert parsed["g"].samples[0].value == 0.25
    s = {(x.name, x.labels["stage"]): x.value for x in parsed["s_seconds"].samples}
    assert s == {
        ("s_seconds_count", "0"): 4,
        ("s_seconds_sum", "0"): 1.5,
        ("s_seconds_count", "1"): 0,
        ("s_seconds_sum", "1"): 0,
    }


@pytest.mark.parametrize("path", ["/metrics", "/stats"])
def test_state_endpoints_need_no_model_lock(server: ServerProc, path: str) -> None:
    """/metrics and /stats answer while a long generation runs (they never wait for the model)."""
    done = threading.Event()

    def long() -> None:
        server.post("/v1/completions", {"prompt": "busy", "max_tokens": 300, "ignore_eos": True})
        done.set()

    t = threading.Thread(target=long)
    t.start()
    deadline = time.monotonic() + 10
    while not server.get("/stats").json()["queue"]["active"]:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    t0 = time.perf_counter()
    assert server.get(path).status_code == 200
    assert time.perf_counter() - t0 < 0.5
    t.join(60)


def test_a_stages_cpu_share_is_reported_as_it_is_now() -> None:
    """The CPU's share of a card's decode misses (tuned while serving) in the snapshot /stats and /metrics read:
    the last value a stage reported, not a total."""
    tel = Telemetry(n_stages=2)
    tel.set_expert_cache(0, 10, 30, 4, 16, on_cpu=12, cpu_share=0.5)
    tel.set_expert_cache(0, 20, 60, 4, 16, on_cpu=25, cpu_share=0.6)
    tel.set_expert_cache(1, 5, 0, 16, 16)
    stages = tel.snapshot()["stages"]
    assert (
        stages[0]["expert_cache"]["cpu_share"] == 0.6 and stages[0]["expert_cache"]["computed_on_cpu"] == 25
    )
    assert stages[1]["expert_cache"]["cpu_share"] is None


def test_expert_figures_are_read_at_most_every_half_second_while_slots_decode() -> None:
    """Reading the expert counts waits for the card's queued steps: while requests run, a request's end reads them
    only when the last read is EXPERTS_EVERY_S old; the end of the last request always reads them."""
    from types import SimpleNamespace

    import torch

    from engine.serve.status import EXPERTS_EVERY_S, Status

    counts = torch.zeros(2, 4, dtype=torch.int64)
    st = Status()
    st.lm = SimpleNamespace(model=SimpleNamespace(expert_counts=counts))  # type: ignore[assignment]
    st.telemetry = Telemetry()
    st._snapshot_experts(force=False)
    assert st.telemetry.expert_counts == [[0] * 4] * 2
    counts[0, 1] = 5
    st._snapshot_experts(force=False)  # within the interval: not read
    assert st.telemetry.expert_counts[0][1] == 0
    st._experts_at -= EXPERTS_EVERY_S
    st._snapshot_experts(force=False)
    assert st.telemetry.expert_counts[0][1] == 5
    counts[0, 1] = 7
    st._snapshot_experts()  # forced: the last request ended
    assert st.telemetry.expert_counts[0][1] == 7
