"""The typed hyper-parameters of a decoder model, read once from GGUF metadata (keys through gguf's constants)."""

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gguf import Keys


class ModelConfigError(ValueError):
    """A metadata value the engine needs is missing or impossible."""


@dataclass(frozen=True)
class RopeConfig:
    dim: int  # rotated dims per head (partial rotary when < head_dim)
    base: float
    neox: bool  # True: halves rotated together (HF rotate_half); False: adjacent pairs (llama.cpp NORM mode)
    scaling: str = "none"  # none | linear | yarn
    factor: float = 1.0
    orig_ctx: int = 0
    yarn_ext_factor: float = -1.0  # < 0: derived from the factor, as llama.cpp does
    yarn_attn_factor: float = 1.0
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    base_swa: float | None = None  # sliding-window layers' base where it differs (Gemma 3: 10000)


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim_k: int
    head_dim_v: int
    n_ff: int
    n_vocab: int
    n_ctx_train: int
    rms_eps: float
    rope: RopeConfig
    attn_scale: float
    activation: str = "silu"  # silu | gelu_tanh
    qkv_bias: bool = False
    qk_norm: bool = False
    post_norms: bool = False  # Gemma: norms after attention and after the FFN as well
    embed_scale: float = 1.0
    final_softcap: float = 0.0
    attn_softcap: float = 0.0
    sliding_window: int = 0
    swa_layers: tuple[bool, ...] = ()  # per layer: does it use the sliding window
    # Mixture of experts (n_expert == 0: dense FFN)
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    expert_weights_norm: bool = False
    n_ff_shexp: int = 0
    shared_expert_gate: bool = False
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def is_moe(self) -> bool:
        return self.n_expert > 0

    def is_swa(self, layer: int) -> bool:
        return bool(self.swa_layers) and self.swa_layers[layer]


class Meta:
    """Typed access to `{arch}.*` keys with errors that name the key."""

    def __init__(self, metadata: Mapping[str, Any], arch: str) -> None:
        self.m = metadata
        self.arch = arch

    def key(self, template: str) -> str:
        return template.format(arch=self.arch)

    def has(self, template: str) -> bool:
        return self.key(template) in self.m

    def get(self, template: str, default: Any = None) -> Any:
        return self.m.get(self.key(template), default)

    def req(self, template: str) -> Any:
        k = self.key(template)
        if k not in self.m:
            raise ModelConfigError(
                f"metadata key {k} is missing; the file is not a complete {self.arch} model"
            )
        return self.m[k]

    def int(self, template: str, default: int | None = None) -> int:
        v = self.req(template) if default is None else self.get(template, default)
        if hasattr(v, "__len__"):  # per-layer arrays (e.g. head_count_kv): all layers must agree here
            values = {int(x) for x in v}
            if len(values) != 1:
                raise ModelConfigError(
                    f"metadata key {self.key(template)} varies per layer ({sorted(values)}), unsupported"
                )
            v = values.pop()
        return int(v)

    def float(self, template: str, default: float | None = None) -> float:
        v = self.req(template) if default is None else self.get(template, default)
        return float(v)


def rope_from_meta(m: Meta, head_dim: int, neox: bool, default_base: float = 10000.0) -> RopeConfig:
    scaling = str(m.get(Keys.Rope.SCALING_TYPE, "none") or "none").lower()
    factor = m.float(Keys.Rope.SCALING_FACTOR, 1.0)
    if scaling not in ("none", "linear", "yarn"):
        raise ModelConfigError(f"RoPE scaling {scaling!r} is not supported (supported: none, linear, yarn)")
    if scaling != "none" and factor <= 0:
        raise ModelConfigError(f"RoPE scaling factor {factor} must be positive")
    return RopeConfig(
        dim=bounded(m, Keys.Rope.DIMENSION_COUNT, m.int(Keys.Rope.DIMENSION_COUNT, head_dim)),
        base=m.float(Keys.Rope.FREQ_BASE, default_base),
        neox=neox,
        scaling=scaling,
        factor=factor if scaling != "none" else 1.0,
        orig_ctx=m.int(Keys.Rope.SCALING_ORIG_CTX_LEN, 0),
        yarn_ext_factor=m.float(Keys.Rope.SCALING_YARN_EXT_FACTOR, -1.0),
        yarn_attn_factor=m.float(Keys.Rope.SCALING_ATTN_FACTOR, 1.0),
        yarn_beta_fast=m.float(Keys.Rope.SCALING_YARN_BETA_FAST, 32.0),
        yarn_beta_slow=m.float(Keys.Rope.SCALING_YARN_BETA_SLOW, 1.0),
    )


