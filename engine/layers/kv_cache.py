"""Per-layer key/value cache of one sequence: float (f32/f16/bf16), int8 with a scale per token and head, or q4_0
(4-bit codes with a scale per 32 values, llama.cpp's `-ctk q4_0` rounding).

q4_0 keeps a head's D values as D/2 bytes: byte j holds value j in its low nibble and value j + D/2 in its high one,
so a kernel reads the head's two halves as two plain tiles; the scales are float16, one per 32 values ([ctx, Hkv,
D/32]). A value is scale * (code - 8), the scale being the block's value of largest magnitude divided by -8."""

import math
import mmap
from collections.abc import Collection
from dataclasses import dataclass

import torch

from engine.gguf.model_config import ModelConfig
from engine.layers.pinned import host_tensors

KV_TYPES = ("auto", "f32", "f16", "bf16", "int8", "q4_0")
_QUANT = ("int8", "q4_0")
Q4_BLOCK = 32
_FLOAT = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


class KVCacheError(ValueError):
    pass


@dataclass
class _LayerKV:
    k: torch.Tensor  # [ctx, Hkv, Dk] (int8 or float)
    v: torch.Tensor  # [ctx, Hkv, Dv]
    k_scale: torch.Tensor | None = None  # [ctx, Hkv, 1] for int8, [ctx, Hkv, D/32] for q4_0
    v_scale: torch.Tensor | None = None
    host: bool = False  # the tensors live in page-locked host RAM, read across PCIe (--kv-resident)

    def in_vram(self, span: int) -> "_LayerKV":
        """Positions below `span` copied into VRAM: a prompt chunk's attention reads each key block once for every
        block of query rows, so a layer whose KV lives in host RAM crosses PCIe once here rather than that often."""
        if not self.host:
            return self
        return _LayerKV(
            *(None if t is None else t[:span].clone() for t in (self.k, self.v, self.k_scale, self.v_scale))
        )


def resolve_kv_type(kv: str, compute_dtype: torch.dtype) -> str:
    if kv not in KV_TYPES:
        raise KVCacheError(f"--kv {kv!r} is not a KV cache type; use one of {', '.join(KV_TYPES)}")
    if kv != "auto":
        return kv
    return {torch.float32: "f32", torch.float16: "f16"}.get(compute_dtype, "bf16")


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed tensor; on the CPU an anonymous memory map, whose pages stay unmapped until written, so that a
    cache holds resident memory for the positions it has used rather than for its whole --max-context (torch.zeros
    writes every page; calloc does too where it reuses freed heap memory, which a heap's raised mmap threshold
    makes it do for buffers up to 32 MB)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if n < _MAPPED_BYTES:
        return torch.zeros(shape, dtype=dtype)
    # the tensor keeps the map alive (torch.frombuffer holds a reference to it)
    return torch.frombuffer(mmap.mmap(-1, n), dtype=torch.uint8).view(dtype).view(shape)


_MAPPED_BYTES = 1 << 20  # smaller buffers come from the heap: a map per buffer is not worth it


def quant8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp_min(1e-8) / 127.0  # [T, H, 1]
    q = torch.round(x.float() / scale).clamp_(-127, 127).to(torch.int8)
    return q, scale.to(torch.float16)


