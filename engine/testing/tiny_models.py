"""Tiny GGUF models for tests, written with the `gguf` package's writer.

Every architecture the engine runs, any block type (K- and IQ-types get random blocks with sane scales, since
`gguf` cannot quantize them), a tokenizer and a chat template in the metadata, deterministic by seed, a few MB.
The layout is the one llama.cpp's converter writes: ggml tensor names, Q/K rows of `llama` permuted for its
interleaved RoPE, Gemma norms stored with their +1 already added.
"""

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT

from engine.gguf.random_blocks import random_blocks
from engine.testing.tokenizer_fixture import tiny_bpe_metadata, tiny_spm_metadata, write_tokenizer

# Types gguf.quants can quantize from floats: realistic weights. The rest get random blocks.
_QUANTIZABLE = {QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0, QT.BF16, QT.MXFP4}

# The architectures the fixture writes. "mixtral" is the `llama` architecture with routed experts.
ARCHITECTURES = ("qwen3moe", "qwen2moe", "llama", "mixtral", "qwen2", "qwen3", "gemma3")
MOE_ARCHITECTURES = ("qwen3moe", "qwen2moe", "mixtral")


@dataclass(frozen=True)
class TinySpec:
    arch: str
    n_layer: int = 2
    n_embd: int = 256
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 64
    n_ff: int = 512
    n_expert: int = 8
    n_expert_used: int = 2
    n_ff_exp: int = 256
    n_ff_shexp: int = 512
    context: int = 4096
    rope_base: float = 10000.0
    rms_eps: float = 1e-6
    sliding_window: int = 0
    tied_output: bool = False
    vocab: int = 512
    # Extra metadata (without the architecture prefix), e.g. {"rope.scaling.type": "linear", ...}.
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def gguf_arch(self) -> str:
        return "llama" if self.arch == "mixtral" else self.arch

    @property
    def is_moe(self) -> bool:
        return self.arch in MOE_ARCHITECTURES


def default_spec(arch: str, **overrides: Any) -> TinySpec:
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown tiny architecture {arch!r}; known: {', '.join(ARCHITECTURES)}")
    base: dict[str, Any] = {}
    if arch in ("qwen2", "qwen2moe", "qwen3", "qwen3moe"):
        base["rope_base"] = 1000000.0
    if arch == "gemma3":
        # Six layers so that one global layer sits among the sliding ones; a small window that prompts cross.
        base.update(
            n_layer=6, head_dim=128, n_head_kv=1, sliding_window=8, tied_output=True, rope_base=1000000.0
        )
    base.update(overrides)
    return TinySpec(arch=arch, **base)


def _permute_for_interleaved_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter reorders the rows of Q and K of `llama` so that its pairwise RoPE equals HF's half split."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class _Writer:
    def __init__(self, spec: TinySpec, qtype: QT, types: Mapping[str, QT], seed: int) -> None:
        self.spec = spec
        self.qtype = qtype
        self.types = dict(types)
        self.rng = np.random.default_rng(seed)
        self.tensors: list[tuple[str, np.ndarray, QT | None]] = []

    def _type_for(self, name: str) -> QT:
        for pattern, t in self.types.items():
            if pattern in name:
                return t
        return self.qtype

    def matrix(self, name: str, shape: tuple[int, ...], std: float, permute_heads: int = 0) -> None:
        """A weight in torch order ([n_out, n_in] or [n_expert, n_out, n_in]), stored in the requested type."""
        qtype = self._type_for(name)
        w = (self.rng.standard_normal(shape) * std).astype(np.float32)
        if permute_heads:
            w = _permute_for_interleaved_rope(w, permute_heads)
        if qtype == QT.F32:
            self.tensors.append((name, w, None))
        elif qtype == QT.F16:
            self.tensors.append((name, w.astype(np.float16), None))
        elif qtype in _QUANTIZABLE:
            self.tensors.append((name, gguf.quants.quantize(w, qtype), qtype))
        else:
            rows = int(np.prod(shape[:-1]))
            # Random rows: the Q/K permutation would not change their distribution, so none is applied.
            raw = random_blocks(qtype, rows, shape[-1], seed=int(self.rng.integers(1 << 31)), std=std)
            self.tensors.append((name, raw.reshape(*shape[:-1], raw.shape[-1]), qtype))

    def vector(self, name: str, n: int, center: float, std: float) -> None:
        v = (center + self.rng.standard_normal(n) * std).astype(np.float32)
        self.tensors.append((name, v, None))


