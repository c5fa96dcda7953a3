"""The expert cache's on-card admission (--expert-policy lru / lfu) and the routing trace replayed inside CUDA graphs:
the kernel follows the simulator's rules and moves the right bytes; a model's greedy tokens are the same under every
policy, with its own routing and with a replayed trace; a trace recorded on the card replays to the same tokens."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.cli import main
from engine.experts.policy import ExpertPolicy
from engine.experts.trace import hit_rate, load_trace, save_trace
from engine.experts.trace_gen import PRESETS, generate
from tests.engine.test_gpu_fast_path import PROMPT
from tests.engine.test_gpu_fast_path import _greedy as fast_path_greedy

pytestmark = pytest.mark.gpu


def _layer(n_expert: int, cap: int, policy: str, most: int):
    from engine.kernels.expert_lru import DeviceLru

    nb = 256
    g = torch.Generator().manual_seed(0)
    host = [
        torch.randint(0, 256, (n_expert, nb), dtype=torch.uint8, generator=g).pin_memory() for _ in range(3)
    ]
    slots = [torch.zeros(cap, nb, dtype=torch.uint8, device="cuda") for _ in range(3)]
    for p in range(3):
        slots[p].copy_(host[p][:cap])
    host_tab = torch.tensor([[h[e].data_ptr() for e in range(n_expert)] for h in host], device="cuda")
    tables = host_tab.clone()
    for p in range(3):
        tables[p, :cap] = torch.tensor([slots[p][c].data_ptr() for c in range(cap)])
    nbytes = torch.full((3,), nb, dtype=torch.int64, device="cuda")
    slot_of = list(range(cap)) + [-1] * (n_expert - cap)
    lru = DeviceLru(torch.device("cuda"), slot_of, list(range(cap)), tables, host_tab, [s.data_ptr() for s in slots],
                    nbytes, policy, 0.9, most)  # fmt: skip
    return lru, host, slots, tables, host_tab


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_the_admitting_kernel_follows_the_simulator_and_moves_the_right_bytes(policy: str) -> None:
    n_expert, cap = 32, 6
    one = generate(400, 1, n_expert, 1, PRESETS["realistic"], seed=4).ids[:, 0].astype(np.int64)  # [N, 1]
    lru, host, slots, tables, host_tab = _layer(n_expert, cap, policy, 8)
    for t in range(one.shape[0]):
        ids = torch.from_numpy(one[t : t + 1]).cuda()
        out = lru.admit(ids)
        if t < 60:  # every address read holds the chosen expert's bytes
            e = int(one[t, 0])
            for p in range(3):
                a = int(out[p, 0])
                if a == int(host_tab[p, e]):
                    continue  # read from host memory (not admitted: cannot happen with k = 1 and free slots)
                c = (a - slots[p].data_ptr()) // 256
                assert 0 <= c < cap and torch.equal(slots[p][c].cpu(), host[p][e])
    hits, misses, admitted = lru.stats.tolist()
    assert hits + misses == one.size and admitted == misses
    want = hit_rate(one, cap, policy, start=list(range(cap)))
    if policy == "lru":  # one choice a step: no ties but the start's, broken the same way
        assert hits == round(want * one.size)
    else:  # float32 on the card against float64: a near tie may go the other way
        assert abs(hits / one.size - want) <= 0.02
    # the layer's own tables agree with the slot map
    slot_of = lru.slot_of.tolist()
    for e, c in enumerate(slot_of):
        want_a = slots[0][c].data_ptr() if c >= 0 else int(host_tab[0, e])
        assert int(tables[0, e]) == want_a
    # several rows a step (k = 4): close to the simulator (ties between a step's admissions break by slot there)
    four = generate(600, 1, n_expert, 4, PRESETS["realistic"], seed=5).ids[:, 0].astype(np.int64)
    lru, *_ = _layer(n_expert, 12, policy, 32)
    for t in range(0, four.shape[0], 2):
        lru.admit(torch.from_numpy(four[t : t + 2]).cuda())  # two rows a step
    hits, misses, _ = lru.stats.tolist()
    paired = four.reshape(-1, 8)  # the simulator's step: the same two rows' choices together
    assert abs(hits / four.size - hit_rate(paired, 12, policy, start=list(range(12)))) <= 0.03
    assert lru.stats[2].item() < misses  # an expert two rows missed together is admitted once


def _greedy(path: Path, **kw) -> tuple[list[int], object]:
    return fast_path_greedy(path, 32, **kw)


def test_every_policy_gives_the_same_tokens_with_its_own_routing_and_a_replayed_trace(
    moe_q4k: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    full, _ = _greedy(moe_q4k)
    for policy in ("profile", "lru", "lfu"):
        tokens, lm = _greedy(moe_q4k, experts=ExpertPolicy(slots=6, eviction=policy))
        assert tokens == full, policy
        st = lm.model.expert_cache.stats()
        assert st.experts_in_vram == 6 and st.hits + st.misses > 0
        if policy != "profile":
            assert st.swaps > 0 and lm.model.graphs is not None and lm.model.graphs.graphs

    trace = generate(400, 2, 8, 2, PRESETS["local"], seed=9)
    save_trace(tmp_path / "t.npz", trace)
    monkeypatch.setenv("STRATA_ROUTE_TRACE", str(tmp_path / "t.npz"))
    replayed: dict[str, list[int]] = {}
    rates: dict[str, float] = {}
    for policy in ("profile", "lru", "lfu"):
        tokens, lm = _greedy(moe_q4k, experts=ExpertPolicy(slots=6, eviction=policy))
        replayed[policy] = tokens
        counts = lm.model.expert_counts.cpu().numpy()
        n = int(counts[0].sum()) // 2
        for j in range(2):  # inside the CUDA graphs too, every token took the trace's row
            np.testing.assert_array_equal(
                np.bincount(trace.ids[:n, j].ravel().astype(np.int64), minlength=8), counts[j]
            )
        st = lm.model.expert_cache.stats()
        rates[policy] = st.hits / max(st.hits + st.misses, 1)
    assert replayed["lru"] == replayed["profile"] == replayed["lfu"]
    assert rates["lru"] > rates["profile"] - 0.05, rates  # a local trace: recency keeps up with the fill


def test_a_trace_recorded_on_the_card_replays_to_the_same_tokens(
    moe_q4k: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from engine.experts.replay import recorded

    monkeypatch.setenv("STRATA_ROUTE_RECORD", "4096")
    plain, lm = _greedy(moe_q4k, experts=ExpertPolicy(slots=6, eviction="lru"))
    t = recorded([lm.model])
    assert t is not None and t.tokens == len(PROMPT) + 31 and t.layers == [0, 1]  # the last token is not read
    counts = lm.model.expert_counts.cpu().numpy()
    for j in range(2):
        np.testing.assert_array_equal(
            np.bincount(t.ids[:, j].ravel().astype(np.int64), minlength=8), counts[j]
        )
    save_trace(tmp_path / "rec.npz", t)
    monkeypatch.delenv("STRATA_ROUTE_RECORD")
    monkeypatch.setenv("STRATA_ROUTE_TRACE", str(tmp_path / "rec.npz"))
    again, lm2 = _greedy(moe_q4k, experts=ExpertPolicy(slots=6, eviction="lru"))
    assert again == plain
    np.testing.assert_array_equal(lm2.model.expert_counts.cpu().numpy(), counts)


def test_profile_records_a_trace_on_the_card(
    moe_q4k: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STRATA_PROFILE_DIR", str(tmp_path))
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello there\nwrite a poem about the sea\n", encoding="utf-8")
    args = [
        "profile",
        "--device",
        "cuda",
        "--dtype",
        "f32",
        "--model",
        str(moe_q4k),
        "--prompts",
        str(prompts),
    ]
    assert (
        main([*args, "-n", "8", "--out", str(tmp_path / "p.json"), "--trace", str(tmp_path / "rec.npz")]) == 0
    )
    t = load_trace(tmp_path / "rec.npz")
    counts = np.array(json.loads((tmp_path / "p.json").read_text())["counts"])
    for j in range(2):
        np.testing.assert_array_equal(
            np.bincount(t.ids[:, j].ravel().astype(np.int64), minlength=8), counts[j]
        )
