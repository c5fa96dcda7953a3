"""The decoder stack shared by the transformer families (llama, qwen2, qwen3, qwen2moe, qwen3moe, gemma3).

Each family's file only turns its metadata into a `ModelConfig`; the differences in the math (biases, QK norms,
post norms, sliding windows, shared experts, RoPE layout) are flags of that config. A model can be loaded for a
range of layers only (a pipeline stage), with or without the embedding and the output head."""

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from engine.experts.replay import TraceRoute
from engine.gguf import names
from engine.gguf.reader import GGUFFile
from engine.kernels import cpu_attention, cpu_blocks
from engine.layers.attention import ROW_BY_ROW, cached_attention, project_qkv
from engine.layers.kv_cache import KVCache, KVCacheError
from engine.layers.moe import ACTIVATIONS, ExpertMath, ExpertWeights, count_experts, route_and_count
from engine.layers.norm import rms_norm
from engine.layers.qtensor import QTensor, linear_many
from engine.layers.rope import Rope
from engine.models import fast_decode
from engine.models.family_base import (
    BatchPart,
    FamilyLM,
    Weights,
    forward_each,
    logit_rows,
    one_row_each,
    scratch_steps,
)


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor
    q: QTensor
    k: QTensor
    v: QTensor
    o: QTensor
    ffn_norm: torch.Tensor
    q_bias: torch.Tensor | None = None
    k_bias: torch.Tensor | None = None
    v_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    post_attn_norm: torch.Tensor | None = None
    post_ffw_norm: torch.Tensor | None = None
    ffn_gate: QTensor | None = None
    ffn_up: QTensor | None = None
    ffn_down: QTensor | None = None
    experts: ExpertWeights | None = None
    shexp_gate_inp: torch.Tensor | None = None
    shexp_gate: QTensor | None = None
    shexp_up: QTensor | None = None
    shexp_down: QTensor | None = None
    qkv: QTensor | None = None  # q, k and v in one weight (CUDA: one GEMV launch); q, k, v are views of it
    qkv_bias: torch.Tensor | None = None  # [qd + kd + vd] where the family has biases


class BatchRows:
    """Where each part's rows sit in a step of several sequences, on one device: the token ids, the positions,
    each part's row range, span and attention masks, and the index of the rows whose logits are wanted (each
    part's last row; a verify window's every row)."""

    def __init__(
        self,
        parts: Sequence[BatchPart],
        device: torch.device,
        step_masks: Callable[[torch.Tensor, int], dict[int, torch.Tensor]],
    ) -> None:
        self.cuts: list[tuple[int, int]] = []
        at = 0
        for p in parts:
            self.cuts.append((at, at + p.tokens.shape[0]))
            at += p.tokens.shape[0]
        self.tokens = torch.cat([p.tokens.to(device, non_blocking=True) for p in parts])
        self.spans = [p.start + (b - a) for p, (a, b) in zip(parts, self.cuts, strict=True)]
        self.pos = torch.cat(
            [torch.arange(p.start, span) for p, span in zip(parts, self.spans, strict=True)]
        ).to(device)
        self.masks = [
            step_masks(self.pos[a:b], span) for (a, b), span in zip(self.cuts, self.spans, strict=True)
        ]
        self.last = torch.tensor(logit_rows(parts), device=device)

    def done(self, parts: Sequence[BatchPart]) -> None:
        """Each part's cache now holds its rows."""
        for p, span in zip(parts, self.spans, strict=True):
            p.cache.length = span


