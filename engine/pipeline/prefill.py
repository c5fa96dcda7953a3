"""`--prefill auto`: how many prompt tokens a forward reads on one card.

A longer chunk reads the experts' weights once for more tokens (on an H200 a 4,096-token chunk read a prompt at
11,401 tok/s, 512-token ones at 6,540: bench/results/ours_full.json), but its temporaries grow with it. On a GPU the
largest of 4096, 2048, 1024 and 512 tokens whose temporaries fit in the VRAM left once the KV cache still to come and
the reserve for other programs are counted; on a CPU 512.

Where a card keeps experts in host RAM, each chunk streams a layer's missed experts into VRAM (most of them: a chunk
of a few dozen tokens touches nearly every expert). A prompt is then read in spans of several chunks, layer by layer
(`span_tokens`), so that they cross PCIe once a span. Pure functions of their inputs, and wrappers that ask the
device."""

import logging

import torch

from engine.gguf.model_config import ModelConfig
from engine.layers.kv_cache import kv_bytes_per_token

log = logging.getLogger("strata.engine")

CHUNKS = (4096, 2048, 1024, 512)
SPAN_MAX = 16384  # a longer span streams the experts less often still, but holds its rows and delays progress
_SLACK = 1.5  # the caching allocator's rounding and fragmentation over the tensors themselves


def chunk_bytes(c: ModelConfig, chunk: int, span: int, flash: bool = False) -> int:
    """Bytes of temporaries a prompt chunk of `chunk` tokens attending to `span` positions holds at its peak: the
    routed experts' per-slot outputs (float32) and hidden rows, the residual stream and norms, q/k/v, and attention's
    keys and values repeated over the query heads (none where the flash kernel reads the cache in place: `flash`);
    times the allocator's slack."""
    k = max(1, c.n_expert_used)
    ff = c.n_ff_exp if c.n_expert_used else c.n_ff
    qkv = c.n_head * c.head_dim_k + 2 * c.n_head_kv * c.head_dim_k
    per_token = 4 * k * c.n_embd + 2 * k * ff + 24 * c.n_embd + 4 * qkv + 2 * c.n_head * c.head_dim_v
    attention = 0 if flash else 2 * c.n_head * span * (c.head_dim_k + c.head_dim_v)
    dense = 2 * c.n_embd * max(qkv, c.n_head * c.head_dim_v, ff if not c.n_expert_used else 0)
    return int(_SLACK * (chunk * per_token + attention + dense))


def auto_chunk(
    c: ModelConfig,
    cuda: bool,
    free_bytes: int,
    kv_bytes: int,
    reserve_bytes: int,
    max_ctx: int = 4096,
    flash: bool = False,
) -> int:
    """The chunk for `--prefill auto` (see the module's text); none longer than the context needs (a prompt of
    `max_ctx` tokens in one chunk), whose temporaries the room would then keep for nothing."""
    if not cuda:
        return CHUNKS[-1]
    room = free_bytes - kv_bytes - reserve_bytes
    top = min((n for n in CHUNKS if n >= max_ctx), default=CHUNKS[0])
    for chunk in CHUNKS:
        if chunk <= top and chunk_bytes(c, chunk, max_ctx, flash) <= room:
            return chunk
    return CHUNKS[-1]


def span_row_bytes(c: ModelConfig, tokens: int) -> int:
    """VRAM a span's residual stream takes: float32 [tokens, D], with the allocator's slack."""
    return int(_SLACK * 4 * c.n_embd) * tokens


def _flash(model: object) -> bool:
    """Whether the model's prompt chunks attend through the flash kernel (no repeated keys and values)."""
    return getattr(model, "prefill_kernel", None) is not None


def _reads_spans(model: object) -> bool:
    return bool(getattr(model, "layer_major", False) and getattr(model, "streams_experts", False))


