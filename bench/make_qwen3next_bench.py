"""Write a `qwen3next` GGUF with Qwen3-Next-80B-A3B's geometry and random quantized weights, for speed runs.

    python bench/make_qwen3next_bench.py OUT.gguf --vocab VOCAB.gguf [--layers 48] [--seed 0]

Speed does not depend on the weights' values, so matrices are random Q4_K blocks (the output head Q6_K) with
sane scales (engine/gguf/random_blocks.py); norms, the convolution, the decay and the routers are F32, as
llama-quantize leaves them. Names, shapes and metadata keys are those llama.cpp's `convert_hf_to_gguf.py` writes
for `Qwen3NextForCausalLM` (split `attn_qkv` + `attn_gate`, `ssm_a = -exp(A_log)`, norms stored with their +1),
without the MTP block (the `--no-mtp` conversion: our qwen3next has no draft layer yet). The vocabulary is
copied from a vocab-only GGUF, as the shared benchmark kit's writer does (its `ggml-vocab-qwen2.gguf` is the
Qwen2 tokenizer Qwen3-Next uses). Tensors are written to disk one at a time: the full file is ~43 GiB, the
memory in use stays near the largest tensor (~0.3 GiB).

Each layer's matrices repeat the first layer's blocks of the same kind (`--fresh-blocks` draws them all anew), so
the file is written at disk speed (drawing 43 GB of random blocks takes ~10 minutes). `--layers N` keeps the
per-layer geometry and the full-attention-every-4th pattern in a smaller file. `--experts`, `--experts-used` and
`--hidden` shrink it further for tests; a file made with them is not the Qwen3-Next geometry.
"""

import argparse
import math
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import MODEL_ARCH, MODEL_TENSOR, MODEL_TENSORS, TENSOR_NAMES, GGUFValueType
from gguf import GGMLQuantizationType as QT

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.gguf.random_blocks import random_blocks
from engine.testing.tiny_families import FamilySpec, write_family_metadata

ARCH = gguf.MODEL_ARCH_NAMES[MODEL_ARCH.QWEN3NEXT]

# config.json of Qwen/Qwen3-Next-80B-A3B-Instruct (HF key names)
QWEN3_NEXT_80B_A3B: dict[str, Any] = {
    "hidden_size": 2048,
    "num_hidden_layers": 48,
    "full_attention_interval": 4,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "partial_rotary_factor": 0.25,
    "rope_theta": 10000000.0,
    "max_position_embeddings": 262144,
    "rms_norm_eps": 1e-6,
    "intermediate_size": 5120,
    "num_experts": 512,
    "num_experts_per_tok": 10,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
}
WEIGHT_TYPE, HEAD_TYPE = QT.Q4_K, QT.Q6_K
WEIGHT_STD = 0.02


@dataclass(frozen=True)
class Planned:
    """One tensor of the file: numpy shape (GGUF's reversed), block type and what its values are."""

    name: str
    shape: tuple[int, ...]
    qtype: QT
    fill: str  # "weight" (random blocks), "ones", "normal" (small), "conv", "decay" (ssm_a)


def _name(t: MODEL_TENSOR, layer: int | None = None, suffix: str | None = "weight") -> str:
    if t not in MODEL_TENSORS[MODEL_ARCH.QWEN3NEXT]:
        raise KeyError(f"{TENSOR_NAMES[t]} is not a {ARCH} tensor in this gguf package")
    base = TENSOR_NAMES[t] if layer is None else TENSOR_NAMES[t].format(bid=layer)
    return base if suffix is None else f"{base}.{suffix}"


