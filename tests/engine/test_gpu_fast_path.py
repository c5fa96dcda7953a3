"""The CUDA decode path: block-format GEMV kernels, the fused MoE kernels reading through the expert table,
CUDA-graph decode, and the expert cache at 0%, 25% and 100% of the experts in VRAM."""

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as QT

from engine.experts.policy import ExpertPolicy
from engine.gguf.quants import dequantize
from engine.gguf.random_blocks import random_blocks
from engine.pipeline.generate import DoneEvent, GenerationRequest, Runner
from engine.pipeline.loader import load_model
from engine.pipeline.sampling import GREEDY

pytestmark = pytest.mark.gpu
KTYPES = ["Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q4_0"]
PROMPT = [1, 17, 42, 99, 150, 7, 300, 12, 5, 64, 128, 256, 33, 71]


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0).item()


@pytest.mark.parametrize("qtype", KTYPES)
def test_gemv_kernels_match_dequantize_and_matmul(qtype: str) -> None:
    from engine.kernels.gemv import gemv, moe_gemv

    qt = QT[qtype]
    n, k, e = 384, 1024, 6
    raw = torch.from_numpy(random_blocks(qt, n, k, seed=1)).cuda()
    x = torch.randn(3, k, device="cuda")
    ref = x @ dequantize(raw, qt).T
    y = gemv(raw, qt, n, k, x)
    assert _cos(y, ref) >= 0.9999 and (y - ref).abs().max().item() <= 1e-3 * ref.abs().max().item()
    gates = [torch.from_numpy(random_blocks(qt, n, k, seed=10 + i)).cuda() for i in range(e)]
    ups = [
        torch.from_numpy(random_blocks(qt, n, k, seed=20 + i)).pin_memory() for i in range(e)
    ]  # host: PCIe reads
    gt = torch.tensor([g.data_ptr() for g in gates], device="cuda")
    ut = torch.tensor([u.data_ptr() for u in ups], device="cuda")
    ids = torch.tensor([[1, 4], [0, 5], [3, 1]], device="cuda")
    y = moe_gemv(gt, qt, gates[0].shape[1], ids, x, n, k, 2, up_table=ut, act="silu")
    ref = torch.stack(
        [
            torch.nn.functional.silu(x[t] @ dequantize(gates[i], qt).T)
            * (x[t] @ dequantize(ups[i].cuda(), qt).T)
            for t in range(3)
            for i in ids[t].tolist()
        ]
    )
    assert _cos(y, ref) >= 0.9999


def _greedy(path: Path, n: int = 24, **kw) -> tuple[list[int], object]:
    lm = load_model(path, device="cuda", dtype="f32", **kw)
    runner = Runner(lm.model, lm.tokenizer, 512, "f32")
    done = [
        e
        for e in runner.generate(GenerationRequest(PROMPT, max_tokens=n, sampling=GREEDY, ignore_eos=True))
        if isinstance(e, DoneEvent)
    ][0]
    return done.tokens, lm


def test_cuda_graph_decode_equals_eager(moe_q4k: Path) -> None:
    eager, _ = _greedy(moe_q4k, cuda_graphs=False)
    graphed, lm = _greedy(moe_q4k, cuda_graphs=True)
    assert lm.model.graphs is not None and lm.model.graphs.usable and lm.model.graphs.graphs
    assert graphed == eager


@pytest.mark.parametrize("fraction", [0.0, 0.25, 1.0])
def test_expert_cache_fractions_give_identical_tokens(moe_q4k: Path, fraction: float) -> None:
    full, _ = _greedy(moe_q4k)
    n_pairs = 2 * 8  # the tiny model: 2 layers x 8 experts
    tokens, lm = _greedy(moe_q4k, experts=ExpertPolicy(slots=int(n_pairs * fraction)))
    st = lm.model.expert_cache.stats()
    assert st.experts_in_vram == int(n_pairs * fraction)
    assert tokens == full
    if fraction == 0.0:
        assert st.hits == 0 and st.misses > 0
    if fraction == 1.0:
        assert st.misses == 0 and st.hits > 0


def test_adaptive_swaps_keep_the_output(moe_q4k: Path) -> None:
    full, _ = _greedy(moe_q4k)
    lm = load_model(moe_q4k, device="cuda", dtype="f32", experts=ExpertPolicy(slots=6))
    runner = Runner(lm.model, lm.tokenizer, 512, "f32")
    out = []
    gen = runner.generate(GenerationRequest(PROMPT, max_tokens=24, sampling=GREEDY, ignore_eos=True))
    swaps = 0
    for ev in gen:
        if isinstance(ev, DoneEvent):
            out = ev.tokens
        else:
            swaps += lm.model.expert_cache.adapt(lm.model.expert_counts.cpu(), max_swaps=2)
    assert swaps > 0
    assert lm.model.expert_cache.stats().swaps == swaps
    assert out == full


