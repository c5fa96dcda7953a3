"""Every expert backend of the MoE block against the one float64 reference (engine.layers.moe.reference).

The experts come from tiny model files in several block types, loaded as the engine loads them; the routing is
random (weights summing to one, k distinct experts a token) so that every backend sees the same dispatch."""

from pathlib import Path

import pytest
import torch

from engine.experts.backends import CachedExperts, CpuInPlaceExperts, choose
from engine.layers.moe import (
    ExpertBiases,
    ExpertMath,
    ExpertWeights,
    HostExperts,
    RouteTrace,
    reference,
    route,
    route_trace,
)
from engine.pipeline.loader import load_model
from engine.testing.tiny_models import write_tiny_model

QTYPES = ["F32", "Q8_0", "Q4_K", "Q6_K", "IQ4_XS", "Q4_0"]


def _experts(tmp_path: Path, qtype: str, device: str = "cpu", **kw: object) -> tuple[ExpertWeights, object]:
    path = write_tiny_model(tmp_path / f"moe-{qtype}.gguf", "qwen3moe", qtype)
    lm = load_model(path, device=device, dtype="f32", **kw)  # type: ignore[arg-type]
    i = next(i for i, lw in lm.model.layers.items() if lw.experts is not None)
    return lm.model.layers[i].experts, lm.model.moe[i]


def _routing(t: int, n_expert: int, k: int, d: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, d, generator=gen)
    ids = torch.stack([torch.randperm(n_expert, generator=gen)[:k] for _ in range(t)])  # [T, k] distinct
    w = torch.softmax(torch.randn(t, k, generator=gen), dim=-1)  # [T, k]
    return x, w, ids


def _close(got: torch.Tensor, want: torch.Tensor, cos: float, rel: float) -> None:
    got, want = got.double().cpu(), want.double().cpu()
    for t in range(want.shape[0]):
        c = torch.nn.functional.cosine_similarity(got[t], want[t], dim=0).item()
        assert c >= cos, f"token {t}: cosine {c:.6f}"
    err = (got - want).abs().max().item() / want.abs().max().item()
    assert err <= rel, f"max error {err:.2e} of the largest value"


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("t", [1, 5, 33])
def test_host_experts_match_the_reference(tmp_path: Path, qtype: str, t: int) -> None:
    ew, experts = _experts(tmp_path, qtype)
    assert isinstance(experts, HostExperts | CpuInPlaceExperts)
    n_e, _, d = ew.gate.shape
    x, w, ids = _routing(t, n_e, 2, d)
    _close(experts.mix(x, w, ids), reference(x, w, ids, ew), 0.99999, 1e-4)  # float32 against float64