# Bounds on the sizes read from metadata, checked before anything is sized from them (a RoPE table, a KV cache, a
# buffer): each well beyond every released model, so that only a damaged or hostile file meets one.
BOUNDS: dict[str, tuple[int, int]] = {
    "embedding_length": (1, 1 << 17),
    "block_count": (1, 1 << 10),
    "attention.head_count": (1, 1 << 10),
    "attention.head_count_kv": (1, 1 << 10),
    "attention.key_length": (1, 1 << 12),
    "attention.value_length": (1, 1 << 12),
    "feed_forward_length": (0, 1 << 20),
    "context_length": (1, 1 << 24),
    "expert_count": (0, 1 << 13),
    "expert_feed_forward_length": (0, 1 << 18),
    "rope.dimension_count": (0, 1 << 12),
}


def bounded(m: Meta, template: str, value: int) -> int:
    """`value`, read from `template`'s key, within BOUNDS; a ModelConfigError naming the key otherwise."""
    name = template.split("{arch}.", 1)[-1]
    lo, hi = BOUNDS.get(name, (0, 1 << 62))
    if not lo <= value <= hi:
        raise ModelConfigError(
            f"metadata {m.key(template)} = {value} is outside {lo}..{hi}: the file is damaged or not a model "
            "this engine reads"
        )
    return value


def common_fields(m: Meta, n_vocab: int) -> dict[str, Any]:
    """The keys every decoder family carries, each within its bounds (BOUNDS)."""

    def size(template: str, default: int | None = None) -> int:
        return bounded(m, template, m.int(template, default))

    n_embd = size(Keys.LLM.EMBEDDING_LENGTH)
    n_head = size(Keys.Attention.HEAD_COUNT)
    n_head_kv = size(Keys.Attention.HEAD_COUNT_KV, n_head)
    if n_head % n_head_kv:
        raise ModelConfigError(f"head counts {n_head} / {n_head_kv} (query / key-value) are inconsistent")
    head_k = size(Keys.Attention.KEY_LENGTH, max(n_embd // n_head, 1))
    head_v = size(Keys.Attention.VALUE_LENGTH, head_k)
    return {
        "n_layer": size(Keys.LLM.BLOCK_COUNT),
        "n_embd": n_embd,
        "n_head": n_head,
        "n_head_kv": n_head_kv,
        "head_dim_k": head_k,
        "head_dim_v": head_v,
        "n_ff": size(Keys.LLM.FEED_FORWARD_LENGTH, 0),
        "n_vocab": n_vocab,
        "n_ctx_train": size(Keys.LLM.CONTEXT_LENGTH, 4096),
        "rms_eps": m.float(Keys.Attention.LAYERNORM_RMS_EPS, 1e-6),
        "attn_scale": head_k**-0.5,
        "final_softcap": m.float(Keys.LLM.FINAL_LOGIT_SOFTCAPPING, 0.0),
        "attn_softcap": m.float(Keys.LLM.ATTN_LOGIT_SOFTCAPPING, 0.0),
    }


def moe_fields(m: Meta, norm_default: bool, required: bool = False) -> dict[str, Any]:
    """The routed-expert keys; `required` for families that are MoE by definition."""
    n_expert = bounded(m, Keys.LLM.EXPERT_COUNT, m.int(Keys.LLM.EXPERT_COUNT, 0))
    used = m.int(Keys.LLM.EXPERT_USED_COUNT, 0)
    n_ff_exp = bounded(m, Keys.LLM.EXPERT_FEED_FORWARD_LENGTH, m.int(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH, 0))
    if required and (not n_expert or not n_ff_exp):
        raise ModelConfigError(f"{m.arch} needs expert_count and expert_feed_forward_length in the metadata")
    if n_expert and not 0 < used <= n_expert:
        raise ModelConfigError(f"expert_used_count {used} must be between 1 and expert_count {n_expert}")
    return {
        "n_expert": n_expert,
        "n_expert_used": used,
        "n_ff_exp": n_ff_exp,
        "expert_weights_norm": bool(m.get(Keys.LLM.EXPERT_WEIGHTS_NORM, norm_default)),
    }