def plan(hf: dict[str, Any], n_vocab: int) -> list[Planned]:
    """Every tensor in the order the converter writes them, with llama-quantize's choice of F32 or blocks."""
    d, T = hf["hidden_size"], MODEL_TENSOR
    n_exp, ff_exp, ff_sh = (
        hf["num_experts"],
        hf["moe_intermediate_size"],
        hf["shared_expert_intermediate_size"],
    )
    hd, hv, dv = hf["head_dim"], hf["linear_num_value_heads"], hf["linear_value_head_dim"]
    key_dim, value_dim = hf["linear_num_key_heads"] * hf["linear_key_head_dim"], hv * dv
    conv_dim = 2 * key_dim + value_dim
    out = [Planned(_name(T.TOKEN_EMBD), (n_vocab, d), WEIGHT_TYPE, "weight")]
    for i in range(hf["num_hidden_layers"]):
        out.append(Planned(_name(T.ATTN_NORM, i), (d,), QT.F32, "ones"))
        if (i + 1) % hf["full_attention_interval"]:  # gated delta-net
            out += [
                Planned(_name(T.ATTN_QKV, i), (conv_dim, d), WEIGHT_TYPE, "weight"),
                Planned(_name(T.ATTN_GATE, i), (value_dim, d), WEIGHT_TYPE, "weight"),
                Planned(_name(T.SSM_BETA_ALPHA, i), (2 * hv, d), WEIGHT_TYPE, "weight"),
                Planned(_name(T.SSM_CONV1D, i), (conv_dim, hf["linear_conv_kernel_dim"]), QT.F32, "conv"),
                Planned(_name(T.SSM_DT, i, "bias"), (hv,), QT.F32, "ones"),
                Planned(_name(T.SSM_A, i, None), (hv,), QT.F32, "decay"),
                Planned(_name(T.SSM_NORM, i), (dv,), QT.F32, "ones"),
                Planned(_name(T.SSM_OUT, i), (d, value_dim), WEIGHT_TYPE, "weight"),
            ]
        else:  # gated full attention: query and output gate per head
            qd, kvd = hf["num_attention_heads"] * hd, hf["num_key_value_heads"] * hd
            out += [
                Planned(_name(T.ATTN_Q, i), (2 * qd, d), WEIGHT_TYPE, "weight"),
                Planned(_name(T.ATTN_K, i), (kvd, d), WEIGHT_TYPE, "weight"),
                Planned(_name(T.ATTN_V, i), (kvd, d), WEIGHT_TYPE, "weight"),
                Planned(_name(T.ATTN_OUT, i), (d, qd), WEIGHT_TYPE, "weight"),
                Planned(_name(T.ATTN_Q_NORM, i), (hd,), QT.F32, "ones"),
                Planned(_name(T.ATTN_K_NORM, i), (hd,), QT.F32, "ones"),
            ]
        out += [
            Planned(_name(T.ATTN_POST_NORM, i), (d,), QT.F32, "ones"),
            Planned(_name(T.FFN_GATE_INP, i), (n_exp, d), QT.F32, "normal"),
            Planned(_name(T.FFN_GATE_EXP, i), (n_exp, ff_exp, d), WEIGHT_TYPE, "weight"),
            Planned(_name(T.FFN_UP_EXP, i), (n_exp, ff_exp, d), WEIGHT_TYPE, "weight"),
            Planned(_name(T.FFN_DOWN_EXP, i), (n_exp, d, ff_exp), WEIGHT_TYPE, "weight"),
            Planned(_name(T.FFN_GATE_INP_SHEXP, i), (d,), QT.F32, "normal"),
            Planned(_name(T.FFN_GATE_SHEXP, i), (ff_sh, d), WEIGHT_TYPE, "weight"),
            Planned(_name(T.FFN_UP_SHEXP, i), (ff_sh, d), WEIGHT_TYPE, "weight"),
            Planned(_name(T.FFN_DOWN_SHEXP, i), (d, ff_sh), WEIGHT_TYPE, "weight"),
        ]
    out.append(Planned(_name(T.OUTPUT_NORM), (d,), QT.F32, "ones"))
    out.append(Planned(_name(T.OUTPUT), (n_vocab, d), HEAD_TYPE, "weight"))
    for p in out:
        block = gguf.GGML_QUANT_SIZES[p.qtype][0]
        if p.shape[-1] % block:
            raise SystemExit(
                f"{p.name}: rows of {p.shape[-1]} values do not fit {p.qtype.name} blocks of {block}; "
                "choose --hidden as a multiple of 256"
            )
    return out


def nbytes(p: Planned) -> int:
    block, size = gguf.GGML_QUANT_SIZES[p.qtype]
    return math.prod(p.shape[:-1]) * (p.shape[-1] // block) * size


def tensor_data(p: Planned, rng: np.random.Generator) -> np.ndarray:
    """The tensor's bytes (blocks as uint8 [..., row_bytes]) or float32 values, in the planned shape."""
    if p.fill == "ones":
        return np.ones(p.shape, np.float32)
    if p.fill == "decay":  # ssm_a = -exp(A_log) with A drawn as HF initialises it, in (0, 16)
        return -rng.uniform(1.0, 16.0, p.shape).astype(np.float32)
    if p.fill in ("normal", "conv"):  # routers near-uniform; a depthwise kernel of 4 taps needs larger taps
        return rng.normal(0.0, WEIGHT_STD if p.fill == "normal" else 0.3, p.shape).astype(np.float32)
    rows = math.prod(p.shape[:-1])
    raw = random_blocks(p.qtype, rows, p.shape[-1], rng, std=WEIGHT_STD)
    return raw.reshape(*p.shape[:-1], raw.shape[-1])


def copy_tokenizer(writer: gguf.GGUFWriter, vocab: Path) -> int:
    """Copy every `tokenizer.*` field of a vocab-only GGUF with its value types; returns the token count."""
    reader = gguf.GGUFReader(vocab)
    n_vocab = 0
    for field in reader.fields.values():
        if not field.name.startswith("tokenizer."):
            continue
        sub = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub)
        if field.name == gguf.Keys.Tokenizer.LIST:
            n_vocab = len(field.data)
    if not n_vocab:
        raise SystemExit(
            f"{vocab} has no tokenizer.ggml.tokens; expected a vocab-only GGUF such as ggml-vocab-qwen2.gguf"
        )
    return n_vocab