@pytest.mark.parametrize("neox", [True, False])
def test_fused_norm_and_rope_match_the_torch_path(neox: bool) -> None:
    from engine.gguf.model_config import RopeConfig
    from engine.kernels.fused import norm_rope
    from engine.kernels.fused import rms_norm as fused_rms
    from engine.layers.rope import Rope

    x = torch.randn(5, 2048, device="cuda")
    w = torch.randn(2048, device="cuda")
    xf = x.float()
    ref = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    assert (fused_rms(x, w, 1e-6, torch.float32) - ref).abs().max().item() < 1e-4
    for rot in (128, 64):
        rope = Rope(RopeConfig(dim=rot, base=1e6, neox=neox, scaling="yarn", factor=4.0, orig_ctx=4096))
        q, qw = torch.randn(5, 8, 128, device="cuda"), torch.randn(128, device="cuda")
        pos = torch.tensor([0, 7, 100, 4000, 30000], device="cuda")
        qn = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + 1e-6) * qw
        # The kernel takes float32 angles (as HF computes them); the reference here does too.
        theta = pos.float()[:, None] * rope.inv_freq_effective.cuda()[None, :]
        expect = rope.apply(qn, theta.cos() * rope.mscale, theta.sin() * rope.mscale)
        got = norm_rope(q, qw, 1e-6, pos, rope.inv_freq_effective.cuda(), rot, neox, rope.mscale)
        assert (got - expect).abs().max().item() < 1e-3


def test_fused_router_matches_softmax_topk_and_counts() -> None:
    from engine.kernels.fused import route

    for e, k, norm in ((128, 8, True), (60, 4, False), (512, 10, True)):
        logits = torch.randn(5, e, device="cuda") * 3
        counts = torch.zeros(e, dtype=torch.int64, device="cuda")
        w, ids = route(logits, k, norm, counts)
        rw, rid = torch.topk(torch.softmax(logits, -1), k)
        if norm:
            rw = rw / rw.sum(-1, keepdim=True)
        assert torch.equal(ids, rid)
        assert (w - rw).abs().max().item() < 1e-6
        assert torch.equal(counts, torch.bincount(rid.flatten(), minlength=e))


@pytest.mark.parametrize("sb", [1, 2, 4, 8])
@pytest.mark.parametrize("block_n", [4, 16])
def test_q4k_launch_shapes_agree(sb: int, block_n: int) -> None:
    from engine.kernels.gemv import gemv

    n, k = 300, 1280  # 5 super-blocks a row: steps of 2, 4 and 8 end part-full
    raw = torch.from_numpy(random_blocks(QT.Q4_K, n, k, seed=2)).cuda()
    x = torch.randn(1, k, device="cuda")
    ref = x @ dequantize(raw, QT.Q4_K).T
    y = gemv(raw, QT.Q4_K, n, k, x, block_n=block_n, sb=sb)
    assert (y - ref).abs().max().item() <= 1e-4 * ref.abs().max().item() + 1e-5


@pytest.mark.parametrize("fraction", [0.0, 0.25])
def test_staged_misses_give_identical_tokens(moe_q4k: Path, fraction: float) -> None:
    """--expert-misses copy: missed experts copied into VRAM before the kernels, with CUDA graphs; same tokens."""
    full, _ = _greedy(moe_q4k)
    n_pairs = 2 * 8
    tokens, lm = _greedy(moe_q4k, experts=ExpertPolicy(slots=int(n_pairs * fraction), miss_path="copy"))
    cache = lm.model.expert_cache
    assert cache.stager is not None  # the staging path ran
    assert tokens == full
    assert cache.stats().misses > 0


@pytest.mark.parametrize(("fraction", "ratio"), [(0.0, 1.0), (0.25, 1.0), (0.0, 0.5)])
def test_cpu_computed_misses_stay_close_to_the_gpu_ones(moe_q4k: Path, fraction: float, ratio: float) -> None:
    """--cpu-experts 1: every missed expert of a decode step (ratio 1), or half of them beside the GPU's copies
    (ratio 0.5), is computed on the CPU (torch's 4-bit kernel on bf16 activations and scales; Q6_K down projections
    as bf16 matrices), handed over through the mailboxes inside the decode graphs. The CPU rounds differently from
    the GPU's kernels, so the logits are compared by cosine (>= 0.999) rather than the greedy tokens."""
    cm, model = _cpu_share_matches(moe_q4k, "bf16", fraction, ratio)
    assert cm is not None and model.graphs.usable  # no host sync: decode steps are still CUDA graphs
    assert cm.slots > 0  # the CPU did compute experts
    assert cm.timing()["requests"] >= 8  # one a layer and step at least, answered by the host