class DecoderLM(FamilyLM):
    """Layers `layers` of a decoder model on `device`, computing in `dtype`: the families whose differences are flags
    of `ModelConfig` (the stage surface - embed, layers, head, forward, CUDA graphs - is `FamilyLM`'s)."""

    supports_prompt_graphs = True
    # While PromptGraphs captures a padded chunk: a device int64 [1], the rows whose expert selections count.
    counted_rows: torch.Tensor | None = None
    fast = False  # the fused decode path (engine/models/fast_decode.py), decided once loaded
    route_done: dict[int, torch.Tensor] | None = None  # its fused launches' counts (fast_decode.route_counts)
    # (next layer, its input, that input's attention norm in 8 bits), written by a layer's last launch
    prenormed: tuple[int, torch.Tensor, torch.Tensor] | None = None
    # Decode rows of several slots as CUDA graphs (engine/pipeline/cuda_graphs.py SlotGraphs), made by the loader.
    slot_graphs: Any = None
    # A routing trace replayed in place of the routers' choice, or recorded (engine/experts/replay.py): set by
    # engine.pipeline.loader.prepare before the CUDA graphs are made.
    traces_routes = True
    route_trace: TraceRoute | None = None
    _cpu_consts: dict[int, tuple[np.ndarray, ...]] | None = None  # _cpu_attention's per-layer arrays

    def _before_layers(self, gf: GGUFFile) -> None:
        freq_factors = Weights(gf, torch.device("cpu")).opt_f(
            names.ROPE_FREQS
        )  # the tables are set up on the host
        self.rope = Rope(self.cfg.rope, freq_factors)
        base_swa = self.cfg.rope.base_swa
        self.rope_swa = Rope(self.cfg.rope, freq_factors, base=base_swa) if base_swa else self.rope

    def _after_experts(self) -> None:
        self.fast = fast_decode.available(self)
        if self.fast:
            for lw in self.layers.values():
                self._fuse_qkv(lw)  # type: ignore[arg-type]
            self.route_done = fast_decode.route_counts(self)

    def _expert_math(self, i: int) -> ExpertMath:
        return ExpertMath.gated(self.cfg.activation)

    def _fuse_qkv(self, lw: LayerWeights) -> None:
        if lw.qkv is not None:  # fused already
            return
        fused = fast_decode.fuse_qkv(lw.q, lw.k, lw.v)
        if fused is not None:
            lw.qkv, lw.q, lw.k, lw.v = fused
        if lw.q_bias is not None or lw.k_bias is not None or lw.v_bias is not None:
            parts = [
                b if b is not None else torch.zeros(w.shape[0], device=self.device)
                for w, b in ((lw.q, lw.q_bias), (lw.k, lw.k_bias), (lw.v, lw.v_bias))
            ]
            lw.qkv_bias = torch.cat(parts).to(self.dtype)

    def _load_layer(self, w: Weights, i: int) -> LayerWeights:
        c = self.cfg
        n = names.blk
        qd, kd, vd = c.n_head * c.head_dim_k, c.n_head_kv * c.head_dim_k, c.n_head_kv * c.head_dim_v

        def f(part: str, shape: tuple[int, ...]) -> torch.Tensor:
            return w.f(n(i, part), shape)

        def opt(part: str, suffix: str) -> torch.Tensor | None:
            return w.opt_f(n(i, part, suffix))

        def q(part: str, shape: tuple[int, ...]) -> QTensor:
            return w.q(n(i, part), shape)

        lw = LayerWeights(
            attn_norm=f("attn_norm", (c.n_embd,)),
            q=q("attn_q", (qd, c.n_embd)),
            k=q("attn_k", (kd, c.n_embd)),
            v=q("attn_v", (vd, c.n_embd)),
            o=q("attn_output", (c.n_embd, c.n_head * c.head_dim_v)),
            ffn_norm=f("ffn_norm", (c.n_embd,)),
            q_bias=opt("attn_q", "bias"),
            k_bias=opt("attn_k", "bias"),
            v_bias=opt("attn_v", "bias"),
        )
        if c.qk_norm:
            lw.q_norm, lw.k_norm = f("attn_q_norm", (c.head_dim_k,)), f("attn_k_norm", (c.head_dim_k,))
        if c.post_norms:
            lw.post_attn_norm = f("post_attention_norm", (c.n_embd,))
            lw.post_ffw_norm = f("post_ffw_norm", (c.n_embd,))
        if c.is_moe:
            e, ff = c.n_expert, c.n_ff_exp
            host = self._experts_on_host

            def qe(part: str, shape: tuple[int, ...]) -> QTensor:
                return w.q(n(i, part), shape, host=host)

            lw.experts = ExpertWeights(
                router=q("ffn_gate_inp", (e, c.n_embd)),
                gate=qe("ffn_gate_exps", (e, ff, c.n_embd)),
                up=qe("ffn_up_exps", (e, ff, c.n_embd)),
                down=qe("ffn_down_exps", (e, c.n_embd, ff)),
            )
            if c.n_ff_shexp:
                sf = c.n_ff_shexp
                lw.shexp_gate = q("ffn_gate_shexp", (sf, c.n_embd))
                lw.shexp_up = q("ffn_up_shexp", (sf, c.n_embd))
                lw.shexp_down = q("ffn_down_shexp", (c.n_embd, sf))
                if c.shared_expert_gate:
                    lw.shexp_gate_inp = f("ffn_gate_inp_shexp", (c.n_embd,))
        else:
            lw.ffn_gate = q("ffn_gate", (c.n_ff, c.n_embd))
            lw.ffn_up = q("ffn_up", (c.n_ff, c.n_embd))
            lw.ffn_down = q("ffn_down", (c.n_embd, c.n_ff))
        return lw

    # ---- forward pieces (a pipeline stage calls the ones it owns) ----

    def head(self, h: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        """hidden [T, D] -> logits [T, V] (float32), soft-capped where the family caps them; [1, V] for the last row
        only with `last_only` (a prompt chunk, whose other rows' logits nobody reads)."""
        logits = super().head(h, last_only)
        cap = self.cfg.final_softcap
        return cap * torch.tanh(logits / cap) if cap > 0 else logits

    def _windows(self) -> set[int]:
        return {0, self.cfg.sliding_window}

    def layer_at(
        self,
        i: int,
        h: torch.Tensor,
        cache: KVCache,
        pos: torch.Tensor,
        span: int,
        masks: dict[int, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """One layer for the tokens at positions `pos` [T] (device), attending to cache positions below `span`
        (a static bound, so that a decode step can be captured in a CUDA graph)."""
        t = h.shape[0]
        if self.fast and t <= fast_decode.FAST_MAX_ROWS and h.is_cuda:
            return fast_decode.layer(self, i, h, cache, pos, span)
        if not h.is_cuda and t <= ROW_BY_ROW and span == int(pos[-1]) + 1:
            a = self._cpu_attention(i, h, pos, [(cache, 0, t)])
            if a is not None:
                return self.attn_out_ffn(i, h.float(), a)
        h, q, k, v = self.attn_in(i, h, pos)
        return self.attn_out_ffn(i, h, self.attn_core(i, q, k, v, cache, pos, span, masks))

    def new_caches(self, n: int, max_ctx: int, kv_type: str) -> list[KVCache]:
        """Where the fused decode path runs, the n caches are rows of one (KVCache.split): a step then decodes a
        row of every slot in one pass of fused launches, and one set of CUDA graphs serves every slot."""
        if n > 1 and self.slotted(kv_type):
            return self.new_cache(n * max_ctx, kv_type).split(n)
        return super().new_caches(n, max_ctx, kv_type)

    def slotted(self, kv_type: str) -> bool:
        """Whether decode rows of several sequences can share the fused decode path's launches."""
        return self.fast and self.has_embed and self.has_head

    def forward_batch(self, parts: Sequence[BatchPart]) -> torch.Tensor:
        """Several sequences in one step -> each part's wanted logit rows in order. Decode rows of slots that share
        one cache (new_caches) take the fused decode path together, up to FAST_MAX_ROWS rows a pass; the other
        rows (prompt chunks, verify windows) go through the norms, projections, FFNs and experts together (each
        weight and each chosen expert read once for all of them), and through attention part by part, each
        against its own cache; where prompt chunks run as CUDA graphs (PromptGraphs), each chunk runs from its
        own."""
        rows = [j for j, p in enumerate(parts) if p.cache.shared is not None and one_row_each(p)]
        if rows and not self.slotted(parts[rows[0]].cache.kv_type):
            rows = []
        out: list[torch.Tensor | None] = [None] * len(parts)
        if rows:
            # a verify window's rows are rows of the fused path too: each attends up to its own position, and the
            # window's earlier rows are in the cache by then (their K and V are written before any row attends)
            flat = [BatchPart(parts[j].tokens[r : r + 1], parts[j].cache, parts[j].start + r)
                    for j in rows for r in range(int(parts[j].tokens.shape[0]))]  # fmt: skip
            step = fast_decode.FAST_MAX_ROWS
            logits = torch.cat([self.decode_rows(flat[at : at + step]) for at in range(0, len(flat), step)])
            at = 0
            for j in rows:
                t = int(parts[j].tokens.shape[0])
                out[j] = logits[at : at + t]
                at += t
        rest = [j for j, o in enumerate(out) if o is None]
        if rest:
            # prompt chunks: each from its captured size's graphs where there are some (no launch-bound eager
            # pass over all of them together)
            each = (
                self.prompt_graphs is not None
                and self.has_embed
                and self.has_head
                and all(parts[j].tokens.shape[0] > 1 for j in rest)
            )
            part = [parts[j] for j in rest]
            logits = forward_each(self, part) if each else self._batch_rows(part)
            at = 0
            for j in rest:
                out[j] = logits[at : at + parts[j].logits]
                at += parts[j].logits
        return torch.cat(out)  # type: ignore[arg-type]

    def decode_rows(self, parts: Sequence[BatchPart]) -> torch.Tensor:
        """One decode row each of up to FAST_MAX_ROWS sequences whose caches are rows of one shared cache ->
        logits [P, V]: as a CUDA graph where the loader made them, else the fused launches eagerly."""
        shared = parts[0].cache.shared
        assert shared is not None and all(p.cache.shared is shared for p in parts)
        limit = parts[0].cache.max_ctx
        for p in parts:
            if p.start >= limit:
                raise KVCacheError(
                    f"the sequence needs {p.start + 1} positions but the KV cache holds {limit} (--max-context)"
                )
        tok = torch.cat(
            [p.tokens.to(self.device, non_blocking=True) for p in parts]
        )  # some drawn on the device
        pos = torch.tensor([p.start for p in parts])
        base = torch.tensor([p.cache.base for p in parts])
        top = max(p.start for p in parts) + 1
        if self.slot_graphs is not None:
            logits = self.slot_graphs.step(tok, pos, base, shared, top, limit)
        else:
            dev = self.device
            logits = self.forward_rows(tok.to(dev), shared, pos.to(dev), base.to(dev), top)
        for p in parts:
            p.cache.length = p.start + 1
        return logits

    def warm_rows(self, caches: Sequence[KVCache], most: int | None = None) -> int:
        """Run (and so capture) the decode rows of 1 .. `most` (default: a row of each slot; at most
        FAST_MAX_ROWS) of these slots once, rows past a row each at the next positions (a verify window's), and
        leave the caches and the expert counts as they were; -> the most rows warmed (0: no slot graphs here)."""
        if self.slot_graphs is None or not caches or caches[0].shared is None:
            return 0
        k = len(caches)
        n = min(most or k, fast_decode.FAST_MAX_ROWS)
        with scratch_steps([self], caches):
            for t in range(1, n + 1):
                self.decode_rows(
                    [BatchPart(torch.zeros(1, dtype=torch.long), caches[r % k], r // k) for r in range(t)]
                )
        return n

    def forward_rows(
        self,
        tokens: torch.Tensor,
        shared: KVCache,
        pos: torch.Tensor,
        base: torch.Tensor,
        span: int,
        head: bool = True,
    ) -> torch.Tensor:
        """tokens [T] of T sequences at device positions `pos` [T], each sequence's cache the rows of `shared`
        from base [T] on -> logits [T, V]; the fused decode path, capturable in a CUDA graph. A stage of a layer
        split without the token table takes hidden rows [T, D] instead; one without the head, or whose head runs
        after a remote chain (`head` False), gives them."""
        h = self.embed(tokens) if self.has_embed else tokens
        for i in self.layer_range:
            h = fast_decode.layer(self, i, h, shared, pos, span, base)
        return self.head(h) if self.has_head and head else h

    def _batch_rows(self, parts: Sequence[BatchPart]) -> torch.Tensor:
        """Every part's rows together through the general layer (attention part by part). One part alone takes
        `forward` (its decode graphs)."""
        if len(parts) == 1 or not (self.has_embed and self.has_head):
            return super().forward_batch(parts)
        rows = BatchRows(parts, self.device, self.step_masks)
        h = self.layers_batch(self.embed(rows.tokens), parts, rows, self.layer_range)
        rows.done(parts)
        return self.head(h.index_select(0, rows.last))

    def layers_batch(
        self, h: torch.Tensor, parts: Sequence[BatchPart], rows: "BatchRows", layers: range
    ) -> torch.Tensor:
        """hidden [R, D] of every part's rows (in order) -> after `layers` (a stage's, or the model's)."""
        seqs = [(p.cache, a, b) for p, (a, b) in zip(parts, rows.cuts, strict=True)]
        for i in layers:
            # a CPU step's decode rows: their attention in one kernel call a sequence
            fused = None if h.is_cuda else self._cpu_attention(i, h, rows.pos, seqs)
            if fused is not None:
                h = self.attn_out_ffn(i, h.float(), fused)
                continue
            h, q, k, v = self.attn_in(i, h, rows.pos)
            a = torch.cat(
                [
                    self.attn_core(i, q[a:b], k[a:b], v[a:b], p.cache, rows.pos[a:b], span, m)
                    for p, (a, b), span, m in zip(parts, rows.cuts, rows.spans, rows.masks, strict=True)
                ]
            )
            h = self.attn_out_ffn(i, h, a)
        return h

    # A layer in three pieces: the prompt path's CUDA graphs (engine/pipeline/cuda_graphs.py, PromptGraphs) capture
    # the first and the last, which touch neither the KV cache nor the span; the attention between runs eagerly.

    def attn_in(
        self, i: int, h: torch.Tensor, pos: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """hidden [T, D] -> (hidden as float32, queries [T, H, Dk], keys [T, Hkv, Dk], values [T, Hkv, Dv]): the
        attention norm, the projections and RoPE at positions `pos`."""
        c, lw = self.cfg, self.layers[i]
        t = h.shape[0]
        h = h.float()
        x = rms_norm(h, lw.attn_norm, c.rms_eps, self.dtype)
        if lw.qkv is not None:  # the fused weight: one decode and one matmul for the three (prompt chunks)
            qkv = lw.qkv.linear(x)
            if lw.qkv_bias is not None:
                qkv = qkv + lw.qkv_bias.to(qkv.dtype)
            qd, kd = c.n_head * c.head_dim_k, c.n_head_kv * c.head_dim_k
            q, k, v = qkv[:, :qd], qkv[:, qd : qd + kd], qkv[:, qd + kd :]
        else:
            q, k, v = project_qkv(x, lw.q, lw.k, lw.v, lw.q_bias, lw.k_bias, lw.v_bias)
        q = q.view(t, c.n_head, c.head_dim_k)
        k = k.view(t, c.n_head_kv, c.head_dim_k)
        v = v.view(t, c.n_head_kv, c.head_dim_v)
        rope = self.rope_swa if c.is_swa(i) else self.rope
        return h, rope.apply_at(q, pos, lw.q_norm, c.rms_eps), rope.apply_at(k, pos, lw.k_norm, c.rms_eps), v

    def _cpu_attention(
        self, i: int, h: torch.Tensor, pos: torch.Tensor, parts: Sequence[tuple[KVCache, int, int]]
    ) -> torch.Tensor | None:
        """attn_in and attn_core of a CPU step's decode rows in one kernel call a sequence after the projections
        (cpu_blocks.attend_step: the same kernels and operations, so the same bits; ~90 us a layer of torch
        operations and calls on 2 cores before): rows [a, b) of h at positions pos attend in `parts`' caches.
        None where that path does not apply (a cache other than float32, float copies of the weights, more than
        ROW_BY_ROW rows a sequence, a row over cpu_attention's MAX_MACS, a span past a cache)."""
        c, lw = self.cfg, self.layers[i]
        if lw.qkv is not None or self.dtype != torch.float32 or not cpu_blocks.available()[0]:
            return None
        p = pos.numpy() if pos.dtype == torch.int64 else pos.to(torch.int64).numpy()
        if c.n_head * (int(p.max()) + 1) * c.head_dim_k > cpu_attention.MAX_MACS:
            return None
        for cache, a, b in parts:
            lk = cache.layers.get(i)
            if (
                lk is None
                or b - a > ROW_BY_ROW
                or cache.kv_type != "f32"
                or int(p[b - 1]) >= cache.max_ctx
                or not lk.k.is_contiguous()
                or not lk.v.is_contiguous()
            ):
                return None
        x = rms_norm(h.float(), lw.attn_norm, c.rms_eps, self.dtype)
        q, k, v = linear_many([lw.q, lw.k, lw.v], x)
        if not all(y.dtype == torch.float32 and y.is_contiguous() for y in (q, k, v)):
            return None  # pragma: no cover - every CPU product gives fresh float32 rows
        if self._cpu_consts is None:
            self._cpu_consts = {}
        consts = self._cpu_consts.get(i)
        if consts is None:  # the layer's biases and norms as the kernel takes them, made once
            consts = self._cpu_consts[i] = tuple(
                t.detach().float().contiguous().numpy() if t is not None else np.zeros(0, np.float32)
                for t in (lw.q_bias, lw.k_bias, lw.v_bias, lw.q_norm, lw.k_norm)
            )
        rope = self.rope_swa if c.is_swa(i) else self.rope
        cos, sin = rope.cos_sin(pos)
        window = c.sliding_window if c.is_swa(i) else 0
        outs = [
            cpu_blocks.attend_step(
                q[a:b], k[a:b], v[a:b], consts, c.rms_eps, cos[a:b], sin[a:b], rope.cfg.dim, rope.cfg.neox,
                cache.layers[i].k, cache.layers[i].v, p[a:b], window, c.attn_scale, c.attn_softcap,
            )
            for cache, a, b in parts
        ]  # fmt: skip
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def attn_core(
        self,
        i: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: KVCache,
        pos: torch.Tensor,
        span: int,
        masks: dict[int, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Store k, v at `pos` and attend to cache positions below `span` -> [T, H * Dv]."""
        c = self.cfg
        window = c.sliding_window if c.is_swa(i) else 0
        a = cached_attention(
            cache, i, q, k, v, pos, span, window, c.attn_scale, c.attn_softcap, masks, self.prefill_kernel
        )
        return a.reshape(q.shape[0], c.n_head * c.head_dim_v)

    def attn_out_ffn(self, i: int, h: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """float32 hidden [T, D] and the attention's output [T, H * Dv] -> the layer's output [T, D]: the output
        projection, the residual adds and the FFN or experts."""
        c, lw = self.cfg, self.layers[i]
        a = lw.o.linear(a)
        if lw.post_attn_norm is not None:
            a = rms_norm(a, lw.post_attn_norm, c.rms_eps)
        # float32 + the compute dtype: one kernel that casts inside it (a.float() first was one launch more)
        h = h + a
        x = rms_norm(h, lw.ffn_norm, c.rms_eps, self.dtype)
        f = self._ffn(i, lw, x)
        if lw.post_ffw_norm is not None:
            f = rms_norm(f, lw.post_ffw_norm, c.rms_eps)
        return h + f

    def _ffn(self, i: int, lw: LayerWeights, x: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        act = ACTIVATIONS[c.activation]
        if lw.experts is None:
            assert lw.ffn_gate is not None and lw.ffn_up is not None and lw.ffn_down is not None
            g, u = linear_many([lw.ffn_gate, lw.ffn_up], x)  # decode rows on the CPU: one kernel call
            return lw.ffn_down.linear(act(g) * u)
        counts = self.expert_counts[i] if self.expert_counts is not None else None
        real = self.counted_rows  # a prompt chunk padded to a captured size: its pad rows do not count
        trace = self.route_trace
        own = counts if real is None and trace is None else None
        w, ids = route_and_count(x, lw.experts.router, c.n_expert_used, c.expert_weights_norm, own)  # [T, k]
        if trace is not None and counts is not None:
            w, ids = trace.apply(i, w, ids, counts, real)  # it counts too
        elif real is not None:
            count_experts(counts, ids, real)
        y = self.moe[i].mix(x, w, ids)
        if lw.shexp_gate is not None:
            assert lw.shexp_up is not None and lw.shexp_down is not None
            s = lw.shexp_down.linear(act(lw.shexp_gate.linear(x)) * lw.shexp_up.linear(x))
            if lw.shexp_gate_inp is not None:
                # a product and a sum per row, not a matrix-vector product: each row's gate is then the same
                # however many rows the step has (a verify window's logits equal one-token steps' on the CPU)
                g = (x.float() * lw.shexp_gate_inp).sum(-1, keepdim=True)  # [T, 1]
                s = s * torch.sigmoid(g).to(s.dtype)
            y = y + s
        return y