def write_tiny_model(
    path: str | Path,
    arch: str,
    qtype: QT | str = QT.F32,
    seed: int = 0,
    types: Mapping[str, QT | str] | None = None,
    spec: TinySpec | None = None,
    chat_template: bool | str = True,
    **overrides: Any,
) -> Path:
    """Write a tiny `arch` model to `path`. `qtype` is the type of every weight matrix (norms and biases stay F32);
    `types` maps a name fragment (e.g. "ffn_down", "token_embd") to another type; `chat_template`: the tokenizer's
    own (True), none (False) or this one (a string)."""
    spec = spec or default_spec(arch, **overrides)
    qtype = QT[qtype] if isinstance(qtype, str) else qtype
    tmap = {k: QT[v] if isinstance(v, str) else v for k, v in (types or {}).items()}
    w = _Writer(spec, qtype, tmap, seed)

    if spec.arch == "gemma3":
        tok = tiny_spm_metadata(seed=seed, vocab_size=spec.vocab)
    else:
        tok = tiny_bpe_metadata(seed=seed, vocab_size=spec.vocab)
    if not chat_template:
        tok = {k: v for k, v in tok.items() if k != "tokenizer.chat_template"}
    elif isinstance(chat_template, str):
        tok = {**tok, "tokenizer.chat_template": chat_template}
    n_vocab = len(tok["tokenizer.ggml.tokens"])
    spec = replace(spec, vocab=n_vocab)
    _add_tensors(w, spec)

    path = Path(path)
    writer = gguf.GGUFWriter(str(path), arch=spec.gguf_arch)
    _add_metadata(writer, spec)
    write_tokenizer(writer, tok)
    for name, data, raw_dtype in w.tensors:
        writer.add_tensor(name, data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_metadata(writer: gguf.GGUFWriter, s: TinySpec) -> None:
    writer.add_name(f"tiny-{s.arch}")
    writer.add_context_length(s.context)
    writer.add_embedding_length(s.n_embd)
    writer.add_block_count(s.n_layer)
    writer.add_feed_forward_length(s.n_ff)
    writer.add_head_count(s.n_head)
    writer.add_head_count_kv(s.n_head_kv)
    writer.add_layer_norm_rms_eps(s.rms_eps)
    writer.add_rope_freq_base(s.rope_base)
    if s.arch in ("qwen3", "qwen3moe", "gemma3"):
        writer.add_key_length(s.head_dim)
        writer.add_value_length(s.head_dim)
    if s.arch == "llama" or s.arch == "mixtral":
        writer.add_rope_dimension_count(s.head_dim)
    if s.is_moe:
        writer.add_expert_count(s.n_expert)
        writer.add_expert_used_count(s.n_expert_used)
        writer.add_expert_feed_forward_length(s.n_ff_exp)
    if s.arch == "qwen2moe":
        writer.add_expert_shared_feed_forward_length(s.n_ff_shexp)
    if s.sliding_window:
        writer.add_sliding_window(s.sliding_window)
    arch = s.gguf_arch
    for key, value in s.extra.items():
        full = f"{arch}.{key}"
        if isinstance(value, bool):
            writer.add_bool(full, value)
        elif isinstance(value, int):
            writer.add_uint32(full, value)
        elif isinstance(value, float):
            writer.add_float32(full, value)
        else:
            writer.add_string(full, str(value))


def _add_tensors(w: _Writer, s: TinySpec) -> None:
    d, hd = s.n_embd, s.head_dim
    w.matrix("token_embd.weight", (s.vocab, d), std=0.5 if s.arch != "gemma3" else 0.05)
    norm_center = 1.0  # Gemma's (1 + w) is stored with the +1 applied, so every family stores weights near 1.
    w.vector("output_norm.weight", d, norm_center, 0.1)
    if not s.tied_output:
        w.matrix("output.weight", (s.vocab, d), std=d**-0.5)
    permute = s.arch in ("llama", "mixtral")
    for i in range(s.n_layer):
        p = f"blk.{i}."
        w.vector(p + "attn_norm.weight", d, norm_center, 0.1)
        w.matrix(
            p + "attn_q.weight", (s.n_head * hd, d), std=d**-0.5, permute_heads=s.n_head if permute else 0
        )
        w.matrix(
            p + "attn_k.weight",
            (s.n_head_kv * hd, d),
            std=d**-0.5,
            permute_heads=s.n_head_kv if permute else 0,
        )
        w.matrix(p + "attn_v.weight", (s.n_head_kv * hd, d), std=d**-0.5)
        w.matrix(p + "attn_output.weight", (d, s.n_head * hd), std=(s.n_head * hd) ** -0.5)
        if s.arch in ("qwen2", "qwen2moe"):
            w.vector(p + "attn_q.bias", s.n_head * hd, 0.0, 0.1)
            w.vector(p + "attn_k.bias", s.n_head_kv * hd, 0.0, 0.1)
            w.vector(p + "attn_v.bias", s.n_head_kv * hd, 0.0, 0.1)
        if s.arch in ("qwen3", "qwen3moe", "gemma3"):
            w.vector(p + "attn_q_norm.weight", hd, norm_center, 0.1)
            w.vector(p + "attn_k_norm.weight", hd, norm_center, 0.1)
        if s.arch == "gemma3":
            w.vector(p + "post_attention_norm.weight", d, norm_center, 0.1)
            w.vector(p + "post_ffw_norm.weight", d, norm_center, 0.1)
        w.vector(p + "ffn_norm.weight", d, norm_center, 0.1)
        if s.is_moe:
            e, f = s.n_expert, s.n_ff_exp
            # Decisive routers, as trained ones are: near-tied expert choices would flip under bf16 rounding.
            w.matrix(p + "ffn_gate_inp.weight", (e, d), std=8 * d**-0.5)
            w.matrix(p + "ffn_gate_exps.weight", (e, f, d), std=d**-0.5)
            w.matrix(p + "ffn_up_exps.weight", (e, f, d), std=d**-0.5)
            w.matrix(p + "ffn_down_exps.weight", (e, d, f), std=f**-0.5)
            if s.arch == "qwen2moe":
                w.vector(p + "ffn_gate_inp_shexp.weight", d, 0.0, d**-0.5)
                w.matrix(p + "ffn_gate_shexp.weight", (s.n_ff_shexp, d), std=d**-0.5)
                w.matrix(p + "ffn_up_shexp.weight", (s.n_ff_shexp, d), std=d**-0.5)
                w.matrix(p + "ffn_down_shexp.weight", (d, s.n_ff_shexp), std=s.n_ff_shexp**-0.5)
        else:
            w.matrix(p + "ffn_gate.weight", (s.n_ff, d), std=d**-0.5)
            w.matrix(p + "ffn_up.weight", (s.n_ff, d), std=d**-0.5)
            w.matrix(p + "ffn_down.weight", (d, s.n_ff), std=s.n_ff**-0.5)
