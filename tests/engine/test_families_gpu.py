"""The four families on CUDA: against HF transformers (float32 bounds and greedy tokens, bf16 cosine), through the
expert cache (fused block-format kernels with the families' own routing and expert biases) at several fractions of
the experts in VRAM, CUDA-graph decode equal to eager decode (the recurrent state stepped once per token), and
Qwen3-Next's prompt chunks on the card."""

from pathlib import Path

import pytest
import torch

from engine.experts.policy import ExpertPolicy
from engine.pipeline.generate import DoneEvent, GenerationRequest, Runner
from engine.pipeline.loader import load_model
from engine.pipeline.sampling import GREEDY
from engine.testing.tiny_families import FAMILIES, write_tiny_family
from tests.engine.hf_reference import hf_greedy, hf_logits
from tests.engine.hf_reference_families import hf_family_model

pytestmark = pytest.mark.gpu
PROMPT = [1, 17, 42, 99, 150, 7, 300, 12, 5, 64, 128, 256, 33, 71, 200, 11, 90, 45, 13, 180]
CASES = [
    ("gpt-oss", "Q8_0", {"_exps": "MXFP4"}),  # MXFP4 experts: no fused kernel yet, expert by expert
    ("gpt-oss", "Q4_K", None),  # fused kernels with the expert biases and the clamped SwiGLU
    ("qwen3next", "Q4_K", {"ffn_down": "Q6_K"}),
    ("deepseek2", "Q8_0", None),
    ("glm4moe", "Q4_K", None),
]
# Fused expert kernels: the decode step can be captured.
GRAPH_TYPES = {"gpt-oss": "Q4_K", "qwen3next": "Q4_K", "deepseek2": "Q8_0", "glm4moe": "Q4_K"}


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0).item()


def _greedy(path: Path, n: int = 24, **kw: object) -> tuple[list[int], object]:
    lm = load_model(path, device="cuda", dtype="f32", **kw)  # type: ignore[arg-type]
    runner = Runner(lm.model, lm.tokenizer, 256, "f32")
    req = GenerationRequest(PROMPT, max_tokens=n, sampling=GREEDY, ignore_eos=True)
    return next(e for e in runner.generate(req) if isinstance(e, DoneEvent)).tokens, lm


@pytest.mark.parametrize(("arch", "qtype", "types"), CASES, ids=[f"{a}-{q}" for a, q, _ in CASES])
def test_cuda_matches_transformers(
    tmp_path: Path, arch: str, qtype: str, types: dict[str, str] | None
) -> None:
    path = write_tiny_family(tmp_path / f"{arch}.gguf", arch, qtype=qtype, seed=3, types=types)
    ref_model = hf_family_model(path)
    ref = hf_logits(ref_model, PROMPT)
    for dtype, min_cos in (("f32", 0.9999), ("bf16", 0.999)):
        lm = load_model(path, device="cuda", dtype=dtype)
        cache = lm.model.new_cache(64, "f32" if dtype == "f32" else "bf16")
        ours = lm.model.forward(torch.tensor(PROMPT), cache, 0).cpu()
        assert _cos(ours, ref) >= min_cos, dtype
        if dtype == "f32":
            assert (ours - ref).abs().max().item() <= 1e-3
    tokens, _ = _greedy(path, 32)
    assert tokens == hf_greedy(ref_model, PROMPT, 32)


@pytest.mark.parametrize("arch", FAMILIES)
def test_cuda_graph_decode_equals_eager_and_expert_cache_fractions(tmp_path: Path, arch: str) -> None:
    path = write_tiny_family(tmp_path / f"{arch}.gguf", arch, qtype=GRAPH_TYPES[arch], seed=5)
    eager, _ = _greedy(path, cuda_graphs=False)
    graphed, lm = _greedy(path, cuda_graphs=True)
    graphs = lm.model.graphs  # type: ignore[attr-defined]
    assert graphs is not None and graphs.usable and graphs.graphs
    assert graphed == eager
    cache = lm.model.expert_cache  # type: ignore[attr-defined]
    total = cache.stats().experts_total
    for slots in (0, total // 2):
        tokens, lm2 = _greedy(path, experts=ExpertPolicy(slots=slots))
        st = lm2.model.expert_cache.stats()  # type: ignore[attr-defined]
        assert st.experts_in_vram == slots and st.misses > 0
        assert tokens == eager


def test_qwen3next_prompt_chunks_on_cuda(tmp_path: Path) -> None:
    path = write_tiny_family(tmp_path / "q3n.gguf", "qwen3next", qtype="Q8_0", seed=7)
    ids = torch.randint(0, 500, (150,), generator=torch.Generator().manual_seed(0)).tolist()
    m = load_model(path, device="cuda", dtype="f32").model
    one = m.forward(torch.tensor(ids), m.new_cache(256, "f32"), 0)
    cache = m.new_cache(256, "f32")
    parts, at = [], 0
    for n in (7, 13, 1, 64, 65):
        parts.append(m.forward(torch.tensor(ids[at : at + n]), cache, at))
        at += n
    assert (torch.cat(parts) - one).abs().max().item() <= 1e-4


def test_qwen3next_fused_delta_step_matches_the_torch_ops(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decode step's delta-net layers in two launches each (engine/kernels/delta_net.py) give the torch ops'
    logits, step after step (the states carried by both), and the same greedy tokens."""
    import engine.models.qwen3next as q3n

    path = write_tiny_family(tmp_path / "q3n.gguf", "qwen3next", qtype="Q8_0", seed=7)
    m = load_model(path, device="cuda", dtype="f32").model
    logits = {}
    for fused in (False, True):
        monkeypatch.setattr(q3n, "fused_delta_net", lambda dk, dv, on=fused: on)
        cache = m.new_cache(256, "f32")
        m.forward(torch.tensor(PROMPT), cache, 0)
        steps = [m.forward(torch.tensor([t]), cache, len(PROMPT) + n) for n, t in enumerate(PROMPT[:12])]
        logits[fused] = torch.cat(steps)
    assert (logits[True] - logits[False]).abs().max().item() <= 1e-4
    monkeypatch.setattr(q3n, "fused_delta_net", lambda dk, dv: False)
    plain, _ = _greedy(path)
    monkeypatch.setattr(q3n, "fused_delta_net", lambda dk, dv: True)
    fused_tokens, _ = _greedy(path)
    assert fused_tokens == plain
