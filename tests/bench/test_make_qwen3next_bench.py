"""bench/make_qwen3next_bench.py: a small file of the same per-layer layout opens with gguf's reader, holds every
tensor llama.cpp's qwen3next loader creates (names, GGML shapes, the block types llama-quantize leaves), and our
engine loads it and runs a forward on the CPU with finite logits."""

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from engine.pipeline.loader import load_model
from engine.testing.tokenizer_fixture import tiny_bpe_metadata, write_tokenizer

ROOT = Path(__file__).resolve().parents[2]
LAYERS, EXPERTS, USED, HIDDEN = 4, 8, 4, 256


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "make_qwen3next_bench", ROOT / "bench" / "make_qwen3next_bench.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("qwen3next-bench")
    vocab = d / "vocab.gguf"
    w = gguf.GGUFWriter(str(vocab), "qwen2")
    write_tokenizer(w, tiny_bpe_metadata(vocab_size=512))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    out = d / "bench.gguf"
    shrink = {"--layers": LAYERS, "--experts": EXPERTS, "--experts-used": USED, "--hidden": HIDDEN}
    _script().main([str(out), "--vocab", str(vocab), *(str(x) for kv in shrink.items() for x in kv)])
    return out


def _expected_tensors(n_vocab: int) -> dict[str, tuple[tuple[int, ...], set[QT]]]:
    """What llama.cpp's `llama_model_qwen3next::load_arch_tensors` creates for this geometry (GGML order, ne0
    first), written down from its source with Qwen3-Next's per-layer sizes: 16 key heads and 32 value heads of
    128, conv kernel 4, 16 query heads and 2 KV heads of 256, expert and shared FFN 512."""
    d, kd, vd, hv = HIDDEN, 16 * 128, 32 * 128, 32
    quant, f32 = {QT.Q4_K}, {QT.F32}
    want = {
        "token_embd.weight": ((d, n_vocab), quant),
        "output_norm.weight": ((d,), f32),
        "output.weight": ((d, n_vocab), {QT.Q6_K}),
    }
    for i in range(LAYERS):
        b = f"blk.{i}."
        want[b + "attn_norm.weight"] = ((d,), f32)
        want[b + "post_attention_norm.weight"] = ((d,), f32)
        if (i + 1) % 4:
            want[b + "attn_qkv.weight"] = ((d, 2 * kd + vd), quant)
            want[b + "attn_gate.weight"] = ((d, vd), quant)
            want[b + "ssm_conv1d.weight"] = ((4, 2 * kd + vd), f32)
            want[b + "ssm_dt.bias"] = ((hv,), f32)
            want[b + "ssm_a"] = ((hv,), f32)
            want[b + "ssm_ba.weight"] = ((d, 2 * hv), quant)
            want[b + "ssm_norm.weight"] = ((128,), f32)
            want[b + "ssm_out.weight"] = ((vd, d), quant)
        else:
            want[b + "attn_q.weight"] = ((d, 256 * 16 * 2), quant)
            want[b + "attn_k.weight"] = ((d, 256 * 2), quant)
            want[b + "attn_v.weight"] = ((d, 256 * 2), quant)
            want[b + "attn_output.weight"] = ((256 * 16, d), quant)
            want[b + "attn_q_norm.weight"] = ((256,), f32)
            want[b + "attn_k_norm.weight"] = ((256,), f32)
        want[b + "ffn_gate_inp.weight"] = ((d, EXPERTS), f32)
        want[b + "ffn_gate_exps.weight"] = ((d, 512, EXPERTS), quant)
        want[b + "ffn_up_exps.weight"] = ((d, 512, EXPERTS), quant)
        want[b + "ffn_down_exps.weight"] = ((512, d, EXPERTS), quant)
        want[b + "ffn_gate_inp_shexp.weight"] = ((d,), f32)
        want[b + "ffn_gate_shexp.weight"] = ((d, 512), quant)
        want[b + "ffn_up_shexp.weight"] = ((d, 512), quant)
        want[b + "ffn_down_shexp.weight"] = ((512, d), quant)
    return want


def test_layout_and_metadata_as_llama_cpp_reads_them(bench_file: Path) -> None:
    r = gguf.GGUFReader(bench_file)
    fields = {f.name: f.contents() for f in r.fields.values()}
    n_vocab = len(fields["tokenizer.ggml.tokens"])
    got = {t.name: (tuple(int(x) for x in t.shape), QT(t.tensor_type)) for t in r.tensors}
    want = _expected_tensors(n_vocab)
    assert set(got) == set(want)
    for name, (shape, types) in want.items():
        assert got[name][0] == shape and got[name][1] in types, (name, got[name])
    a = "qwen3next"
    assert fields["general.architecture"] == a
    assert fields[f"{a}.block_count"] == LAYERS and fields[f"{a}.full_attention_interval"] == 4
    assert fields[f"{a}.ssm.group_count"] == 16 and fields[f"{a}.ssm.time_step_rank"] == 32
    assert fields[f"{a}.ssm.state_size"] == 128 and fields[f"{a}.ssm.inner_size"] == 32 * 128
    assert fields[f"{a}.ssm.conv_kernel"] == 4 and fields[f"{a}.rope.dimension_count"] == 64
    assert fields[f"{a}.expert_count"] == EXPERTS and fields[f"{a}.expert_used_count"] == USED
    assert fields[f"{a}.expert_feed_forward_length"] == 512
    assert fields[f"{a}.expert_shared_feed_forward_length"] == 512
    assert fields[f"{a}.attention.key_length"] == 256 and fields[f"{a}.attention.head_count_kv"] == 2
    assert fields["tokenizer.ggml.pre"] == "qwen2" and fields["tokenizer.ggml.model"] == "gpt2"
    # the decay is negative (ssm_a = -exp(A_log)) and the stored norms are near one (+1 added by the converter)
    tensors = {t.name: t for t in r.tensors}
    assert (np.asarray(tensors["blk.0.ssm_a"].data) < 0).all()
    assert np.allclose(np.asarray(tensors["blk.3.attn_q_norm.weight"].data), 1.0)
    # the blocks dequantize (gguf's reference) to finite weights of the intended scale
    w = gguf.quants.dequantize(np.asarray(tensors["blk.1.ffn_down_exps.weight"].data), QT.Q4_K)
    assert np.isfinite(w).all() and 0.005 < float(w.std()) < 0.08


def test_engine_loads_and_runs_a_forward_on_the_cpu(bench_file: Path) -> None:
    lm = load_model(bench_file, device="cpu", dtype="f32")
    cfg = lm.model.cfg
    assert (cfg.n_layer, cfg.n_expert, cfg.n_expert_used) == (LAYERS, EXPERTS, USED)
    assert [cfg.is_recurrent(i) for i in range(LAYERS)] == [True, True, True, False]
    cache = lm.model.new_cache(64, "f32")
    logits = lm.model.forward(torch.arange(1, 9), cache, 0)  # a prompt chunk, then one decode step
    step = lm.model.forward(logits[-1].argmax().view(1), cache, 8)
    assert logits.shape == (8, cfg.n_vocab) and step.shape == (1, cfg.n_vocab)
    assert torch.isfinite(logits).all() and torch.isfinite(step).all()
    assert float(logits.std()) > 0
