"""The fused decode layer (engine.models.fast_decode) and its kernels against the general torch path: attention
from the cache against SDPA, norm + RoPE + cache write against Rope, the residual GEMV and the experts' down
projection with the combine against dequantize + matmul, and whole models' greedy tokens with the path on and off."""

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as QT

from engine.gguf.quants import dequantize
from engine.gguf.random_blocks import random_blocks
from engine.layers.attention import attention, causal_mask
from engine.pipeline.generate import DoneEvent, GenerationRequest, Runner
from engine.pipeline.loader import load_model
from engine.pipeline.sampling import GREEDY
from engine.testing.tiny_models import write_tiny_model

pytestmark = pytest.mark.gpu
# Longer than a fused step's rows (FAST_MAX_ROWS, 16): the prompt then takes the general path in both runs. A prompt
# of up to 16 rows would run the fused rows, on 8-bit activations, where the general path's prompt products are float.
PROMPT = [1, 17, 42, 99, 150, 7, 300, 12, 5, 64, 128, 256, 33, 71, 90, 3, 211, 48, 160, 29, 270, 8, 133, 56]


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0).item()


@pytest.mark.parametrize(
    "t,h,hkv,d,span,window,dtype,chunk",
    [
        (1, 32, 4, 128, 256, 0, torch.bfloat16, 512),  # Qwen3-30B-A3B's heads, one program per key head
        (1, 32, 4, 128, 3000, 0, torch.bfloat16, 512),  # split over the span, merged
        (4, 8, 2, 64, 300, 0, torch.float32, 64),  # a verify window of 4 rows, causal among them
        (2, 8, 8, 256, 700, 128, torch.float32, 128),  # sliding window, no grouping, head dim 256
        (
            1,
            32,
            4,
            128,
            4096,
            0,
            torch.bfloat16,
            None,
        ),  # the default split of a long span (32 programs a head)
        (5, 32, 4, 128, 1000, 0, torch.float32, None),  # a verify window over the default split
    ],
)
def test_decode_attention_matches_sdpa(t, h, hkv, d, span, window, dtype, chunk) -> None:
    from engine.kernels.attention import decode_attention

    kc = torch.randn(span + 7, hkv, d, device="cuda").to(dtype)
    vc = torch.randn(span + 7, hkv, d, device="cuda").to(dtype)
    pos = torch.arange(span - t, span, device="cuda")
    q = torch.randn(t, h, d, device="cuda").to(dtype)
    got = decode_attention(q, kc, vc, pos, span, window, d**-0.5, chunk=chunk).float()
    ref = attention(q.float(), kc[:span].float(), vc[:span].float(), causal_mask(pos, span, window), d**-0.5)
    ref = ref.reshape(t, -1)
    assert _cos(got, ref) >= (0.9999 if dtype == torch.float32 else 0.999)
    if dtype == torch.float32:
        assert (got - ref).abs().max().item() < 1e-4
    if (
        d % 32 == 0
    ):  # the 8-bit form for the output projection, written by the kernel (or the merge, for split
        # spans): quantize_q8's bytes of the float32 output
        from engine.kernels.gemv import quantize_q8_torch

        aq = torch.empty(t, h * d, device="cuda")
        out = decode_attention(q, kc, vc, pos, span, window, d**-0.5, chunk=chunk, q8_out=aq)
        n = h * d + h * d // 4
        want = quantize_q8_torch(out.float()).view(torch.uint8)[:, :n]
        if dtype == torch.float32:
            assert torch.equal(aq.view(torch.uint8)[:, :n], want)
        else:  # the kernels round the float32 output, before its cast to the compute type
            raw = aq.view(torch.uint8)
            codes = raw[:, : h * d].contiguous().view(torch.int8).float().view(t, -1, 32)
            scales = raw[:, h * d : n].contiguous().view(torch.float32).view(t, -1, 2)[..., :1]
            assert _cos((codes * scales).view(t, -1), out.float()) >= 0.999