def quant4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] (D a multiple of 64) -> q4_0 codes [..., D/2] (uint8, halves packed as the module says) and
    float16 scales [..., D/32]. As llama.cpp's q4_0: d = (the block's value of largest magnitude) / -8, code =
    min(15, trunc(x / d + 8.5)); the codes come from the float d, the stored scale is d in float16. Where +a and -a
    tie for the largest magnitude, +a (as the kernels' writer, engine/kernels/attention.py _store_q4, decides)."""
    d_ = x.shape[-1]
    b = x.float().reshape(*x.shape[:-1], d_ // Q4_BLOCK, Q4_BLOCK)
    mx, mn = b.amax(-1, keepdim=True), b.amin(-1, keepdim=True)
    d = torch.where(-mn > mx, mn, mx) / -8.0  # the signed value of largest magnitude, over -8
    inv = torch.where(d == 0, torch.zeros_like(d), 1.0 / d)
    codes = torch.clamp(torch.trunc(b * inv + 8.5), 0, 15).to(torch.uint8).reshape(x.shape)
    lo, hi = codes[..., : d_ // 2], codes[..., d_ // 2 :]
    return lo | (hi << 4), d.squeeze(-1).to(torch.float16)


def dequant4(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q4_0 codes [..., D/2] and scales [..., D/32] -> values [..., D] in `dtype`."""
    q = torch.cat([codes & 15, codes >> 4], dim=-1).to(torch.float32) - 8.0
    blocks = q.reshape(*q.shape[:-1], -1, Q4_BLOCK) * scales.float().unsqueeze(-1)
    return blocks.reshape(q.shape).to(dtype)


def quantize_kv(kv_type: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Keys or values [..., D] as a cache of `kv_type` holds them: (int8 codes, their scale per row), (q4_0 codes,
    their scales per 32), or (x, None) for a float cache."""
    if kv_type == "int8":
        return quant8(x)
    if kv_type == "q4_0":
        return quant4(x)
    return x, None


def dequantize_kv(
    kv_type: str, codes: torch.Tensor, scales: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """A cache's keys or values of `kv_type` as values in `dtype` (int8's product taken in `dtype`)."""
    if kv_type == "int8":
        return codes.to(dtype) * scales.to(dtype)  # type: ignore[union-attr]
    if kv_type == "q4_0":
        return dequant4(codes, scales, dtype)  # type: ignore[arg-type]
    return codes.to(dtype)


def q4_head_dims_ok(*dims: int) -> bool:
    """q4_0 halves a head into two runs of whole 32-value blocks, and the kernels read it as power-of-two tiles."""
    return all(d in (64, 128, 256) for d in dims)


class KVCache:
    """KV for the layers `layers` of one sequence, up to `max_ctx` positions. The layers in `host_layers` keep
    theirs in page-locked host RAM (engine/layers/pinned.py host_tensors; on a CUDA device only): every kernel reads
    and writes them in place across PCIe, as the KV of the layers that do not fit the card (--kv-resident)."""

    def __init__(
        self,
        layers: range | Collection[int],
        max_ctx: int,
        n_head_kv: int,
        head_dim_k: int,
        head_dim_v: int,
        kv_type: str,
        device: torch.device,
        host_layers: Collection[int] = (),
    ) -> None:
        if kv_type not in _FLOAT and kv_type not in _QUANT:
            raise KVCacheError(f"KV type {kv_type!r} must be resolved first (f32, f16, bf16, int8 or q4_0)")
        if kv_type == "q4_0" and not q4_head_dims_ok(head_dim_k, head_dim_v):
            raise KVCacheError(
                f"--kv q4_0 needs key and value heads of 64, 128 or 256 values; this model's are {head_dim_k} and "
                f"{head_dim_v}: use --kv int8 (half the memory of bf16) instead"
            )
        self.kv_type = kv_type
        self.max_ctx = max_ctx
        self.length = 0  # positions filled
        self.layers: dict[int, _LayerKV] = {}
        device = torch.device(device)
        h = n_head_kv
        if kv_type == "int8":
            specs = [((max_ctx, h, head_dim_k), torch.int8), ((max_ctx, h, head_dim_v), torch.int8),
                     ((max_ctx, h, 1), torch.float16), ((max_ctx, h, 1), torch.float16)]  # fmt: skip
        elif kv_type == "q4_0":
            specs = [((max_ctx, h, head_dim_k // 2), torch.uint8), ((max_ctx, h, head_dim_v // 2), torch.uint8),
                     ((max_ctx, h, head_dim_k // Q4_BLOCK), torch.float16),
                     ((max_ctx, h, head_dim_v // Q4_BLOCK), torch.float16)]  # fmt: skip
        else:
            dt = _FLOAT[kv_type]
            specs = [((max_ctx, h, head_dim_k), dt), ((max_ctx, h, head_dim_v), dt)]
        on_host = [i for i in layers if i in host_layers] if device.type == "cuda" else []
        if on_host:
            try:
                tensors = host_tensors(specs * len(on_host), device)
            except (RuntimeError, TypeError, ValueError) as e:  # RAM short, or no mapping for the card
                need = sum(math.prod(sh) * torch.empty((), dtype=dt).element_size() for sh, dt in specs)
                raise KVCacheError(
                    f"could not pin {need * len(on_host) / 2**30:.1f} GiB of host RAM for the KV of {len(on_host)} "
                    f"layer(s) (--kv-resident) ({e}): raise --kv-resident, lower --max-context or --parallel, or "
                    "use a smaller --kv type"
                ) from e
            for j, i in enumerate(on_host):
                self.layers[i] = _LayerKV(*tensors[j * len(specs) : (j + 1) * len(specs)], host=True)
        for i in layers:
            if i not in self.layers:
                self.layers[i] = _LayerKV(*(_zeros(sh, dt, device) for sh, dt in specs))
        self.layers = {i: self.layers[i] for i in layers}  # in layer order

    @property
    def host_layers(self) -> list[int]:
        """The layers whose KV lives in host RAM."""
        return [i for i, lk in self.layers.items() if lk.host]

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
        ks, vs = (None, None) if lk.k_scale is None else (lk.k_scale[:span], lk.v_scale[:span])  # type: ignore[index]
        return (dequantize_kv(self.kv_type, lk.k[:span], ks, k.dtype),
                dequantize_kv(self.kv_type, lk.v[:span], vs, v.dtype))  # fmt: skip

    def write(self, layer: int, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor, span: int) -> _LayerKV:
        """Write k, v [T, Hkv, D] at the positions `pos` [T] and return the layer's own tensors (for a kernel that
        reads the cache as it lies); `span`: the positions the step attends to, checked against the cache's."""
        if span > self.max_ctx:
            raise KVCacheError(
                f"the sequence needs {span} positions but the KV cache holds {self.max_ctx} (--max-context)"
            )
        lk = self.layers[layer]
        if self.kv_type in ("int8", "q4_0"):
            for codes, scales, x in ((lk.k, lk.k_scale, k), (lk.v, lk.v_scale, v)):
                q, d = quantize_kv(self.kv_type, x)
                codes.index_copy_(0, pos, q)
                scales.index_copy_(0, pos, d)  # type: ignore[union-attr]
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
                i: _LayerKV(*(None if t is None else t[s * m : (s + 1) * m] for t in (lk.k, lk.v, lk.k_scale, lk.v_scale)),
                            host=lk.host)
                for i, lk in self.layers.items()
            }  # fmt: skip
            c.shared, c.base = self, s * m
            out.append(c)
        return out


def kv_bytes_per_value(kv_type: str) -> float:
    """Bytes a cached value costs, its share of the scales included (int8's per-head scale is counted apart)."""
    return {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "int8": 1.0, "q4_0": 0.5 + 2 / Q4_BLOCK}[kv_type]


def kv_bytes_per_token(cfg: ModelConfig, kv_type: str) -> int:
    """K and V of one token in one layer at this KV type."""
    values = cfg.n_head_kv * (cfg.head_dim_k + cfg.head_dim_v)
    scales = 2 * cfg.n_head_kv * 2 if kv_type == "int8" else 0  # one f16 scale per head for K and for V
    return int(values * kv_bytes_per_value(kv_type)) + scales
