"""--expert-prefetch: the flag reaches the expert policy and is refused where it cannot work, the trace's
predictions have the accuracy asked, and the router's prediction reads the next layer's router as the next layer
would (the staging of the predictions: test_kernels_interpreter.py; the tokens on a card: test_prefetch_gpu.py)."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from engine.experts.policy import ExpertPolicy, check_prefetch
from engine.experts.prefetch import (
    PrefetchError,
    RouterPredictor,
    TracePredictor,
    attach,
    next_layers,
    trace_predictions,
)
from engine.experts.trace_gen import PRESETS, generate
from engine.layers.qtensor import QTensor
from engine.pipeline.split_args import options_from_args
from installer.engine_options import OptionsError, resolve, runtime_switches


def test_the_flag_reaches_the_policy_and_refuses_what_it_cannot_work_with() -> None:
    assert options_from_args(resolve(["serve"], env={})).expert_prefetch == "off"  # not measured yet: off
    assert (
        options_from_args(resolve(["serve", "--expert-prefetch", "router"], env={})).expert_prefetch
        == "router"
    )
    with pytest.raises(SystemExit):
        resolve(["serve", "--expert-prefetch", "always"], env={})
    check_prefetch(ExpertPolicy(prefetch="router"))
    for policy in (
        ExpertPolicy(prefetch="router", eviction="lru"),
        ExpertPolicy(prefetch="router", miss_path="direct"),
    ):
        with pytest.raises(PrefetchError, match="--expert-misses copy and --expert-policy profile"):
            check_prefetch(policy)
    with pytest.raises(PrefetchError, match="use one of off, router"):
        check_prefetch(ExpertPolicy(prefetch="sometimes"))
    assert runtime_switches({"STRATA_PREFETCH_TRACE": "0.9"}).prefetch_trace == 0.9
    assert runtime_switches({}).prefetch_trace is None
    with pytest.raises(OptionsError, match=r"STRATA_PREFETCH_TRACE is '1\.5'"):
        runtime_switches({"STRATA_PREFETCH_TRACE": "1.5"})


def test_next_layers_pairs_each_moe_layer_with_the_next_of_its_stage() -> None:
    assert next_layers([5, 3, 4, 8]) == {3: 4, 4: 5, 5: 8}
    assert next_layers([2]) == {}


@pytest.mark.parametrize("accuracy", [0.0, 0.5, 0.9, 1.0])
def test_trace_predictions_are_right_as_often_as_asked(accuracy: float) -> None:
    t = generate(2000, 3, 32, 4, PRESETS["realistic"], seed=2)
    pred = trace_predictions(t.ids, 32, accuracy, seed=1)
    assert pred.shape == t.ids.shape
    right = (pred[..., :, None] == t.ids[..., None, :]).any(-1)  # [N, L, k]: a chosen expert
    assert abs(right.mean() - accuracy) < 0.02
    assert np.array_equal(
        right, pred == t.ids
    )  # a kept choice stays in its place; a replaced one is not chosen
    srt = np.sort(pred, axis=-1)
    assert (np.diff(srt, axis=-1) > 0).all()  # no expert twice in a prediction
    assert np.array_equal(pred, trace_predictions(t.ids, 32, accuracy, seed=1))  # seeded
    with pytest.raises(PrefetchError, match="between 0 and 1"):
        trace_predictions(t.ids, 32, 1.2)


def test_the_trace_predictor_reads_the_row_the_next_layer_reads_next() -> None:
    t = generate(50, 2, 16, 2, PRESETS["uniform"], seed=3)
    route = SimpleNamespace(ids=torch.from_numpy(t.ids.astype(np.int16)), col={4: 0, 6: 1}, k=2)
    counts = torch.zeros(8, 16, dtype=torch.int32)
    counts[6, 0] = 2 * 7  # layer 6 has read 7 tokens
    pred = TracePredictor(route, counts, 16, 1.0, {4: 6})  # type: ignore[arg-type]
    got = pred(4, torch.zeros(3, 8))  # three rows: tokens 7, 8, 9
    assert got.tolist() == t.ids[7:10, 1].astype(np.int64).tolist()
    counts[6, 0] = 2 * 49  # the last token, then the trace wraps as the replay does
    assert pred(4, torch.zeros(2, 8)).tolist() == t.ids[[49, 0], 1].astype(np.int64).tolist()


def test_the_router_predictor_is_the_next_layers_router_on_the_same_row_under_its_norm() -> None:
    d, e, k = 16, 10, 3
    g = torch.Generator().manual_seed(0)
    w0, w1 = torch.rand(d, generator=g) + 0.5, torch.rand(d, generator=g) + 0.5
    w0[3] = 0.0  # a zero weight: nothing of that column reaches the router
    r = torch.randn(e, d, generator=g)
    router = QTensor(r.contiguous().view(torch.uint8).view(e, 4 * d), QT.F32, (e, d))
    model = SimpleNamespace(
        cfg=SimpleNamespace(n_expert_used=k),
        layers={0: SimpleNamespace(ffn_norm=w0), 1: SimpleNamespace(ffn_norm=w1)},
        expert_cache=SimpleNamespace(layers={1: SimpleNamespace(router=router)}),
    )
    pred = RouterPredictor(model, {0: 1})
    hhat = torch.randn(2, d, generator=g)  # the normalised hidden rows
    got = pred(0, hhat * w0)  # layer 0's FFN input
    col = torch.ones(d)
    col[3] = 0.0
    want = torch.topk((hhat * w1 * col) @ r.t(), k, dim=-1).indices
    assert torch.equal(got, want)


def test_attach_sets_up_nothing_where_nothing_is_to_be_prefetched() -> None:
    assert attach(SimpleNamespace(expert_cache=None), "router", None) is None
    full = SimpleNamespace(expert_cache=SimpleNamespace(streams_prompts=False))
    assert attach(full, "router", None) is None  # every expert in VRAM
    assert attach(full, "off", None) is None
    cache = SimpleNamespace(streams_prompts=True, layers={0: SimpleNamespace(), 1: SimpleNamespace()})
    with pytest.raises(PrefetchError, match="set STRATA_ROUTE_TRACE too"):
        attach(SimpleNamespace(expert_cache=cache, route_trace=None, expert_counts=None), "router", 0.9)
