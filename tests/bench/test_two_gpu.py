"""bench/two_gpu.py: the ratios of issue 14 from our arms and llama-bench's records (checked against arithmetic on
the inputs), the cards the budgeted placement sees, and a dry run of every arm on the CPU with a tiny model - the
split (both hand-off arms), one stage, and the later stage in a worker process over loopback - whose greedy tokens
equal the unsplit model's."""

import importlib.util
import json
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest

from installer.placement import Card

ROOT = Path(__file__).resolve().parents[2]
GIB = 1 << 30


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("two_gpu_bench", ROOT / "bench" / "two_gpu.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


tg = _script()


def _llama(pp: float, tg_: float) -> list[dict[str, object]]:
    """llama-bench -o json records: one per test, with more keys than these."""
    return [
        {"model_type": "qwen3moe 30B.A3B Q4_K", "n_prompt": 4096, "n_gen": 0, "avg_ts": pp, "stddev_ts": 1.0},
        {"model_type": "qwen3moe 30B.A3B Q4_K", "n_prompt": 0, "n_gen": 128, "avg_ts": tg_, "stddev_ts": 1.0},
    ]


def test_assemble_gives_each_ratio_of_the_measured_arms() -> None:
    best = {
        "one16": {"decode": 100.0, "prompt": 5000.0},
        "split16_host": {"decode": 150.0, "prompt": 9000.0},
        "split16_peer": {"decode": 160.0, "prompt": 8000.0},
        "one_full": {"decode": 250.0, "prompt": 11000.0},
        "split_full": {"decode": 200.0, "prompt": 10000.0},
        "remote": {"decode": 180.0, "prompt": 7000.0},
    }
    ours = {"prompt_tokens": 4096, "decode_tokens": 128, "vram_budget_mib": 16384, "best_tok_s": best,
            "greedy": {"identical": {"split_full_host": True}, "verdict": "x: identical"},
            "arms": {"remote": {"error": "boom", "log": ["a"]}, "one16": {"what": "w", "log": ["b"]}}}  # fmt: skip
    r = tg.assemble(ours, _llama(10000.0, 250.0), _llama(11000.0, 300.0))
    q = r["ratios"]
    assert q["two_16g_cards_over_one_16g_card_host"] == pytest.approx({"decode": 1.5, "prompt": 1.8})
    assert q["two_16g_cards_over_one_16g_card_peer"] == pytest.approx({"decode": 1.6, "prompt": 1.6})
    assert q["peer_over_host_16g"] == pytest.approx({"decode": 160 / 150, "prompt": 8000 / 9000})
    assert q["two_cards_over_one_card_full_caches"] == pytest.approx({"decode": 0.8, "prompt": 10 / 11})
    assert q["remote_over_in_process_split"] == pytest.approx({"decode": 0.9, "prompt": 0.7})
    assert q["llamacpp_two_over_one"] == pytest.approx({"decode": 250 / 300, "prompt": 10 / 11})
    # the better hand-off per measure: decode from peer, prompt from host
    assert q["ours_over_llamacpp_two_cards_16g_best_handoff"] == pytest.approx(
        {"decode": 0.64, "prompt": 0.9}
    )
    assert q["ours_over_llamacpp_two_cards_full_caches"] == pytest.approx({"decode": 0.8, "prompt": 1.0})
    assert q["ours_over_llamacpp_one_card_full_caches"] == pytest.approx({"decode": 250 / 300, "prompt": 1.0})
    assert r["llamacpp_tok_s"]["one_gpu"] == {"prompt": 11000.0, "decode": 300.0}
    assert r["greedy_identity_verdict"] == "x: identical"
    assert r["errors"] == {"remote": "boom"}
    assert "log" not in r["arms"]["one16"]  # the long log lines stay in our own file


def test_assemble_says_what_was_not_measured() -> None:
    ours = {"best_tok_s": {"one16": {"decode": 100.0, "prompt": 5000.0}}}
    r = tg.assemble(ours, "not measured: two.json: Expecting value", [_llama(1.0, 2.0)[0]])
    assert r["llamacpp_tok_s"]["two_gpus_sm_layer"] == "not measured: two.json: Expecting value"
    assert "lack pp4096 or tg128" in r["llamacpp_tok_s"]["one_gpu"]
    assert r["ratios"]["two_16g_cards_over_one_16g_card_host"] == "not measured"
    assert r["ratios"]["llamacpp_two_over_one"] == "not measured"
    assert tg.assemble(None, None, None)["greedy_identity_verdict"] == "not measured"


def test_budget_cards_cap_free_vram_at_the_budget() -> None:
    cards = [Card(0, "big", 140 * GIB, 141 * GIB, (9, 0), 132, 1980), Card(1, "small", 8 * GIB, 8 * GIB)]
    out = tg.budget_cards(cards, 16384)
    assert [c.free_bytes for c in out] == [16 * GIB, 8 * GIB]
    assert [(c.index, c.name, c.total_bytes, c.sm_count) for c in out] == [
        (0, "big", 141 * GIB, 132),
        (1, "small", 8 * GIB, None),
    ]


def test_cpu_dry_run_measures_every_arm_and_matches_one_stage(tmp_path: Path) -> None:
    out = tmp_path / "ours.json"
    a = tg.build_parser().parse_args(
        ["measure", "--device", "cpu", "--tiny", "--prompt", "48", "--decode", "4", "--rounds", "1",
         "--greedy-prompt", "12", "--greedy-tokens", "6", "--out", str(out)]
    )  # fmt: skip
    before = os.environ.get("STRATA_STAGE_TOKEN")
    res = tg.measure(a)
    assert os.environ.get("STRATA_STAGE_TOKEN") == before
    assert json.loads(out.read_text()) == json.loads(json.dumps(res))
    for arm in tg.ARMS:
        assert "error" not in res["arms"][arm], res["arms"][arm]
        assert res["best_tok_s"][arm]["decode"] > 0 and res["best_tok_s"][arm]["prompt"] > 0
    # two 16 GiB cards and two large ones both hold a 6-layer tiny model: the share rule splits it in half
    for plan in res["placement"].values():
        assert plan["starts"] == [3] and plan["lines"][0].startswith("layer split auto: K=3")
    assert res["arms"]["split16_host"]["stages"] == [
        {"where": "CPU", "layers": "0-2"},
        {"where": "CPU", "layers": "3-5"},
    ]
    assert res["arms"]["remote"]["stages"][1]["layers"] == "3-5"
    assert any("listening on 127.0.0.1" in line for line in res["arms"]["remote"]["worker_log"])
    g = res["greedy"]
    assert len(g["tokens"]["one_full"]) == 6
    assert set(g["identical"]) == {"one16", "split16_host", "split16_peer", "split_full", "split_full_host",
                                   "split_full_peer", "remote"}  # fmt: skip
    assert all(g["identical"].values()), g["tokens"]
    assert g["verdict"].endswith(": identical")