@pytest.mark.parametrize("kv", ["bf16", "int8", "q4_0"])
@pytest.mark.parametrize("t", [1, 3])
def test_split_decode_matches_sdpa_deep_in_the_cache(kv: str, t: int) -> None:
    """The split decode on the card, Qwen3-30B-A3B's heads over 4,100 positions (splits that end mid-block), every
    KV type, one row and a verify window of three, against SDPA's attention over the dequantized cache."""
    from engine.kernels.attention import decode_attention
    from engine.layers.kv_cache import dequantize_kv, quantize_kv

    h, hkv, d, span = 32, 4, 128, 4100
    k = torch.randn(span, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(span, hkv, d, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(t, h, d, device="cuda", dtype=torch.bfloat16)
    pos = torch.arange(span - t, span, device="cuda")
    (kc, ks), (vc, vs) = quantize_kv(kv, k), quantize_kv(kv, v)
    k, v = dequantize_kv(kv, kc, ks, torch.float32), dequantize_kv(kv, vc, vs, torch.float32)
    got = decode_attention(q, kc, vc, pos, span, 0, d**-0.5, k_scale=ks, v_scale=vs).float()
    ref = attention(q.float(), k.float(), v.float(), causal_mask(pos, span, 0), d**-0.5).reshape(t, -1)
    assert _cos(got, ref) >= 0.999


@pytest.mark.parametrize("neox", [True, False])
def test_rope_store_matches_rope_and_writes_the_cache(neox: bool) -> None:
    from engine.gguf.model_config import RopeConfig
    from engine.kernels.attention import rope_store
    from engine.layers.rope import Rope

    t, h, hkv, d = 3, 8, 2, 128
    rope = Rope(RopeConfig(dim=64, base=1e6, neox=neox, scaling="yarn", factor=4.0, orig_ctx=4096))
    qkv = torch.randn(t, (h + 2 * hkv) * d, device="cuda")
    qn, kn = torch.rand(d, device="cuda") + 0.5, torch.rand(d, device="cuda") + 0.5
    kc, vc = torch.zeros(64, hkv, d, device="cuda"), torch.zeros(64, hkv, d, device="cuda")
    pos = torch.tensor([5, 6, 40], device="cuda")
    q, k, v = qkv[:, : h * d], qkv[:, h * d : (h + hkv) * d], qkv[:, (h + hkv) * d :]
    qo = rope_store(q, k, v, qn, kn, 1e-6, pos, rope.inv_effective(torch.device("cuda")), 64, neox,
                    rope.mscale, kc, vc, h, torch.float32)  # fmt: skip

    def ref(x: torch.Tensor, w: torch.Tensor, heads: int) -> torch.Tensor:
        x = x.reshape(t, heads, d)
        xn = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
        theta = pos.float()[:, None] * rope.inv_freq_effective.cuda()[None, :]
        return rope.apply(xn, theta.cos() * rope.mscale, theta.sin() * rope.mscale)

    assert (qo - ref(q, qn, h)).abs().max().item() < 1e-4
    assert (kc[pos] - ref(k, kn, hkv)).abs().max().item() < 1e-4
    assert torch.equal(vc[pos], v.reshape(t, hkv, d))
    untouched = torch.ones(64, dtype=torch.bool, device="cuda")
    untouched[pos] = False
    assert kc[untouched].abs().max().item() == 0 and vc[untouched].abs().max().item() == 0


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q4_0"])
def test_residual_gemv_and_expert_combine(qtype: str) -> None:
    from engine.kernels.gemv import gemv, moe_down_combine

    qt = QT[qtype]
    n, k, e, topk, t = 256, 768, 6, 3, 2
    raw = torch.from_numpy(random_blocks(qt, n, k, seed=4)).cuda()
    x, r = torch.randn(t, k, device="cuda"), torch.randn(t, n, device="cuda")
    ref = r + x @ dequantize(raw, qt).T
    assert _cos(gemv(raw, qt, n, k, x, residual=r), ref) >= 0.9999
    ws = [torch.from_numpy(random_blocks(qt, n, k, seed=30 + i)) for i in range(e)]
    ws = [w.cuda() if i % 2 else w.pin_memory() for i, w in enumerate(ws)]  # VRAM and host experts
    table = torch.tensor([w.data_ptr() for w in ws], device="cuda")
    ids = torch.tensor([[1, 4, 2], [0, 5, 1]], device="cuda")
    wt = torch.rand(t, topk, device="cuda")
    xs = torch.randn(t * topk, k, device="cuda")
    got = moe_down_combine(table, qt, ws[0].shape[1], ids, wt, xs, r, n, k)
    expect = r.clone()
    for ti in range(t):
        for j in range(topk):
            w = dequantize(ws[int(ids[ti, j])].cuda(), qt)
            expect[ti] += wt[ti, j] * (xs[ti * topk + j] @ w.T)
    assert _cos(got, expect) >= 0.9999


def _tokens(path: Path, dtype: str, fast: bool, n: int = 24) -> tuple[list[int], torch.Tensor]:
    from engine.models.fast_decode import FAST_MAX_ROWS

    assert len(PROMPT) - 1 > FAST_MAX_ROWS
    lm = load_model(path, device="cuda", dtype=dtype)
    lm.model.fast = fast and lm.model.fast
    runner = Runner(lm.model, lm.tokenizer, 512, dtype)
    done = [
        e
        for e in runner.generate(GenerationRequest(PROMPT, max_tokens=n, sampling=GREEDY, ignore_eos=True))
        if isinstance(e, DoneEvent)
    ][0]
    cache = lm.model.new_cache(64, "f32" if dtype == "f32" else "bf16")
    lm.model.forward(torch.tensor(PROMPT[:-1], device="cuda"), cache, 0)
    logits = lm.model.forward(torch.tensor(PROMPT[-1:], device="cuda"), cache, len(PROMPT) - 1)
    return done.tokens, logits


@pytest.mark.parametrize(
    "arch,types",
    [
        ("qwen3moe", {"ffn_down": "Q6_K"}),
        ("qwen2moe", {}),  # biases, a gated shared expert
        ("llama", {"attn_v": "Q6_K"}),  # q, k, v of different types: three GEMVs
        ("qwen3", {}),
    ],
)
@pytest.mark.parametrize("activations", ["float", "int8"])
def test_fused_decode_gives_the_general_paths_tokens(
    tmp_path: Path, arch: str, types: dict, activations: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fused step against the general path, each on float activations and each on 8-bit ones (the general
    path's matrix-vector launches round them too, so the fused step's norm-written rounding must agree)."""
    monkeypatch.setenv("STRATA_ACTIVATIONS", activations)
    path = write_tiny_model(tmp_path / "m.gguf", arch, qtype="Q4_K", types=types, seed=11)
    lm = load_model(path, device="cuda", dtype="f32")
    assert lm.model.fast, "the fused decode path should serve this family"
    general, lg = _tokens(path, "f32", fast=False)
    fused, lf = _tokens(path, "f32", fast=True)
    assert fused == general
    assert _cos(lf, lg) >= 0.99999
    if activations == "int8":
        return
    _, bg = _tokens(path, "bf16", fast=False)
    _, bf = _tokens(path, "bf16", fast=True)
    assert _cos(bf, bg) >= 0.999


@pytest.mark.parametrize(
    "qtype,variant",
    [
        ("Q4_K", 0),
        ("Q4_K", 5),
        ("Q4_K", 10),
        ("Q4_K", 12),
        ("Q6_K", 1),
        ("Q6_K", 11),
        ("Q6_K", 13),
        ("F32", 6),
        ("MXFP4", 8),
        ("IQ4_XS", 9),
    ],
)
@pytest.mark.parametrize("sb", [1, 2, 4])
def test_every_kernel_body_matches_dequantize(qtype: str, variant: int, sb: int) -> None:
    """The tuning file may pick any body for a block type: each must compute the same product, dense and routed."""
    from engine.kernels.gemv import APPROXIMATE, gemv, moe_down_combine, moe_gemv, q8_round

    qt = QT[qtype]
    tol = 0.99999
    # the 8-bit bodies (as llama.cpp's MMVQ) compute on activations rounded by quantize_q8: the reference uses those
    rnd = q8_round if variant in APPROXIMATE else (lambda v: v)
    n, k, e = 200, 1280, 4  # 5 super-blocks a row: steps end part-full
    if qt == QT.F32:
        mats = [torch.randn(n, k) for _ in range(e)]
        raws = [m.view(torch.uint8).cuda() for m in mats]
    else:
        raws = [torch.from_numpy(random_blocks(qt, n, k, seed=50 + i)).cuda() for i in range(e)]
    deq = [dequantize(r, qt) if qt != QT.F32 else r.view(torch.float32) for r in raws]
    x = rnd(torch.randn(2, k, device="cuda"))
    for bn in (2, 8):
        y = gemv(raws[0], qt, n, k, x, block_n=bn, sb=sb, num_warps=4, variant=variant)
        assert _cos(y, x @ deq[0].T) >= tol
    table = torch.tensor([r.data_ptr() for r in raws], device="cuda")
    ids = torch.tensor([[3, 1], [0, 2]], device="cuda")
    h = moe_gemv(table, qt, raws[0].shape[1], ids, x, n, k, 2, up_table=table, act="silu", launch=(4, sb, 4),
                 variant=variant)  # fmt: skip
    ref = torch.stack([torch.nn.functional.silu(x[t] @ deq[i].T) * (x[t] @ deq[i].T)
                       for t in range(2) for i in ids[t].tolist()])  # fmt: skip
    assert _cos(h, ref) >= tol
    wt = torch.rand(2, 2, device="cuda")
    xs = rnd(torch.randn(4, k, device="cuda"))
    r = torch.randn(2, n, device="cuda")
    got = moe_down_combine(
        table, qt, raws[0].shape[1], ids, wt, xs, r, n, k, launch=(4, sb, 4), variant=variant
    )
    want = torch.stack([r[t] + sum(wt[t, j] * (xs[2 * t + j] @ deq[int(ids[t, j])].T) for j in range(2))
                        for t in range(2)])  # fmt: skip
    assert _cos(got, want) >= tol


@pytest.mark.parametrize("qtype", ["Q4_K", "Q4_K:10", "Q5_K", "Q6_K", "Q8_0", "Q4_0", "MXFP4", "IQ4_XS"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_expert_gemm_matches_dequantize(qtype: str, dtype: torch.dtype) -> None:
    """The prompt path's grouped kernel: every slot's expert product, experts in VRAM and in pinned host memory,
    uneven expert loads (one expert with more rows than a block, others with none); 32-element block types with a
    row length that ends part-way through a 256-wide step."""
    from engine.kernels.moe_gemm import Blocks, moe_gemm

    qtype, _, v = qtype.partition(":")  # "Q4_K:10": another tile decoder of the type
    variant = int(v) if v else None
    qt = QT[qtype]
    n, k, e, t, topk = 200, 800 if qtype in ("Q8_0", "Q4_0", "MXFP4") else 768, 6, 90, 3
    gs = [torch.from_numpy(random_blocks(qt, n, k, seed=60 + i)) for i in range(e)]
    us = [torch.from_numpy(random_blocks(qt, n, k, seed=70 + i)) for i in range(e)]
    gs = [w.cuda() if i % 2 else w.pin_memory() for i, w in enumerate(gs)]
    us = [w.cuda() for w in us]
    gt = torch.tensor([w.data_ptr() for w in gs], device="cuda")
    ut = torch.tensor([w.data_ptr() for w in us], device="cuda")
    ids = torch.stack([torch.tensor([0, 1 + i % 2, 3]) for i in range(t)]).cuda()  # 2, 4 and 5 unused
    x = torch.randn(t, k, device="cuda").to(dtype)
    blocks = Blocks(ids, e)
    y = moe_gemm(
        blocks, gt, qt, gs[0].shape[1], x, n, k, topk, t * topk, up_table=ut, act="silu", variant=variant
    )
    dg = [dequantize(w.cuda(), qt) for w in gs]
    du = [dequantize(w, qt) for w in us]
    xf = x.float()
    ref = torch.stack([torch.nn.functional.silu(xf[i] @ dg[j].T) * (xf[i] @ du[j].T)
                       for i in range(t) for j in ids[i].tolist()])  # fmt: skip
    assert _cos(y, ref) >= (0.99999 if dtype == torch.float32 else 0.999)
    xs = torch.randn(t * topk, k, device="cuda").to(dtype)
    y2 = moe_gemm(blocks, gt, qt, gs[0].shape[1], xs, n, k, topk, t * topk, x_per_slot=True, variant=variant)
    ref2 = torch.stack(
        [xs[i * topk + j].float() @ dg[int(ids[i, j])].T for i in range(t) for j in range(topk)]
    )
    assert _cos(y2, ref2) >= (0.99999 if dtype == torch.float32 else 0.999)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q4_0", "MXFP4", "IQ4_XS"])
def test_dequantize_kernel_matches_the_torch_decoder(qtype: str) -> None:
    """The one-launch decoder that prompt-chunk matmuls use, against the torch decoder (itself checked against
    gguf's): the same float32 values, within one rounding."""
    from engine.kernels.dequant import dequantize_rows

    qt = QT[qtype]
    k = 352 if qtype in ("Q8_0", "Q4_0", "MXFP4") else 1280
    raw = torch.from_numpy(random_blocks(qt, 77, k, seed=3)).cuda()
    want = dequantize(raw, qt)
    got = dequantize_rows(raw, qt, k, torch.float32)
    assert (got - want).abs().max().item() <= 1e-6 * want.abs().max().item()
    assert _cos(dequantize_rows(raw, qt, k, torch.bfloat16), want) >= 0.99999


def test_prompt_attention_runs_on_the_memory_efficient_kernel() -> None:
    """Grouped heads with a mask (a prompt chunk after earlier chunks, a sliding window): the memory-efficient
    kernel must take it (it raises here if it cannot), not torch's float32 math path; same result as that path."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    t, s, h, hkv, d = 300, 700, 16, 4, 128
    q = torch.randn(t, h, d, device="cuda", dtype=torch.bfloat16)
    kc = torch.randn(s, hkv, d, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn(s, hkv, d, device="cuda", dtype=torch.bfloat16)
    mask = causal_mask(torch.arange(s - t, s, device="cuda"), s, 256)
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        got = attention(q, kc, vc, mask, d**-0.5)
    with sdpa_kernel([SDPBackend.MATH]):
        want = attention(q.float(), kc.float(), vc.float(), mask, d**-0.5)
    assert _cos(got, want) >= 0.9999


@pytest.mark.parametrize("t,topk,e", [(9, 2, 4), (512, 8, 128), (4096, 8, 128), (64, 10, 512)])
def test_block_table_matches_the_torch_schedule(t: int, topk: int, e: int) -> None:
    """The grouped kernel's block table and the pairs' order by expert, each from one launch, against the torch
    ops they replace (a stable argsort for the order)."""
    from engine.kernels import moe_gemm
    from engine.kernels.moe_blocks import Blocks

    ids = torch.stack([torch.randperm(e)[:topk] for _ in range(t)])
    ids[: t // 2, 0] = 0  # one expert with more pairs than a block, and than the order kernel's 1,024 tile
    ids = ids.cuda()
    ref, got = Blocks(ids, e), Blocks(ids, e, moe_gemm.block_table, moe_gemm.expert_order)
    assert torch.equal(got.order, ref.order)
    n = int(ref.nblocks)
    assert int(got.nblocks) == n
    for name in ("expert", "start", "end"):
        assert torch.equal(getattr(got, name)[:n], getattr(ref, name)[:n]), name


def test_int8_activations_stay_close_to_the_float_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--activations int8 (the default; the shipped tuning file names 8-bit bodies for Q4_K and Q6_K): the fused
    decode step reads activations rounded to 8 bits (written by the norms, rounded in one launch before the output
    and down projections and the head); its logits stay within that rounding of the float activations' logits."""
    from engine.kernels import gemv as kernels

    path = write_tiny_model(tmp_path / "m.gguf", "qwen3moe", qtype="Q4_K", types={"output": "Q6_K"}, seed=11)
    monkeypatch.setenv("STRATA_ACTIVATIONS", "float")
    tf, lg = _tokens(path, "f32", fast=True)
    monkeypatch.setenv("STRATA_ACTIVATIONS", "int8")
    for cls in ("moe", "moe_down", "dense"):
        assert kernels.wants_q8(kernels.QT.Q4_K, 64, 256, cls), cls
    assert kernels.wants_q8(kernels.QT.Q6_K, 151936, 2048)
    tq, lq = _tokens(path, "f32", fast=True)
    assert not torch.equal(lq, lg)  # the 8-bit bodies did run
    assert _cos(lq, lg) >= 0.999
    same = sum(a == b for a, b in zip(tq, tf, strict=True))
    print(f"greedy tokens equal to the float path's: {same} of {len(tf)}")


@pytest.mark.parametrize("launch", [(4, 4, True), (1, 1, True), (2, 2, False)])
@pytest.mark.parametrize("t", [1, 4])
def test_norm_route_matches_the_separate_launches(t: int, launch: tuple[int, int, bool]) -> None:
    """The FFN norm + router (+ top-k) launch (fused.norm_route) against torch's norm, softmax and top-k in float64,
    and against the separate launches it replaces, on the GPU where its programs finish in any order; its counts
    are back at zero after each launch, so a second launch (a graph replay) gives the same."""
    from engine.kernels.fused import norm_route, rms_norm_q8, route
    from engine.kernels.gemv import gemv, quantize_q8_torch

    g = torch.Generator(device="cuda").manual_seed(3)
    d, e, k = 2048, 128, 8
    h = torch.randn(t, d, device="cuda", generator=g) * 3
    nw = torch.rand(d, device="cuda", generator=g) + 0.5
    router = torch.randn(e, d, device="cuda", generator=g) * 0.05
    done = torch.zeros(8, dtype=torch.int32, device="cuda")
    _, x32, xq = rms_norm_q8(h, nw, 1e-6, torch.bfloat16, f32_copy=True)
    rw, rid = route(gemv(router.view(torch.uint8), QT.F32, e, d, x32), k, True, None)
    # the independent reference: torch in float64
    hd = h.double()
    ref_x = hd * torch.rsqrt(hd.pow(2).mean(-1, keepdim=True) + 1e-6) * nw.double()
    ref_w, ref_ids = torch.softmax(ref_x @ router.double().T, -1).topk(k, -1)
    ref_w = ref_w / ref_w.sum(-1, keepdim=True)
    for _ in range(3):
        counts = torch.zeros(e, dtype=torch.int64, device="cuda")
        _, y32, yq, w, ids = norm_route(
            h, nw, 1e-6, router, k, True, counts, done, None, True, True, launch[:2], launch[2]
        )
        assert y32 is not None and yq is not None
        assert (y32 - x32).abs().max().item() < 1e-5
        assert (y32.double() - ref_x).abs().max().item() <= 1e-5 * ref_x.abs().max().item()
        _same_codes(yq, xq, d)
        _same_codes(yq, quantize_q8_torch(ref_x.float()), d)
        assert torch.equal(ids.sort(-1).values, ref_ids.sort(-1).values)
        assert (
            w.double().gather(1, ids.argsort(-1)) - ref_w.gather(1, ref_ids.argsort(-1))
        ).abs().max() < 1e-5
        assert torch.equal(ids, rid), (ids, rid)
        assert (w - rw).abs().max().item() < 1e-5
        assert torch.equal(counts, torch.bincount(rid.flatten(), minlength=e)) and not done.any()


@pytest.mark.parametrize("t", [1, 4])
def test_down_combine_writes_the_next_norm(t: int) -> None:
    """moe_down_combine writing the next layer's attention norm from its last program, against the plain launch,
    rms_norm_q8 of its output, and torch's norm of it rounded by quantize_q8_torch; its counts are back at zero
    after each launch."""
    from engine.kernels.fused import rms_norm_q8
    from engine.kernels.gemv import moe_down_combine, quantize_q8, quantize_q8_torch

    g = torch.Generator(device="cuda").manual_seed(4)
    qt, n, f, k = QT.Q4_K, 2048, 768, 8
    nw = torch.rand(n, device="cuda", generator=g) + 0.5
    done = torch.zeros(8, dtype=torch.int32, device="cuda")
    raws = [torch.from_numpy(random_blocks(qt, n, f, seed=70 + i)).cuda() for i in range(16)]
    table = torch.tensor([r.data_ptr() for r in raws], device="cuda")
    ids = torch.randint(0, 16, (t, k), device="cuda", generator=g)
    wts = torch.rand(t, k, device="cuda", generator=g)
    xs = quantize_q8(torch.randn(t * k, f, device="cuda", generator=g))
    res = torch.randn(t, n, device="cuda", generator=g)
    # body 12, the 8-bit one (the suite runs with --activations float, whose tuned body reads floats)
    want = moe_down_combine(table, qt, raws[0].shape[1], ids, wts, xs, res, n, f, variant=12, q8=True)
    for _ in range(3):
        q_out = torch.empty(t, n, device="cuda")
        y = moe_down_combine(table, qt, raws[0].shape[1], ids, wts, xs, res, n, f, variant=12, q8=True,
                             next_norm=(nw, 1e-6, q_out, done))  # fmt: skip
        # the same sums, though the compiler may contract them into other fused multiply-adds
        assert (y - want).abs().max().item() <= 1e-5 * want.abs().max().item() and not done.any()
        _, _, want_q = rms_norm_q8(y, nw, 1e-6, torch.float32)
        _same_codes(q_out, want_q, n)
        yd = y.double()
        ref = (yd * torch.rsqrt(yd.pow(2).mean(-1, keepdim=True) + 1e-6) * nw.double()).float()
        _same_codes(q_out, quantize_q8_torch(ref), n)


def _same_codes(a: torch.Tensor, b: torch.Tensor, d: int) -> None:
    """Two 8-bit forms (quantize_q8's layout) of one row: the same codes but where the norms' sums of squares,
    reduced in another order, put a value on the other side of a rounding edge (off by one, rarely)."""
    qa, qb = (x.view(torch.uint8)[:, :d].contiguous().view(torch.int8).int() for x in (a, b))
    diff = (qa - qb).abs()
    assert diff.max().item() <= 1 and (diff > 0).float().mean().item() < 0.01


@pytest.mark.parametrize("activations", ["float", "int8"])
def test_early_launches_give_the_same_step(
    tmp_path: Path, activations: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Kernels launched early (programmatic dependent launch, sm_90+: engine/kernels/launch.py) wait for the kernel
    before them before reading the step's data: the tokens and logits are bit-equal to launches one by one, in the
    decode step's CUDA graphs (Runner) and eager."""
    from engine.kernels import launch

    monkeypatch.setenv("STRATA_ACTIVATIONS", activations)
    path = write_tiny_model(tmp_path / "m.gguf", "qwen3moe", qtype="Q4_K", types={"output": "Q6_K"}, seed=5)
    runs = {}
    for on in ("0", "1"):
        monkeypatch.setenv("STRATA_PDL", on)
        launch._capable.cache_clear()
        runs[on] = _tokens(path, "f32", fast=True)
    launch._capable.cache_clear()
    if torch.cuda.get_device_capability() >= (9, 0):
        assert launch.pdl(torch.device("cuda"))
    assert runs["1"][0] == runs["0"][0]
    assert torch.equal(runs["1"][1], runs["0"][1])
