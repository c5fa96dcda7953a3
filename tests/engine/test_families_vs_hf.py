"""gpt-oss, qwen3next, deepseek2 and glm4moe against HF transformers (float32, the same weights dequantized by
gguf.quants, llama.cpp's converter layout undone by the reference): logits at every position, 32 greedy tokens,
GLM's nextn draft block, and the layouts older converters wrote."""

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine.models.glm4moe import Glm4MoeLM
from engine.pipeline.generate import DoneEvent, GenerationRequest, Runner
from engine.pipeline.loader import load_model
from engine.pipeline.sampling import GREEDY
from engine.testing.tiny_families import FAMILIES, write_tiny_family
from tests.engine.hf_reference import hf_greedy, hf_logits
from tests.engine.hf_reference_families import hf_family_model

PROMPT = [1, 17, 42, 99, 150, 7, 300, 12, 5, 64, 128, 256, 33, 71, 200, 11, 90, 45, 13, 180]
# Block types per family: float, a quantized type gguf writes, random K/IQ blocks; gpt-oss's experts in MXFP4.
CASES = [
    ("gpt-oss", "F32", None),
    ("gpt-oss", "Q8_0", {"_exps": "MXFP4"}),
    ("gpt-oss", "Q4_K", {"ffn_down_exps": "Q6_K"}),
    ("qwen3next", "F32", None),
    ("qwen3next", "Q8_0", None),
    ("qwen3next", "Q4_K", {"ffn_down": "Q6_K", "attn_qkv": "IQ4_XS"}),
    ("deepseek2", "F32", None),
    ("deepseek2", "Q8_0", None),
    ("deepseek2", "Q5_K", {"_exps": "IQ3_S"}),
    ("glm4moe", "F32", None),
    ("glm4moe", "Q4_0", None),
    ("glm4moe", "Q6_K", {"_exps": "Q2_K"}),
]
GREEDY_CASES = {("gpt-oss", "Q8_0"), ("qwen3next", "F32"), ("deepseek2", "Q5_K"), ("glm4moe", "F32")}


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0).item()


def _greedy(path: Path, n: int) -> list[int]:
    lm = load_model(path, device="cpu", dtype="f32")
    runner = Runner(lm.model, lm.tokenizer, 128, "f32")
    req = GenerationRequest(PROMPT, max_tokens=n, sampling=GREEDY, ignore_eos=True)
    return next(e for e in runner.generate(req) if isinstance(e, DoneEvent)).tokens


@pytest.mark.parametrize(("arch", "qtype", "types"), CASES, ids=[f"{a}-{q}" for a, q, _ in CASES])
def test_logits_and_greedy_match_transformers(
    tmp_path: Path, arch: str, qtype: str, types: dict[str, str] | None
) -> None:
    path = write_tiny_family(tmp_path / f"{arch}.gguf", arch, qtype=qtype, seed=3, types=types)
    lm = load_model(path, device="cpu", dtype="f32")
    assert type(lm.model).__module__.endswith(arch.replace("-", "_"))
    ours = lm.model.forward(torch.tensor(PROMPT), lm.model.new_cache(64, "f32"), 0)  # [T, V]
    ref_model = hf_family_model(path)
    ref = hf_logits(ref_model, PROMPT)
    assert _cos(ours, ref) >= 0.9999
    assert (ours - ref).abs().max().item() <= 1e-3
    if (arch, qtype) in GREEDY_CASES:
        assert _greedy(path, 32) == hf_greedy(ref_model, PROMPT, 32)


def test_families_registered() -> None:
    from engine.models.registry import ARCHITECTURES, model_class

    for arch in FAMILIES:
        assert arch in ARCHITECTURES and model_class(arch) is not None


@pytest.mark.parametrize("arch", ["gpt-oss", "qwen3next"])
def test_fused_gate_up_experts_give_the_same_logits(tmp_path: Path, arch: str) -> None:
    """The converter's `fuse_gate_up_exps` option writes one `ffn_gate_up_exps` (per expert the gate rows, then
    the up rows; biases likewise): the same model."""
    split = write_tiny_family(tmp_path / "split.gguf", arch, qtype="Q8_0", seed=4)
    fused = write_tiny_family(tmp_path / "fused.gguf", arch, qtype="Q8_0", seed=4, fuse_gate_up=True)
    from engine.gguf.reader import GGUFFile

    assert "blk.0.ffn_gate_up_exps.weight" in GGUFFile.open(fused).tensors
    a = load_model(split, device="cpu", dtype="f32").model
    b = load_model(fused, device="cpu", dtype="f32").model
    la = a.forward(torch.tensor(PROMPT), a.new_cache(64, "f32"), 0)
    lb = b.forward(torch.tensor(PROMPT), b.new_cache(64, "f32"), 0)
    assert torch.equal(la, lb)


