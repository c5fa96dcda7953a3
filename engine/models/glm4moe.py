"""`glm4moe`: GLM-4.5 / GLM-4.5-Air / GLM-4.6 and relatives.

Attention with QKV biases, optional per-head QK norms and partial NEOX RoPE (half the head); the FFN is dense in
the first `leading_dense_block_count` layers, then DeepSeek-V3-style routed experts (sigmoid scores, selection
bias `exp_probs_b`, renormalised and scaled weights) plus shared experts. llama.cpp's converter stores the FFN norm
as `post_attention_norm`.

The file's `block_count` includes `nextn_predict_layers` multi-token-prediction blocks after the main layers:
block N (N = block_count - nextn) is a full decoder layer plus `nextn.eh_proj`, `nextn.enorm`, `nextn.hnorm`,
`nextn.shared_head_norm` and, in GLM-4.5 files, its own `nextn.embed_tokens` / `nextn.shared_head_head` (GLM-4.6
files leave them out: the model's token table and head serve). The model runs layers 0..N-1; the stage holding the
head also loads the draft block (`with_draft`) and offers `nextn_step`:

    g' = shared_head_norm(block N(eh_proj([enorm(embed(x_{i+1})), hnorm(g_i)])))   logits = head(g')

where g_i is the main model's final hidden state at position i after the output norm (the rows the head
multiplies, kept for the draft layer: `take_head_rows`), as vLLM, SGLang and llama.cpp's MTP graphs feed it. A
further draft step reads the draft's own g' (after shared_head_norm, what its head multiplies), as SGLang chains it
(vLLM chains the state before that norm; the verification keeps either choice exact). The draft block keeps its
KV under layer index N of the same cache, slot i for the pair (g_i, x_{i+1}); engine/pipeline/mtp.py drafts with it.
"""

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from gguf import Keys

from engine.gguf import names
from engine.gguf.model_config import Meta, ModelConfig, common_fields, rope_from_meta
from engine.gguf.reader import GGUFFile
from engine.layers.attention import cached_attention, project_qkv
from engine.layers.kv_cache import KVCache
from engine.layers.moe import ExpertMath, Experts, ExpertWeights, HostExperts
from engine.layers.qtensor import QTensor
from engine.layers.rope import Rope
from engine.models.deepseek2 import (
    GATING_SIGMOID,
    RoutedConfig,
    RoutedFFN,
    load_routed_ffn,
    routed_ffn,
    routed_fields,
)
from engine.models.family_base import FamilyLM, Weights

ARCH = "glm4moe"
# A captured step's head rows go to a buffer of fixed address, which its replays refill (windows have at most 33).
_GRAPH_ROWS = 64
_MAX_KEPT = 1 << 16  # rows kept for the draft layer between two takes (never reached while one drafts)


@dataclass(frozen=True)
class Glm4MoeConfig(RoutedConfig):
    nextn_layers: int = 0  # draft blocks after the main layers (block_count = n_layer + nextn_layers)


def config_from_metadata(meta: Mapping[str, Any], n_vocab: int) -> ModelConfig:
    m = Meta(meta, ARCH)
    base = common_fields(m, n_vocab)
    nextn = m.int(Keys.LLM.NEXTN_PREDICT_LAYERS, 0)
    base["n_layer"] -= nextn
    return Glm4MoeConfig(
        arch=ARCH,
        rope=rope_from_meta(m, base["head_dim_k"], neox=True),
        nextn_layers=nextn,
        **base,
        **routed_fields(m, ARCH, GATING_SIGMOID),
    )


@dataclass
class GlmLayer:
    attn_norm: torch.Tensor
    ffn_norm: torch.Tensor
    q: QTensor
    k: QTensor
    v: QTensor
    o: QTensor
    q_bias: torch.Tensor | None
    k_bias: torch.Tensor | None
    v_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    ffn: RoutedFFN

    @property
    def experts(self) -> ExpertWeights | None:
        return self.ffn.experts


@dataclass
class NextNWeights:
    block: GlmLayer
    eh_proj: QTensor  # [D, 2D]
    enorm: torch.Tensor
    hnorm: torch.Tensor
    head_norm: torch.Tensor
    embed: QTensor | None  # its own token table, else the model's
    head: QTensor | None  # its own output matrix, else the model's


