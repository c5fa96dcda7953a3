"""What the families with layer code of their own share (gpt-oss, qwen3next, deepseek2, glm4moe).

`FamilyLM` offers the surface `DecoderLM` offers, so the Runner, the server, the in-process split and the remote
stage drive these models the same way: `embed`, `layer(i, h, cache, start)`, `head`, `forward(tokens, cache,
start)`, `forward_at` (the CUDA-graph form of a step), `new_cache`, `device`, `dtype`, `cfg`, `layer_range`,
`layers` (each with its `experts`, which the expert cache reads), `expert_counts`, `expert_cache`, `graphs`.
A family supplies `_load_layer` and `layer_at`.

The routed experts run behind routing functions of the families' own (router biases, sigmoid scores with selection
biases, grouped top-k, scaled weights); each MoE layer then calls its `Experts` backend (`self.moe[i].mix`), chosen
in `attach_experts` by engine.experts.backends.choose (engine/layers/moe.py says which there are).

A model file builds a plain model: its weights on the device, its routed experts left in host RAM on CUDA. What
runs it fast is applied from outside by engine.pipeline.loader.prepare: the expert cache (`attach_experts`), the
CUDA graphs (`graphs`, `prompt_graphs`).
"""

from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from engine import kernels
from engine.experts.backends import choose
from engine.experts.cache import MAX_STEP_ROWS, ExpertCache
from engine.gguf import names
from engine.gguf.model_config import ModelConfig
from engine.gguf.quants import SUPPORTED_TYPES
from engine.gguf.reader import GGUFError, GGUFFile
from engine.layers.attention import causal_mask, flash_kernel, takes_flash
from engine.layers.kv_cache import KVCache
from engine.layers.moe import ExpertBiases, ExpertMath, Experts, ExpertWeights, Glu, silu_glu
from engine.layers.norm import rms_norm
from engine.layers.qtensor import QTensor