def write(out: Path, vocab: Path, hf: dict[str, Any], seed: int, reuse: bool = True) -> tuple[int, int]:
    """Write the file; returns (tensor count, bytes of tensor data)."""
    w = gguf.GGUFWriter(str(out), ARCH)
    # the keys convert_hf_to_gguf.py writes for this config (as the tiny test models have them), then the
    # file type and quantization version llama-quantize sets
    write_family_metadata(w, FamilySpec(ARCH, hf), name=f"bench-{ARCH}-{hf['num_hidden_layers']}L")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    tensors = plan(hf, copy_tokenizer(w, vocab))
    for p in tensors:
        if p.qtype == QT.F32:
            w.add_tensor_info(p.name, p.shape, np.dtype(np.float32), nbytes(p))
        else:
            byte_shape = (*p.shape[:-1], nbytes(p) // math.prod(p.shape[:-1]))
            w.add_tensor_info(p.name, byte_shape, np.dtype(np.uint8), nbytes(p), raw_dtype=p.qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for data in _stream(tensors, seed, reuse):
        w.write_tensor_data(data)
    w.close()
    return len(tensors), sum(nbytes(p) for p in tensors)


def _stream(tensors: Sequence[Planned], seed: int, reuse: bool) -> Iterator[np.ndarray]:
    """One tensor's data at a time, each from its own generator (the values do not depend on the order). With
    `reuse`, a matrix repeats the blocks of the same matrix of the first layer of its kind: drawing 43 GB of
    random bytes takes minutes, writing them seconds, and speed does not depend on the values."""
    drawn: dict[tuple[str, tuple[int, ...]], np.ndarray] = {}
    for k, p in enumerate(tensors):
        key = (p.name.split(".", 2)[-1], p.shape)  # "blk.7.ffn_up_exps.weight" -> "ffn_up_exps.weight"
        data = drawn.get(key) if reuse and p.fill == "weight" else None
        if data is None:
            data = tensor_data(p, np.random.default_rng([seed, k]))
            if reuse and p.fill == "weight" and p.name.startswith("blk."):
                drawn[key] = data
        assert data.nbytes == nbytes(p), p.name
        yield data


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument(
        "--vocab", type=Path, required=True, help="a vocab-only GGUF (the kit's ggml-vocab-qwen2.gguf)"
    )
    ap.add_argument("--layers", type=int, default=QWEN3_NEXT_80B_A3B["num_hidden_layers"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--fresh-blocks",
        action="store_true",
        help="draw every layer's matrices anew (slow) instead of repeating",
    )
    test = ap.add_argument_group("test-only shrinkers (not the Qwen3-Next geometry)")
    test.add_argument("--experts", type=int, help="routed experts per layer (512)")
    test.add_argument("--experts-used", type=int, help="experts per token (10, at most --experts)")
    test.add_argument("--hidden", type=int, help="hidden size, a multiple of 256 (2048)")
    a = ap.parse_args(argv)
    hf = dict(QWEN3_NEXT_80B_A3B, num_hidden_layers=a.layers)
    if a.experts is not None:
        hf["num_experts"] = a.experts
    hf["num_experts_per_tok"] = a.experts_used or min(hf["num_experts_per_tok"], hf["num_experts"])
    if a.hidden is not None:
        hf["hidden_size"] = a.hidden
    if a.layers < 1 or not 0 < hf["num_experts_per_tok"] <= hf["num_experts"]:
        ap.error("--layers must be >= 1 and --experts-used between 1 and --experts")
    t0 = time.perf_counter()
    n, size = write(a.out, a.vocab, hf, a.seed, reuse=not a.fresh_blocks)
    print(
        f"wrote {a.out}: {ARCH}, {a.layers} layers, {hf['num_experts']} experts (top-{hf['num_experts_per_tok']}), "
        f"{n} tensors, {size / 2**30:.2f} GiB of tensor data in {time.perf_counter() - t0:.0f} s",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