def span_tokens(c: ModelConfig, chunk: int, room_bytes: int, max_ctx: int) -> int:
    """Tokens one forward of a prompt reads layer by layer (FamilyLM.forward_span) on a card that streams experts:
    the largest multiple of `chunk`, up to `max_ctx` and SPAN_MAX, whose residual stream (float32 [span, D], with
    the allocator's slack) fits in `room_bytes`, the VRAM left once a chunk's temporaries are counted; `chunk`
    where no larger one fits."""
    n = min(max_ctx, SPAN_MAX, max(room_bytes, 0) // span_row_bytes(c, 1))
    return max(chunk, n // chunk * chunk)


def _device_room(
    model: object, max_ctx: int, kv_type: str, budget_mib: int | None, slots: int = 1
) -> tuple[int, int] | None:
    """(bytes free, of `budget_mib` where given; bytes the KV caches still to come take: `slots` of `max_ctx`
    positions, the server's --parallel) for a one-card CUDA model; None for anything else."""
    dev = getattr(model, "device", None)
    cfg = getattr(model, "cfg", None)
    if not isinstance(dev, torch.device) or dev.type != "cuda" or not isinstance(cfg, ModelConfig):
        return None
    # the allocator's cached blocks are free for the chunk's temporaries too: count what is allocated, as the
    # expert budget does (on an H200 held to 8,246 MiB, ~650 MiB cached after loading had left no room for a span)
    cached = torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)
    if budget_mib is not None:
        free = budget_mib * (1 << 20) - torch.cuda.memory_allocated(dev)
    else:
        free = torch.cuda.mem_get_info(dev)[0] + cached
    ec = getattr(model, "expert_cache", None)
    free -= getattr(ec, "pending_bytes", 0)  # the experts' staging area, allocated at the first prompt
    layers = len(getattr(model, "layer_range", range(cfg.n_layer)))
    layers -= len(getattr(model, "kv_host_layers", ()))  # their KV lives in host RAM (--kv-resident)
    return free, max(1, slots) * layers * max_ctx * kv_bytes_per_token(cfg, kv_type)


def device_chunk(
    model: object, max_ctx: int, kv_type: str, budget_mib: int | None, reserve_mib: int, slots: int = 1
) -> int:
    """auto_chunk for a loaded one-card model: the VRAM free now (or left of `budget_mib`, --vram-budget-mib), less
    the KV caches of `slots` sequences still to come."""
    room = _device_room(model, max_ctx, kv_type, budget_mib, slots)
    if room is None:
        return CHUNKS[-1]
    free, kv = room
    cfg: ModelConfig = model.cfg  # type: ignore[attr-defined]
    if _reads_spans(model):
        # a span's rows first: streaming each layer's experts once a span gains more than a longer chunk (on an H200
        # at llama.cpp -ncmoe 36's VRAM, 1,024-token chunks without spans read 4,096 tokens at 3,455 tok/s)
        free -= span_row_bytes(cfg, min(max_ctx, SPAN_MAX))
    flash = _flash(model)
    chunk = auto_chunk(cfg, True, free, kv, reserve_mib << 20, max_ctx, flash)
    log.info(
        "prompt chunks of %d tokens (--prefill auto: ~%d MiB of temporaries; %d MiB free before the KV cache of "
        "%d MiB)",
        chunk,
        chunk_bytes(cfg, chunk, max_ctx, flash) >> 20,
        free >> 20,
        kv >> 20,
    )
    return chunk


def device_span(
    model: object,
    chunk: int,
    max_ctx: int,
    kv_type: str,
    budget_mib: int | None,
    reserve_mib: int,
    slots: int = 1,
) -> int:
    """span_tokens for a loaded one-card model that streams experts for its prompt chunks; `chunk` otherwise."""
    if not _reads_spans(model):
        return chunk
    room = _device_room(model, max_ctx, kv_type, budget_mib, slots)
    if room is None:
        return chunk
    free, kv = room
    cfg: ModelConfig = model.cfg  # type: ignore[attr-defined]
    span = span_tokens(
        cfg, chunk, free - kv - (reserve_mib << 20) - chunk_bytes(cfg, chunk, max_ctx, _flash(model)), max_ctx
    )
    if span > chunk:
        log.info("prompts read layer by layer, %d tokens at a time: each layer's experts in host RAM cross PCIe "
                 "once for them, not once a chunk", span)  # fmt: skip
    return span