def test_custom_math_and_biases_match_the_reference(tmp_path: Path) -> None:
    """gpt-oss's shape: its own gated activation (no kernel has it built in) and per-expert biases."""
    ew, _ = _experts(tmp_path, "Q8_0")
    n_e, f, d = ew.gate.shape
    gen = torch.Generator().manual_seed(3)
    biases = ExpertBiases(torch.randn(n_e, f, generator=gen), torch.randn(n_e, f, generator=gen),
                          torch.randn(n_e, d, generator=gen))  # fmt: skip

    def glu(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        g = g.clamp(max=7.0)
        return (u.clamp(-7.0, 7.0) + 1) * g * torch.sigmoid(1.702 * g)

    math = ExpertMath(glu=glu, biases=biases, act=None)
    experts = choose(ew, math, None, 0)
    assert isinstance(experts, HostExperts)  # no in-place kernel computes a family's own activation
    x, w, ids = _routing(4, n_e, 2, d, seed=1)
    _close(experts.mix(x, w, ids), reference(x, w, ids, ew, math), 0.99999, 1e-4)


def test_cpu_in_place_experts_match_the_reference(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode on the CPU from the Q4_K blocks against 8-bit activations: the bound of rounded computation."""
    from engine.experts.cpu_q4k import available

    ok, why = available()
    if not ok:
        pytest.skip(f"the Q4_K CPU kernels cannot run here: {why}")
    monkeypatch.setenv("STRATA_ACTIVATIONS", "int8")
    ew, experts = _experts(tmp_path, "Q4_K")
    assert isinstance(experts, CpuInPlaceExperts)
    n_e, _, d = ew.gate.shape
    x, w, ids = _routing(3, n_e, 2, d, seed=2)
    _close(experts.mix(x, w, ids), reference(x, w, ids, ew), 0.999, 5e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q8_0", "IQ4_XS", "Q4_0"])
@pytest.mark.parametrize("slots", [None, 3])
def test_cached_experts_match_the_reference(tmp_path: Path, qtype: str, slots: int | None) -> None:
    """CUDA: the fused decode kernels (1-8 rows), the grouped prompt kernels (64 rows) and the per-expert path,
    with every expert in VRAM and with most of them in host RAM (3 slots)."""
    from engine.experts.policy import ExpertPolicy

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    ew, experts = _experts(tmp_path, qtype, device="cuda", experts=ExpertPolicy(slots=slots))
    assert isinstance(experts, CachedExperts)
    n_e, _, d = ew.gate.shape
    for t in (1, 4, 8, 64):
        x, w, ids = _routing(t, n_e, 2, d, seed=t)
        got = experts.mix(x.cuda(), w.cuda(), ids.cuda())
        want = reference(x, w, ids, ew)  # the experts' blocks stay in host RAM on CUDA
        _close(got, want, 0.9999, 1e-2)


def test_a_routing_trace_records_and_replays_the_choices(tmp_path: Path) -> None:
    """Recording changes nothing; replaying the record gives the same logits; replaying other choices gives those
    experts with the router's own weights for them; a trace that does not fit the run is refused by name."""
    path = write_tiny_model(tmp_path / "q2.gguf", "qwen2moe", "Q8_0")
    m = load_model(path, device="cpu", dtype="f32").model
    ids = torch.tensor([1, 17, 42, 99, 150, 7, 300, 12])
    plain = m.forward(ids, m.new_cache(64, "f32"), 0)
    with route_trace(RouteTrace()) as rec:
        recorded = m.forward(ids, m.new_cache(64, "f32"), 0)
    moe_layers = [i for i, lw in m.layers.items() if lw.experts is not None]
    assert len(rec.ids) == len(moe_layers) and all(t.shape == (8, 2) for t in rec.ids)
    assert torch.equal(recorded, plain)
    with route_trace(RouteTrace(rec.ids)) as rep:
        assert torch.equal(m.forward(ids, m.new_cache(64, "f32"), 0), plain)
    assert rep.used == len(rec.ids)
    other = [(t + 1) % 8 for t in rec.ids]
    with route_trace(RouteTrace(other)):
        moved = m.forward(ids, m.new_cache(64, "f32"), 0)
    assert (moved - plain).abs().max().item() > 1e-3

    i = moe_layers[0]
    router = m.layers[i].experts.router
    x = torch.randn(8, router.shape[-1])
    probs = torch.softmax(router.linear(x), dim=-1)
    for norm in (False, True):
        with route_trace(RouteTrace([other[0]])):
            w, got = route(x, router, 2, norm)
        want = probs.gather(-1, other[0])
        assert torch.equal(got, other[0])
        assert torch.allclose(w, want / want.sum(-1, keepdim=True) if norm else want)
    with route_trace(RouteTrace([])), pytest.raises(RuntimeError, match="holds 0 calls"):
        route(x, router, 2, False)
    with route_trace(RouteTrace([other[0][:3]])), pytest.raises(ValueError, match="replay the same inputs"):
        route(x, router, 2, False)


def test_bf16_follows_float32_when_it_takes_the_same_expert_choices(tmp_path: Path) -> None:
    """The GPU suite's qwen2moe-IQ4_XS case on the CPU: bf16 compute against float32 compute, bf16 taking
    float32's expert choices (on the CPU its rounding happens to keep them; on CUDA it flips one)."""
    path = write_tiny_model(tmp_path / "q2.gguf", "qwen2moe", "IQ4_XS", seed=3)
    ids = torch.tensor([1, 17, 42, 99, 150, 7, 300, 12, 5, 64, 128, 256, 33, 71, 200, 11, 90, 45, 13, 180])
    m32 = load_model(path, device="cpu", dtype="f32").model
    with route_trace(RouteTrace()) as rec:
        want = m32.forward(ids, m32.new_cache(64, "f32"), 0)
    m16 = load_model(path, device="cpu", dtype="bf16").model
    with route_trace(RouteTrace(rec.ids)):
        got = m16.forward(ids, m16.new_cache(64, "bf16"), 0)
    cos = torch.nn.functional.cosine_similarity(got.flatten().double(), want.flatten().double(), dim=0).item()
    assert cos >= 0.999, f"cosine {cos:.6f}"
