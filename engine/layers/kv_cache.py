"""Per-layer key/value cache of one sequence: float (f32/f16/bf16) or int8 with a scale per token and head."""

from dataclasses import dataclass

import torch

from engine.gguf.model_config import ModelConfig

KV_TYPES = ("auto", "f32", "f16", "bf16", "int8")
_FLOAT = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


class KVCacheError(ValueError):
    pass


@dataclass
class _LayerKV:
    k: torch.Tensor  # [ctx, Hkv, Dk] (int8 or float)
    v: torch.Tensor  # [ctx, Hkv, Dv]
    k_scale: torch.Tensor | None = None  # [ctx, Hkv, 1] for int8
    v_scale: torch.Tensor | None = None


def resolve_kv_type(kv: str, compute_dtype: torch.dtype) -> str:
    if kv not in KV_TYPES:
        raise KVCacheError(f"--kv {kv!r} is not a KV cache type; use one of {', '.join(KV_TYPES)}")
    if kv != "auto":
        return kv
    return {torch.float32: "f32", torch.float16: "f16"}.get(compute_dtype, "bf16")


def _quant8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp_min(1e-8) / 127.0  # [T, H, 1]
    q = torch.round(x.float() / scale).clamp_(-127, 127).to(torch.int8)
    return q, scale.to(torch.float16)


class KVCache:
    """KV for the layers `layers` of one sequence, up to `max_ctx` positions."""

    def __init__(
        self,
        layers: range,
        max_ctx: int,
        n_head_kv: int,
        head_dim_k: int,
        head_dim_v: int,
        kv_type: str,
        device: torch.device,
    ) -> None:
        if kv_type not in _FLOAT and kv_type != "int8":
            raise KVCacheError(f"KV type {kv_type!r} must be resolved first (f32, f16, bf16 or int8)")
        self.kv_type = kv_type
        self.max_ctx = max_ctx
        self.length = 0  # positions filled
        self.layers: dict[int, _LayerKV] = {}
        for i in layers:
            if kv_type == "int8":
                self.layers[i] = _LayerKV(
                    torch.zeros(max_ctx, n_head_kv, head_dim_k, dtype=torch.int8, device=device),
                    torch.zeros(max_ctx, n_head_kv, head_dim_v, dtype=torch.int8, device=device),
                    torch.zeros(max_ctx, n_head_kv, 1, dtype=torch.float16, device=device),
                    torch.zeros(max_ctx, n_head_kv, 1, dtype=torch.float16, device=device),
                )
            else:
                dt = _FLOAT[kv_type]
                self.layers[i] = _LayerKV(
                    torch.zeros(max_ctx, n_head_kv, head_dim_k, dtype=dt, device=device),
                    torch.zeros(max_ctx, n_head_kv, head_dim_v, dtype=dt, device=device),
                )

    @property
    def nbytes(self) -> int:
        total = 0
        for lk in self.layers.values():
            for t in (lk.k, lk.v, lk.k_scale, lk.v_scale):
                if t is not None:
                    total += t.numel() * t.element_size()
        return total

    def store(
        self, layer: int, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor, span: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v [T, Hkv, D] at the positions `pos` [T] (a device tensor) and return the keys and values of
        positions 0..span-1, in the dtype of k. No host synchronisation: the step can be captured in a CUDA graph."""
        lk = self.write(layer, pos, k, v, span)
        if self.kv_type == "int8":
            keys = lk.k[:span].to(k.dtype) * lk.k_scale[:span].to(k.dtype)  # type: ignore[index]
            values = lk.v[:span].to(v.dtype) * lk.v_scale[:span].to(v.dtype)  # type: ignore[index]
            return keys, values
        return lk.k[:span].to(k.dtype), lk.v[:span].to(v.dtype)

    def write(self, layer: int, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor, span: int) -> _LayerKV:
        """Write k, v [T, Hkv, D] at the positions `pos` [T] and return the layer's own tensors (for a kernel that
        reads the cache as it lies); `span`: the positions the step attends to, checked against the cache's."""
        if span > self.max_ctx:
            raise KVCacheError(
                f"the sequence needs {span} positions but the KV cache holds {self.max_ctx} (--max-context)"
            )
        lk = self.layers[layer]
        if self.kv_type == "int8":
            qk, sk = _quant8(k)
            qv, sv = _quant8(v)
            lk.k.index_copy_(0, pos, qk)
            lk.k_scale.index_copy_(0, pos, sk)  # type: ignore[union-attr]
            lk.v.index_copy_(0, pos, qv)
            lk.v_scale.index_copy_(0, pos, sv)  # type: ignore[union-attr]
        else:
            lk.k.index_copy_(0, pos, k.to(lk.k.dtype))
            lk.v.index_copy_(0, pos, v.to(lk.v.dtype))
        return lk

    def truncate(self, length: int) -> None:
        """Forget positions >= length (a rejected draft, or a prompt-cache entry reused up to a prefix)."""
        self.length = min(self.length, length)

    # Set on the caches `split` makes: the cache they are rows of, and where their rows start in it.
    shared: "KVCache | None" = None
    base = 0
    # The sequence's index among a server's slots: a remote stage keeps that sequence's KV under this number.
    slot = 0

    def split(self, n: int) -> list["KVCache"]:
        """n caches of max_ctx // n positions each, views of this one's rows (slot s: rows s*m .. (s+1)*m - 1).
        One step can then read and write the rows of several sequences through this cache's tensors (each row at
        its cache's `base` + its position), while each sequence keeps a cache of its own."""
        m = self.max_ctx // n
        if n < 1 or m < 1:
            raise KVCacheError(f"cannot split {self.max_ctx} positions into {n} caches")
        out = []
        for s in range(n):
            c = object.__new__(KVCache)
            c.kv_type, c.max_ctx, c.length = self.kv_type, m, 0
            c.layers = {
                i: _LayerKV(*(None if t is None else t[s * m : (s + 1) * m] for t in (lk.k, lk.v, lk.k_scale, lk.v_scale)))
                for i, lk in self.layers.items()
            }  # fmt: skip
            c.shared, c.base = self, s * m
            out.append(c)
        return out


def kv_bytes_per_value(kv_type: str) -> float:
    return {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "int8": 1.0}[kv_type]


def kv_bytes_per_token(cfg: ModelConfig, kv_type: str) -> int:
    """K and V of one token in one layer at this KV type."""
    values = cfg.n_head_kv * (cfg.head_dim_k + cfg.head_dim_v)
    scales = 2 * cfg.n_head_kv * 2 if kv_type == "int8" else 0  # one f16 scale per head for K and for V
    return int(values * kv_bytes_per_value(kv_type)) + scales