@pytest.mark.parametrize(("arch", "option"), [("deepseek2", "split_kv_b"), ("qwen3next", "split_qkvz")])
def test_layouts_of_older_converters(tmp_path: Path, arch: str, option: str) -> None:
    """Files converted before the k_b/v_b split carry `attn_kv_b` (keys and values are then expanded from the
    cached latents instead of absorbed); Qwen3-Next files before the qkvz split carry HF's grouped `ssm_in`.
    The same weights in either layout give the same logits."""
    old = write_tiny_family(tmp_path / "old.gguf", arch, seed=6, **{option: False})
    new = write_tiny_family(tmp_path / "new.gguf", arch, seed=6)
    a = load_model(old, device="cpu", dtype="f32").model
    b = load_model(new, device="cpu", dtype="f32").model
    la = a.forward(torch.tensor(PROMPT), a.new_cache(64, "f32"), 0)
    lb = b.forward(torch.tensor(PROMPT), b.new_cache(64, "f32"), 0)
    assert (la - lb).abs().max().item() <= 1e-4


def test_deepseek2_yarn_scales_the_attention_not_the_rotation(tmp_path: Path) -> None:
    """DeepSeek's YaRN (log multiplier 0.1 * mscale_all_dim): logits as HF's DeepseekV3 computes them."""
    yarn = {"factor": 4.0, "original_max_position_embeddings": 8, "mscale_all_dim": 1.0}
    path = write_tiny_family(tmp_path / "ds.gguf", "deepseek2", qtype="Q8_0", seed=8, rope_scaling=yarn)
    m = load_model(path, device="cpu", dtype="f32").model
    ours = m.forward(torch.tensor(PROMPT), m.new_cache(64, "f32"), 0)
    ref = hf_logits(hf_family_model(path), PROMPT)
    assert _cos(ours, ref) >= 0.9999
    assert (ours - ref).abs().max().item() <= 1e-3


def test_glm4moe_nextn_draft_block_matches_transformers_layers(tmp_path: Path) -> None:
    """The draft block: h' = eh_proj([enorm(embed(t+1)), hnorm(hidden_t)]) -> decoder block -> shared head norm ->
    head, with HF's decoder layer (the nextn block loaded as one more layer) as the reference for the block."""
    path = write_tiny_family(tmp_path / "glm.gguf", "glm4moe", qtype="Q8_0", seed=5)
    lm = load_model(path, device="cpu", dtype="f32")
    model = lm.model
    assert isinstance(model, Glm4MoeLM) and model.has_draft and model.cfg.n_layer == 3
    cache = model.new_cache(64, "f32")
    ids = torch.tensor(PROMPT)
    h = model.embed(ids)
    for i in model.layer_range:
        h = model.layer(i, h, cache, 0)
    hidden = model.head_hidden(h)  # [T, D]
    logits, _ = model.nextn_step(ids[1:], hidden[:-1], cache, 0)

    from tests.engine.hf_reference import read_gguf

    _, t = read_gguf(path)
    hf = hf_family_model(path, with_draft=True)
    n = 3
    with torch.inference_mode():
        out = hf.model(ids[None], output_hidden_states=False)
        base = hf_family_model(path)
        ref_hidden = base.model(ids[None]).last_hidden_state[0]  # [T, D], after the output norm
        assert (ref_hidden - hidden).abs().max().item() <= 1e-4

        def rms(x: torch.Tensor, w: str) -> torch.Tensor:
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * torch.from_numpy(t[w])

        b = f"blk.{n}.nextn."
        assert b + "embed_tokens.weight" in t and b + "shared_head_head.weight" in t  # GLM-4.5's own tables
        emb = rms(torch.from_numpy(t[b + "embed_tokens.weight"])[ids[1:]], b + "enorm.weight")
        x = (
            torch.cat((emb, rms(ref_hidden[:-1], b + "hnorm.weight")), -1)
            @ torch.from_numpy(t[b + "eh_proj.weight"]).T
        )
        m = x.shape[0]
        pos = torch.arange(m)[None]
        mask = torch.full((m, m), float("-inf")).triu(1)[None, None]
        pe = hf.model.rotary_emb(x[None], pos)
        y = hf.model.layers[n](x[None], attention_mask=mask, position_ids=pos, position_embeddings=pe)
        y = y[0] if isinstance(y, tuple) else y
        ref = rms(y[0], b + "shared_head_norm.weight") @ torch.from_numpy(t[b + "shared_head_head.weight"]).T
    del out
    assert _cos(logits, ref) >= 0.9999
    assert (logits - ref).abs().max().item() <= 1e-3