def _cpu_share_matches(
    path: Path, kv: str, fraction: float = 0.0, ratio: float = 1.0, fast: bool = True
) -> tuple[object, object]:
    """The decode steps of `path` with the CPU computing `ratio` of the missed experts (`fraction` of them in
    VRAM) against all experts in VRAM, on `kv` caches: cosine >= 0.999 at each of 8 steps; (the hybrid's
    CpuMisses or None, its model). `fast=False`: the hybrid decodes through the general layer."""
    full = load_model(path, device="cuda", dtype="bf16")
    hyb = load_model(path, device="cuda", dtype="bf16",
                     experts=ExpertPolicy(slots=int(16 * fraction), cpu_share=1.0, cpu_ratio=ratio))  # fmt: skip
    if not fast:  # before the first step: its graphs are captured from that layer
        hyb.model.fast = False
    _steps_match(full.model, hyb.model, kv)
    return hyb.model.expert_cache.cpu_misses, hyb.model


def _steps_match(ref_model: object, model: object, kv: str) -> None:
    """PROMPT, then 8 greedy steps (ref_model's tokens) on `kv` caches: model's logits within cosine 0.999 of
    ref_model's at each step."""
    caches = [m.new_cache(64, kv) for m in (ref_model, model)]  # type: ignore[attr-defined]
    ids = torch.tensor(PROMPT)
    for m, c in zip((ref_model, model), caches, strict=True):
        m.forward(ids, c, 0, last_only=True)  # type: ignore[attr-defined]
    tok = torch.tensor([42])
    for p in range(len(PROMPT), len(PROMPT) + 8):
        ref = ref_model.forward(tok, caches[0], p)  # type: ignore[attr-defined]
        got = model.forward(tok, caches[1], p)  # type: ignore[attr-defined]
        assert _cos(got, ref) >= 0.999, p
        tok = ref[-1].argmax().view(1).cpu()


def test_cpu_share_on_the_general_decode_path(moe_q4k: Path) -> None:
    """Decode through the general layer (not fast_decode's; int8 KV against the fused path's): the CPU's share
    goes through the expert backend there too, inside the decode graphs (before, the graphs waited 30 s for layers
    that never posted and then failed)."""
    cm, model = _cpu_share_matches(moe_q4k, "int8", fast=False)
    assert cm is not None and model.graphs.usable
    assert cm.slots > 0 and cm.timing()["requests"] >= 8


@pytest.mark.parametrize("kv", ["int8", "q4_0"])
def test_quantized_kv_decodes_on_the_fused_path(moe_q4k: Path, kv: str) -> None:
    """An int8 or q4_0 KV cache decodes through fast_decode (rope_store writes the codes, decode_attention reads
    them), one sequence and slots sharing a cache: logits against the general layer's on the same cache type."""
    fused = load_model(moe_q4k, device="cuda", dtype="bf16")
    plain = load_model(moe_q4k, device="cuda", dtype="bf16")
    plain.model.fast = False
    assert fused.model.fast and fused.model.slotted(kv)
    _steps_match(plain.model, fused.model, kv)
    slots = fused.model.new_caches(2, 64, kv)
    assert slots[0].shared is not None and slots[0].layers[0].k_scale is not None


def test_cpu_share_in_a_family_model(tmp_path: Path) -> None:
    """GLM-4.5's family model (its own layer code) hands its misses to the CPU through the same backend."""
    from engine.testing.tiny_families import write_tiny_family

    path = write_tiny_family(tmp_path / "glm.gguf", "glm4moe", qtype="Q4_K", seed=3)
    cm, _ = _cpu_share_matches(path, "bf16")
    assert cm is not None and cm.slots > 0


def test_cpu_share_leaves_biased_experts_to_the_gpu(tmp_path: Path) -> None:
    """gpt-oss's experts have biases and a clamped SwiGLU the CPU's kernels do not compute: its layers are dropped
    from the CPU's share, and decode neither waits for them nor changes."""
    from engine.testing.tiny_families import write_tiny_family

    path = write_tiny_family(tmp_path / "oss.gguf", "gpt-oss", qtype="Q4_K", seed=3)
    cm, _ = _cpu_share_matches(path, "bf16")
    assert cm is None
