"""The tuner: its arithmetic against hand-worked values, and a real run on two emulated worker PCs."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from engine.node import gpu as gpu_mod
from engine.node.agent import Agent
from engine.node.tuner import (
    Measurement,
    TuneError,
    Tuner,
    candidate_splits,
    expected_seconds,
    fixed_prompt,
    parse_splits,
    workload,
)
from engine.testing.tiny_models import write_tiny_model
from installer.config import read_config
from tests.engine.node.conftest import pair_with


def test_workload_scales_to_the_context() -> None:
    assert workload(200_000, 320) == [(8192, 0.3), (32768, 0.5), (102400, 0.2)]
    # 32768 context, 320-token answers: room 32440 of 102400 -> every length scaled by 0.31680
    assert workload(32768, 320) == [(2595, 0.3), (10381, 0.5), (32440, 0.2)]
    assert workload(100, 10, [(50, 1), (10, 3)]) == [(50, 0.25), (16, 0.75)]
    with pytest.raises(TuneError, match="no room"):
        workload(300, 320)


def test_candidate_splits() -> None:
    assert candidate_splits(48, 2) == [(24,), (21,), (27,), (18,), (30,)]
    three = candidate_splits(48, 3, count=4)
    assert three[0] == (16, 32) and len(three) == 4
    assert all(b - a >= 3 for s in three for a, b in zip((0, *s), (*s, 48), strict=True))
    assert candidate_splits(6, 3) == [(2, 4)]
    with pytest.raises(TuneError, match="cannot be cut"):
        candidate_splits(2, 3)
    assert parse_splits(["24", "20"], 48, 2) == [(24,), (20,)]
    for bad in ("24,30", "0", "48", "x"):
        with pytest.raises(TuneError):
            parse_splits([bad], 48, 2)


def test_expected_seconds_weights_the_mix() -> None:
    rows = [
        Measurement((24,), 2048, 100, 10, 50.0, 10.0, 3.0),
        Measurement((24,), 2048, 400, 10, 80.0, 10.0, 6.0),
    ]
    assert expected_seconds(rows, [(100, 0.25), (400, 0.75)]) == pytest.approx(0.25 * 3 + 0.75 * 6)
    failed = [rows[0], Measurement((24,), 2048, 400, 10, 0, 0, 0, "boom")]
    assert expected_seconds(failed, [(100, 0.5), (400, 0.5)]) is None


def test_fixed_prompt_is_exact_and_stable() -> None:
    class Tok:
        def encode(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
            return [len(w) for w in text.split()]

    a = fixed_prompt(Tok(), 1000)
    assert len(a) == 1000 and a == fixed_prompt(Tok(), 1000) and a[:50] == fixed_prompt(Tok(), 50)


@pytest.mark.slow
def test_tuner_on_two_emulated_pcs(
    make_agent: Callable[..., Agent], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    models = tmp_path / "models"
    models.mkdir()
    model = write_tiny_model(models / "tiny.gguf", "qwen3moe", qtype="Q8_0", n_layer=6, seed=7)
    import torch

    # One compute thread per process: main stage and two workers share a small CI box.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    real_pc = gpu_mod.pc_report
    monkeypatch.setattr(gpu_mod, "pc_report", lambda: {**real_pc(), "os": "Windows"})  # both report Windows
    from engine.node.client import main_keys

    # The main PC's own key (its data folder's), as `strata-node` commands use it.
    p1 = pair_with(make_agent("pc1", model_dirs=(models,)), keys=main_keys())
    # Both PCs hold the whole file (put there by their owners); test_remote_worker.py covers a shipped shard.
    p2 = pair_with(make_agent("pc2", model_dirs=(models,)), keys=p1.keys)
    shipped: list[str] = []
    steps: list[tuple[str, int, int]] = []  # the progress the app's bar shows
    tuner = Tuner(
        model,
        [p1.record, p2.record],
        splits=[(2, 4), (3, 5)],
        chunks=[16, 64],
        answer_tokens=4,
        max_context=128,
        worker_flags=["--device", "cpu"],
        keys=p1.keys,
        device="cpu",
        log=shipped.append,
        progress=lambda what, done, total: steps.append((what, done, total)),
    )
    assert tuner.mix == [(16, 0.3), (37, 0.5), (116, 0.2)]  # at least 16 tokens each
    try:
        res = tuner.run(tmp_path / "strata-tiny.json", tmp_path / "report.md")
    finally:
        torch.set_num_threads(threads)
    errors = [m.error for m in res.measurements if m.error]
    assert errors == [], errors
    assert len(res.measurements) == 2 * 2 * 3
    measured = [d for what, d, t in steps if what == "measure" and t == 12]
    assert (
        measured[0] == 0 and measured[-1] == 12 and measured == sorted(measured) and len(set(measured)) == 13
    )
    assert any("pc1 holds tiny.gguf already" in line for line in shipped)
    assert any("pc2 holds tiny.gguf already" in line for line in shipped)
    best = min(res.scores, key=res.scores.__getitem__)
    assert best == f"{','.join(map(str, res.best_split))}@{res.best_chunk}"
    for key, s in res.scores.items():
        split = tuple(int(x) for x in key.split("@")[0].split(","))
        rows = [m for m in res.measurements if m.split == split and m.chunk == int(key.split("@")[1])]
        assert s == pytest.approx(sum(w * r.seconds for (n, w), r in zip(tuner.mix, rows, strict=True)))

    # The config: installer's format, the engine's flags from it, the remote options it checks.
    cfg = read_config(res.config_path, layers=6)
    k1, k2 = res.best_split
    assert [(w.host, w.begin, w.end) for w in cfg.workers] == [("127.0.0.1", k1, k2), ("127.0.0.1", k2, 6)]
    # the first of each agent's worker ports, or another of them where a measurement found it taken (the chain,
    # and then the config, use the port the worker got: engine/node/chain.py)
    assert cfg.workers[0].port in p1.agent.workers.ports and cfg.workers[1].port in p2.agent.workers.ports
    assert cfg.args == ("--prefill", str(res.best_chunk)) and cfg.max_context == 128
    from engine.link.startup import check_remote_options
    from engine.pipeline.split_args import options_from_args
    from installer.engine_options import config_args, from_config, merge

    opts = options_from_args(merge("generate", {"prompt": "x"}, from_config(cfg, "generate")[0])[0])
    check_remote_options(opts, 6)
    assert opts.remote == f"127.0.0.1:{p1.agent.workers.ports.start}" and opts.layer_split == (k1,)

    # And the engine runs from it: the app's way (start-workers --json, then the engine with the config's flags).
    import contextlib
    import io
    import os
    import subprocess
    import sys

    from engine.node.cli import main as node_main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = node_main(
            ["start-workers", "--config", str(res.config_path), "--json", "--", "--device", "cpu"]
        )
    assert code == 0, out.getvalue()
    started = json.loads(out.getvalue())
    assert [(w["node"], w["begin"], w["end"]) for w in started["workers"]] == [
        ("pc1", k1, k2),
        ("pc2", k2, 6),
    ]
    assert any("pc1 runs Windows" in w for w in started["warnings"])

    def generate(*extra: str) -> str:
        argv = [
            sys.executable,
            "-m",
            "engine.cli",
            "generate",
            "--model",
            str(model),
            "--prompt",
            "a b c d e f",
        ]
        argv += ["-n", "6", "--device", "cpu", *extra]
        r = subprocess.run(argv, capture_output=True, text=True, timeout=120, env={**os.environ})
        assert r.returncode == 0, r.stderr[-1500:]
        return r.stdout

    flags = [*config_args(cfg), *cfg.args, "--max-context", str(cfg.max_context), *started["engine_flags"]]
    assert generate(*flags) == generate()
    for w, p in zip(started["workers"], (p1, p2), strict=True):
        p.client.stop_worker(w["id"])

    report = (tmp_path / "report.md").read_text()
    assert report.count("| 2,4 |") == 6 + 2 and report.count("| 3,5 |") == 6 + 2  # measurements + scores
    assert (
        "Best: split" in report
        and "WARNING: pc1 runs Windows" in report
        and "WARNING: pc2 runs Windows" in report
    )
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["best"]["split"] == list(res.best_split) and len(data["measurements"]) == 12
    assert all(w["state"] == "stopped" for w in p1.client.workers() + p2.client.workers())
    p1.client.close()
    p2.client.close()