class Glm4MoeLM(FamilyLM):
    cfg: Glm4MoeConfig
    layers: dict[int, GlmLayer]  # type: ignore[assignment]

    def __init__(self, cfg: ModelConfig, gf: Any, *args: Any, with_draft: bool = True, **kwargs: Any) -> None:
        super().__init__(cfg, gf, *args, **kwargs)
        # The draft block sits with the head (the last stage); its experts stay here, out of the expert cache.
        self.nextn: dict[int, NextNWeights] = {}
        self._draft_moe: dict[int, Experts] = {}
        if with_draft and self.has_head:
            w = Weights(gf, self.device)
            for j in range(cfg.n_layer, cfg.n_layer + cfg.nextn_layers):
                if w.has(names.blk(j, "nextn.eh_proj")):
                    self.nextn[j] = self._load_nextn(w, j)
        # The rows the head read since the draft layer last took them: eager calls in order (a prompt chunk read
        # in pieces on a split calls the head once per piece), a captured step's in its buffer.
        self._graph_rows = torch.zeros(_GRAPH_ROWS, cfg.n_embd, device=self.device) if self.nextn else None
        self._rows: list[torch.Tensor] = []
        self._keeping = False  # from the draft layer's first take on

    def _before_layers(self, gf: GGUFFile) -> None:
        assert isinstance(self.cfg, Glm4MoeConfig)
        self.rope = Rope(self.cfg.rope)

    def _load_layer(self, w: Weights, i: int) -> GlmLayer:
        c = self.cfg
        n, d, hd = names.blk, c.n_embd, c.head_dim_k
        qd, kd, vd = c.n_head * hd, c.n_head_kv * hd, c.n_head_kv * c.head_dim_v
        return GlmLayer(
            attn_norm=w.f(n(i, "attn_norm"), (d,)),
            ffn_norm=w.f(n(i, "post_attention_norm"), (d,)),
            q=w.q(n(i, "attn_q"), (qd, d)),
            k=w.q(n(i, "attn_k"), (kd, d)),
            v=w.q(n(i, "attn_v"), (vd, d)),
            o=w.q(n(i, "attn_output"), (d, c.n_head * c.head_dim_v)),
            q_bias=w.opt_f(n(i, "attn_q", "bias"), (qd,)),
            k_bias=w.opt_f(n(i, "attn_k", "bias"), (kd,)),
            v_bias=w.opt_f(n(i, "attn_v", "bias"), (vd,)),
            q_norm=w.opt_f(n(i, "attn_q_norm"), (hd,)),
            k_norm=w.opt_f(n(i, "attn_k_norm"), (hd,)),
            ffn=load_routed_ffn(self, w, i),
        )

    def _load_nextn(self, w: Weights, j: int) -> NextNWeights:
        n, d = names.blk, self.cfg.n_embd
        host, self._experts_on_host = self._experts_on_host, False  # the draft's experts go to the device
        try:
            block = self._load_layer(w, j)
        finally:
            self._experts_on_host = host
        v = self.cfg.n_vocab
        return NextNWeights(
            block=block,
            eh_proj=w.q(n(j, "nextn.eh_proj"), (d, 2 * d)),
            enorm=w.f(n(j, "nextn.enorm"), (d,)),
            hnorm=w.f(n(j, "nextn.hnorm"), (d,)),
            head_norm=w.f(n(j, "nextn.shared_head_norm"), (d,)),
            embed=w.opt_q(n(j, "nextn.embed_tokens"), (v, d)),
            head=w.opt_q(n(j, "nextn.shared_head_head"), (v, d)),
        )

    def _block(
        self,
        i: int,
        lw: GlmLayer,
        h: torch.Tensor,
        cache: KVCache,
        pos: torch.Tensor,
        span: int,
        masks: dict[int, torch.Tensor] | None,
        use_cache: bool = True,
    ) -> torch.Tensor:
        c = self.cfg
        t = h.shape[0]
        h = h.float()
        x = self.norm(h, lw.attn_norm, self.dtype)
        q, k, v = project_qkv(x, lw.q, lw.k, lw.v, lw.q_bias, lw.k_bias, lw.v_bias)
        q = self.rope.apply_at(q.view(t, c.n_head, c.head_dim_k), pos, lw.q_norm, c.rms_eps)
        k = self.rope.apply_at(k.view(t, c.n_head_kv, c.head_dim_k), pos, lw.k_norm, c.rms_eps)
        v = v.view(t, c.n_head_kv, c.head_dim_v)
        a = cached_attention(cache, i, q, k, v, pos, span, 0, c.attn_scale, 0.0, masks, self.prefill_kernel)
        a = a.reshape(t, c.n_head * c.head_dim_v)
        h = h + lw.o.linear(a).float()
        x = self.norm(h, lw.ffn_norm, self.dtype)
        # The draft block's experts are on the device, not in the expert cache.
        return h + routed_ffn(
            self, i, lw.ffn, x, self.moe.get(i) if use_cache else self._draft_experts(i, lw)
        )

    def _draft_experts(self, j: int, lw: GlmLayer) -> Experts | None:
        if lw.ffn.experts is None:
            return None
        if j not in self._draft_moe:
            self._draft_moe[j] = HostExperts(lw.ffn.experts, ExpertMath())
        return self._draft_moe[j]

    def layer_at(
        self,
        i: int,
        h: torch.Tensor,
        cache: KVCache,
        pos: torch.Tensor,
        span: int,
        masks: dict[int, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        return self._block(i, self.layers[i], h, cache, pos, span, masks)

    # ---- the draft (multi-token prediction) block ----

    @property
    def has_draft(self) -> bool:
        return bool(self.nextn)

    @property
    def draft_layer_count(self) -> int:
        return len(self.nextn)

    def head(self, h: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        """hidden [T, D] -> logits [T, V] float32; with a draft block, the normed rows are kept for it."""
        assert self.output is not None and self.output_norm is not None
        x = self.norm(h.float(), self.output_norm, self.dtype)  # [T, D]
        if self._graph_rows is not None:
            if x.is_cuda and torch.cuda.is_current_stream_capturing():
                self._graph_rows[: x.shape[0]].copy_(x)
            elif self._keeping:
                if sum(r.shape[0] for r in self._rows) + x.shape[0] > _MAX_KEPT:
                    self._rows.clear()  # forwards outside a request's decode, which nobody took
                self._rows.append(x)
        return self.output.linear(x[-1:] if last_only else x).float()  # the draft block kept every row

    def take_head_rows(self, n: int) -> torch.Tensor:
        """The first n rows the head read since the last take (after the output norm, what it multiplies), float32
        [<= n, D] on the device, and forget them. The draft layer takes them after each forward; when a forward
        replayed a CUDA graph, they are that step's (the graph's warm-up runs, which precede it, read the same)."""
        assert self._graph_rows is not None, "the model has no draft block"
        self._keeping = True
        kept, self._rows = self._rows, []
        rows = self._graph_rows if not kept else kept[0] if len(kept) == 1 else torch.cat(kept)  # [T, D]
        return rows[:n].float()

    def head_hidden(self, h: torch.Tensor) -> torch.Tensor:
        """The main model's final hidden state as the draft reads it: after the output norm, float32 [T, D]."""
        assert self.output_norm is not None
        return self.norm(h.float(), self.output_norm)

    def nextn_step(
        self, tokens: torch.Tensor, hidden: torch.Tensor, cache: KVCache, start: int, depth: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft block `depth` at slots start..start+T-1: tokens [T] (x_{i+1}, the token after each position i),
        hidden [T, D] (g_i) -> (logits [T, V] for x_{i+2}, the block's normed output g' [T, D] float32, which a
        further step reads as its hidden state)."""
        j = self.cfg.n_layer + depth
        nw = self.nextn[j]
        t = tokens.shape[0]
        pos = torch.arange(start, start + t, device=self.device)
        table = nw.embed if nw.embed is not None else self.token_embd
        assert table is not None
        e = self.norm(table.rows(tokens.to(self.device), torch.float32), nw.enorm)
        x = torch.cat((e, self.norm(hidden.float(), nw.hnorm)), dim=-1).to(self.dtype)  # [T, 2D]
        h = nw.eh_proj.linear(x).float()
        h = self._block(j, nw.block, h, cache, pos, start + t, None, use_cache=False)
        g = self.norm(h, nw.head_norm, self.dtype)  # [T, D]
        out = nw.head if nw.head is not None else self.output
        assert out is not None
        return out.linear(g).float(), g.float()

    def new_cache(self, max_ctx: int, kv_type: str) -> KVCache:
        c = self.cfg
        layers = [*self.layer_range, *self.nextn]
        host = self.kv_host_layers
        return KVCache(layers, max_ctx, c.n_head_kv, c.head_dim_k, c.head_dim_v, kv_type, self.device, host)


MODEL_CLASS = Glm4MoeLM