class Weights:
    """The tensors of one GGUF file, checked against the shapes the metadata implies, on `device`."""

    def __init__(self, gf: GGUFFile, device: torch.device) -> None:
        self.gf = gf
        self.device = device

    def has(self, name: str) -> bool:
        return name in self.gf.tensors

    def q(self, name: str, shape: tuple[int, ...] | None = None, host: bool = False) -> QTensor:
        """A weight in block format (`host`: stays in host memory, for the expert cache to place)."""
        info = self.gf.tensors.get(name)
        if info is None:
            raise GGUFError(
                self.gf.path,
                f"tensor {name} is missing",
                "the file is not a complete model of its architecture",
            )
        if info.qtype not in SUPPORTED_TYPES:
            supported = ", ".join(t.name for t in SUPPORTED_TYPES)
            raise GGUFError(
                self.gf.path,
                f"tensor {name} has block type {info.qtype.name}",
                f"this engine reads {supported}: use a file quantized to one of them",
            )
        if shape is not None and _squeezed(info.shape) != _squeezed(shape):
            raise GGUFError(
                self.gf.path, f"tensor {name} has shape {info.shape}, expected {shape} from the metadata", ""
            )
        raw = self.gf.tensor_bytes(name)
        if shape is not None and tuple(info.shape) != tuple(shape):  # e.g. [1, D] stored for a vector [D]
            raw = raw.reshape(*shape[:-1], raw.shape[-1])
        if self.device.type != "cpu" and not host:
            raw = raw.to(self.device)
        return QTensor(raw, info.qtype, shape if shape is not None else info.shape)

    def f(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """A small tensor (norm, bias, per-head constant) as float32 on the device."""
        return self.q(name, shape).dequant(torch.float32).to(self.device)

    def opt_f(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor | None:
        return self.f(name, shape) if self.has(name) else None

    def opt_q(self, name: str, shape: tuple[int, ...] | None = None) -> QTensor | None:
        return self.q(name, shape) if self.has(name) else None


def _squeezed(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(n for n in shape if n != 1)


@dataclass
class DenseFFN:
    gate: QTensor  # [F, D]
    up: QTensor  # [F, D]
    down: QTensor  # [D, F]

    def __call__(self, x: torch.Tensor, glu: Glu = silu_glu) -> torch.Tensor:
        return self.down.linear(glu(self.gate.linear(x), self.up.linear(x)))

    @classmethod
    def load(cls, w: Weights, i: int, suffix: str, d: int, f: int) -> "DenseFFN":
        """`suffix` "" for the dense FFN, "_shexp" for the shared expert."""
        n = names.blk
        return cls(
            w.q(n(i, "ffn_gate" + suffix), (f, d)),
            w.q(n(i, "ffn_up" + suffix), (f, d)),
            w.q(n(i, "ffn_down" + suffix), (d, f)),
        )


def load_experts(w: Weights, i: int, e: int, d: int, f: int, host: bool) -> ExpertWeights:
    """Router and routed experts of layer i: separate gate/up tensors, or the fused `ffn_gate_up_exps` whose first
    F rows of each expert are the gate and the next F the up projection (views, nothing is copied)."""
    n = names.blk
    router = w.q(n(i, "ffn_gate_inp"), (e, d))
    if w.has(n(i, "ffn_gate_up_exps")):
        gu = w.q(n(i, "ffn_gate_up_exps"), (e, 2 * f, d), host=host)
        gate = QTensor(gu.raw[:, :f], gu.qtype, (e, f, d))
        up = QTensor(gu.raw[:, f:], gu.qtype, (e, f, d))
    else:
        gate = w.q(n(i, "ffn_gate_exps"), (e, f, d), host=host)
        up = w.q(n(i, "ffn_up_exps"), (e, f, d), host=host)
    down = w.q(n(i, "ffn_down_exps"), (e, d, f), host=host)
    return ExpertWeights(router=router, gate=gate, up=up, down=down)


def load_expert_biases(w: Weights, i: int, e: int, d: int, f: int) -> ExpertBiases | None:
    n = names.blk
    if w.has(n(i, "ffn_gate_up_exps", "bias")):
        gu = w.f(n(i, "ffn_gate_up_exps", "bias"), (e, 2 * f))
        gate, up = gu[:, :f].contiguous(), gu[:, f:].contiguous()
    elif w.has(n(i, "ffn_gate_exps", "bias")):
        gate, up = w.f(n(i, "ffn_gate_exps", "bias"), (e, f)), w.f(n(i, "ffn_up_exps", "bias"), (e, f))
    else:
        return None
    return ExpertBiases(gate, up, w.f(n(i, "ffn_down_exps", "bias"), (e, d)))


class _Unattached(dict):  # type: ignore[type-arg]
    """The MoE backends of a model whose routed experts wait in host RAM for an expert cache (CUDA)."""

    def __missing__(self, key: int) -> Experts:
        raise RuntimeError(
            "this model's routed experts are in host RAM and no expert cache is attached: build models with "
            "engine.pipeline.loader.build (or call engine.pipeline.loader.prepare on one)"
        )


@dataclass(frozen=True)
class BatchPart:
    """One sequence's rows in a step of several sequences: its tokens [T], its own KV cache, the position of its
    first row. A decode row is a part of one token; a prompt chunk, a part of many; a verify window (--spec), a
    part of its token and drafts whose every row's logits are wanted (`logits` = T)."""

    tokens: torch.Tensor
    cache: KVCache
    start: int
    logits: int = 1  # logit rows wanted: the part's last `logits` rows


def logit_rows(parts: Sequence[BatchPart]) -> list[int]:
    """Where the wanted rows sit among all the parts' rows, in order (a step's logits hold these rows)."""
    out: list[int] = []
    end = 0
    for p in parts:
        end += int(p.tokens.shape[0])
        out.extend(range(end - p.logits, end))
    return out


@contextmanager
def scratch_steps(models: Sequence[Any], caches: Sequence[KVCache]) -> Iterator[None]:
    """Steps run only to build or capture something (at load): afterwards the caches hold nothing and each
    model's expert counts are as before them."""
    saved = [(m.expert_counts, m.expert_counts.clone()) for m in models if m.expert_counts is not None]
    try:
        yield
    finally:
        for c in caches:
            # a recurrent cache's states go back to the start with it (setting its length would not)
            c.truncate(0)
        for counts, before in saved:
            counts.copy_(before)


def one_row_each(p: BatchPart) -> bool:
    """Whether every row of the part is a decode row of its own: one token, or a verify window (every row's logits
    wanted) of up to a fused step's rows."""
    t = int(p.tokens.shape[0])
    return t == 1 or p.logits == t <= MAX_STEP_ROWS


def forward_each(model: Any, parts: Sequence[BatchPart]) -> torch.Tensor:
    """Several sequences, a forward each -> each part's wanted logit rows, in order [sum of logits, V] (what a model
    that cannot share a step's weight reads between sequences does)."""
    return torch.cat(
        [model.forward(p.tokens, p.cache, p.start, last_only=p.logits == 1)[-p.logits :] for p in parts]
    )


class FamilyLM:
    """Layers `layers` of a model of one family on `device`, computing in `dtype`; the residual stream stays
    float32. Subclasses load their layers (`_load_layer`) and run them (`layer_at`)."""

    # Prompt chunks as CUDA graphs (engine/pipeline/cuda_graphs.py PromptGraphs) where the family allows them and
    # the loader made them; the decode step's graphs likewise.
    supports_prompt_graphs = False
    prompt_graphs: Any = None
    graphs: Any = None
    # Prompt chunks attend through engine/kernels/prefill_attention.py on CUDA (layers.attention.cached_attention)
    # where the family's attention is plain or has sinks; set at load: `prefill_kernel`.
    supports_flash_prefill = True
    # The layers whose KV its caches keep in page-locked host RAM (--kv-resident; set at load, engine/pipeline/split.py)
    kv_host_layers: frozenset[int] = frozenset()

    def __init__(
        self,
        cfg: ModelConfig,
        gf: GGUFFile,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        layers: range | None = None,
        embed: bool = True,
        head: bool = True,
    ) -> None:
        self.cfg = cfg
        self.device = torch.device(device)
        self.dtype = dtype
        self.layer_range = layers if layers is not None else range(cfg.n_layer)
        self.prefill_kernel = flash_kernel(self.device) if self.supports_flash_prefill else None
        self.has_embed = embed
        self.has_head = head
        w = Weights(gf, self.device)
        d = cfg.n_embd
        self.token_embd = (
            w.q(names.TOKEN_EMBD, (cfg.n_vocab, d)) if embed or (head and not w.has(names.OUTPUT)) else None
        )
        self.output_norm = w.f(names.OUTPUT_NORM, (d,)) if head else None
        self.output: QTensor | None = None
        if head:
            self.output = w.q(names.OUTPUT, (cfg.n_vocab, d)) if w.has(names.OUTPUT) else self.token_embd
        # On CUDA the routed experts stay in host memory here; the expert cache decides which go to VRAM.
        self._experts_on_host = self.device.type == "cuda" and cfg.is_moe
        self._before_layers(gf)
        self.layers = {i: self._load_layer(w, i) for i in self.layer_range}
        self.expert_counts = (
            torch.zeros(cfg.n_layer, cfg.n_expert, dtype=torch.int64, device=self.device)
            if cfg.is_moe
            else None
        )
        self.expert_cache: ExpertCache | None = None
        self.moe: dict[int, Experts] = _Unattached()
        if not self.needs_expert_cache:
            self.attach_experts(None)

    @property
    def needs_expert_cache(self) -> bool:
        """Routed experts left in host RAM (CUDA): the model runs once an expert cache is attached."""
        return self._experts_on_host and any(
            getattr(lw, "experts", None) is not None for lw in self.layers.values()
        )

    def attach_experts(self, cache: ExpertCache | None) -> None:
        """Give each MoE layer its experts' backend: `cache`'s where one holds the routed experts (CUDA), else the
        layer's own blocks (engine.experts.backends.choose); then whatever the family sets up once they are placed."""
        self.expert_cache = cache
        attach = getattr(cache, "attach_counts", None)
        if attach is not None and self.expert_counts is not None:
            attach(self.expert_counts)  # the cache's hit rates derive from the selection counts
        self.moe = {
            i: choose(lw.experts, self._expert_math(i), cache, i)
            for i, lw in self.layers.items()
            if getattr(lw, "experts", None) is not None
        }
        self._after_experts()

    # ---- for the families ----

    def _before_layers(self, gf: GGUFFile) -> None:
        """Set-up the layers' loading or running needs (the shared decoder's RoPE tables)."""

    def _after_experts(self) -> None:
        """Once the experts are placed (the shared decoder's fused decode path)."""

    def _expert_math(self, i: int) -> ExpertMath:
        """What layer i's routed experts compute (SwiGLU by default)."""
        return ExpertMath()

    def _load_layer(self, w: Weights, i: int) -> object:
        raise NotImplementedError

    def layer_at(
        self,
        i: int,
        h: torch.Tensor,
        cache: KVCache,
        pos: torch.Tensor,
        span: int,
        masks: dict[int, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """One layer for the tokens at device positions `pos` [T], attending to cache positions below `span`."""
        raise NotImplementedError

    def _windows(self) -> set[int]:
        """The attention windows the layers use (0: the whole context), one mask each per step."""
        return {0}

    def _counts(self, i: int) -> torch.Tensor | None:
        """Layer i's usage counts (None for draft blocks past the main layers)."""
        c = self.expert_counts
        return c[i] if c is not None and i < self.cfg.n_layer else None

    def norm(
        self, x: torch.Tensor, weight: torch.Tensor | None, out_dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        return rms_norm(x, weight, self.cfg.rms_eps, out_dtype)

    # ---- the stage surface ----

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [T] -> hidden [T, D] float32"""
        assert self.token_embd is not None
        h = self.token_embd.rows(tokens, torch.float32)
        return h * self.cfg.embed_scale if self.cfg.embed_scale != 1.0 else h

    def head(self, h: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        """hidden [T, D] -> logits [T, V] float32 ([1, V], the last row's, with `last_only`)"""
        assert self.output is not None and self.output_norm is not None
        hf = h[-1:].float() if last_only else h.float()
        if self.output.reads_q8(hf):  # the norm writes the head's 8-bit input too (one launch fewer)
            x, _, xq = kernels.fused.rms_norm_q8(hf, self.output_norm, self.cfg.rms_eps, self.dtype)
            return self.output.linear(x, q8=xq).float()
        return self.output.linear(self.norm(hf, self.output_norm, self.dtype)).float()

    def layer(self, i: int, h: torch.Tensor, cache: KVCache, start: int) -> torch.Tensor:
        """hidden [T, D] at positions start..start+T -> hidden [T, D]"""
        pos = torch.arange(start, start + h.shape[0], device=h.device)
        return self.layer_at(i, h, cache, pos, start + h.shape[0])

    def forward(
        self, tokens: torch.Tensor, cache: KVCache, start: int, last_only: bool = False
    ) -> torch.Tensor:
        """A whole-model step: tokens [T] -> logits [T, V] ([1, V] with `last_only`); the cache then holds
        start+T positions."""
        logits = self._step(tokens, cache, start, last_only)
        cache.length = start + tokens.shape[0]
        return logits

    def _step(
        self, tokens: torch.Tensor, cache: KVCache, start: int, last_only: bool = False
    ) -> torch.Tensor:
        t = tokens.shape[0]
        if t == 1 and self.graphs is not None and self.graphs.usable:
            return self.graphs.step(tokens, cache, start)
        if last_only and self.prompt_graphs is not None and self.has_embed and self.has_head:
            # (a split's stage runs its own through LocalStage.run)
            logits = self.prompt_graphs.step(tokens.to(self.device), cache, start)
            if logits is not None:
                return logits
        pos = torch.arange(start, start + t, device=self.device)
        return self.forward_at(tokens.to(self.device), cache, pos, start + t, last_only)

    # Whether a prompt span may be read layer by layer (forward_span): every layer's state is its own KV rows (the
    # recurrent families keep a per-step state they check against the cache's length, and say False).
    layer_major = True

    @property
    def streams_experts(self) -> bool:
        """Whether prompt chunks stream routed experts from host RAM into VRAM (an expert cache that misses)."""
        ec = self.expert_cache
        return ec is not None and ec.streams_prompts

    def forward_batch(self, parts: Sequence[BatchPart]) -> torch.Tensor:
        """Several sequences in one step -> each part's wanted logit rows (its last row, a verify window's every
        row) in order [sum of logits, V]; each part's cache then holds its start+T positions. Here a forward per
        part (every family: recurrent state, latent attention); the shared decoder reads the weights once for all
        the parts (DecoderLM.forward_batch)."""
        return forward_each(self, parts)

    def forward_span(self, tokens: torch.Tensor, cache: KVCache, start: int, chunk: int) -> torch.Tensor:
        """A prompt span read layer by layer: tokens [T] -> the last row's logits [1, V]. Each layer reads the
        span's chunks of `chunk` tokens in order before the next layer starts, so the experts it keeps in host RAM
        are streamed into VRAM once for the whole span instead of once a chunk (on a 12 GB card with Qwen3-30B-A3B
        that is most of a chunk's time); the temporaries stay a chunk's, plus the span's residual stream (float32
        [T, D]). The same products as `forward` chunk by chunk, in another order."""
        t, dev = tokens.shape[0], self.device
        tokens = tokens.to(dev)
        h = torch.empty(t, self.cfg.n_embd, dtype=torch.float32, device=dev)
        cuts = [(s, min(s + chunk, t)) for s in range(0, t, chunk)]
        for s, e in cuts:
            h[s:e] = self.embed(tokens[s:e])
        pos = torch.arange(start, start + t, device=dev)
        ec = self.expert_cache
        for i in self.layer_range:
            with ec.hold_prompt_layer(i) if ec is not None else nullcontext():
                for s, e in cuts:
                    h[s:e] = self.layer_at(i, h[s:e], cache, pos[s:e], start + e)
        cache.length = start + t
        return self.head(h, last_only=True)

    def forward_at(
        self, tokens: torch.Tensor, cache: KVCache, pos: torch.Tensor, span: int, last_only: bool = False
    ) -> torch.Tensor:
        """tokens [T] at device positions `pos` -> logits [T, V]; capturable in a CUDA graph."""
        h = self.embed(tokens)
        masks = self.step_masks(pos, span)
        for i in self.layer_range:
            h = self.layer_at(i, h, cache, pos, span, masks)
        return self.head(h, last_only)

    def step_masks(self, pos: torch.Tensor, span: int) -> dict[int, torch.Tensor]:
        """The attention masks of one step at device positions `pos`, one per window the layers use: made once
        for all the layers a step runs, not once a layer (a few launches each); none where the rows attend
        through the flash kernel, which computes its own."""
        if takes_flash(self.prefill_kernel, pos.shape[0], span):
            return {}
        return {w: causal_mask(pos, span, w) for w in self._windows()}

    def new_cache(self, max_ctx: int, kv_type: str) -> KVCache:
        c = self.cfg
        return KVCache(
            self.layer_range, max_ctx, c.n_head_kv, c.head_dim_k, c.head_dim_v, kv_type, self.device,
            self.kv_host_layers,
        )  # fmt: skip

    def new_caches(self, n: int, max_ctx: int, kv_type: str) -> list[KVCache]:
        """The caches of n sequences that steps of several sequences (forward_batch) run together."""
        return [self.new_cache(max_ctx, kv_type) for _ in range(n)]


def grouped_route(
    x: torch.Tensor,
    router: QTensor,
    k: int,
    sigmoid: bool,
    score_bias: torch.Tensor | None = None,
    n_group: int = 1,
    topk_group: int = 1,
    norm: bool = False,
    scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek / GLM routing: x [T, D] -> weights [T, k] float32, ids [T, k].

    Scores are sigmoid (V3, GLM) or softmax (V2) of the router logits; `score_bias` shifts the scores for the
    choice only; with groups, only the experts of the `topk_group` best groups may be chosen (a group's score:
    the sum of its two best scores with sigmoid, its best with softmax); the weights are the chosen experts'
    unbiased scores, optionally renormalised, times `scale`. Float32 throughout: close scores must not flip."""
    logits = router.linear(x.float()).float()  # [T, E]
    scores = torch.sigmoid(logits) if sigmoid else torch.softmax(logits, dim=-1)
    choice = scores + score_bias if score_bias is not None else scores
    n_e = scores.shape[-1]
    if n_group > 1 and topk_group < n_group:
        grouped = choice.view(-1, n_group, n_e // n_group)  # [T, G, E/G]
        best = grouped.topk(2, dim=-1).values.sum(-1) if sigmoid else grouped.amax(-1)  # [T, G]
        keep = torch.zeros_like(best, dtype=torch.bool).scatter_(
            1, best.topk(topk_group, dim=-1).indices, True
        )
        choice = choice.masked_fill(~keep.repeat_interleave(n_e // n_group, dim=1), float("-inf"))
    ids = choice.topk(k, dim=-1).indices  # [T, k]
    w = scores.gather(1, ids)
    if norm:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return w * scale, ids
