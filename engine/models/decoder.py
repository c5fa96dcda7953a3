"""The decoder stack shared by the transformer families (llama, qwen2, qwen3, qwen2moe, qwen3moe, gemma3).

Each family's file only turns its metadata into a `ModelConfig`; the differences in the math (biases, QK norms,
post norms, sliding windows, shared experts, RoPE layout) are flags of that config. A model can be loaded for a
range of layers only (a pipeline stage), with or without the embedding and the output head."""

from dataclasses import dataclass

import torch

from engine.experts.cache import ExpertCache
from engine.experts.policy import ExpertPolicy, build_expert_cache
from engine.gguf import names
from engine.gguf.quants import SUPPORTED_TYPES
from engine.gguf.reader import GGUFError, GGUFFile
from engine.layers import fast_decode
from engine.layers.attention import attention, causal_mask, project_qkv
from engine.layers.kv_cache import KVCache
from engine.layers.moe import ACTIVATIONS, ExpertWeights, moe_forward, moe_forward_cached
from engine.layers.norm import rms_norm
from engine.layers.qtensor import QTensor
from engine.layers.rope import Rope
from engine.models.config import ModelConfig
from engine.pipeline.cuda_graphs import DecodeGraphs


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


class _Loader:
    def __init__(self, gf: GGUFFile, device: torch.device) -> None:
        self.gf = gf
        self.device = device

    def has(self, name: str) -> bool:
        return name in self.gf.tensors

    def q(self, name: str, host: bool = False) -> QTensor:
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
                f"{self.gf.path}: tensor {name} has block type {info.qtype.name}, supported: {supported}"
            )
        raw = self.gf.tensor_bytes(name)
        if self.device.type != "cpu" and not host:
            raw = raw.to(self.device)
        return QTensor(raw, info.qtype, info.shape)

    def f(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        t = self.q(name).dequant(torch.float32)
        if shape is not None and tuple(t.shape) != shape:
            raise GGUFError(self.gf.path, f"tensor {name} has shape {tuple(t.shape)}, expected {shape}", "")
        return t

    def opt_f(self, name: str) -> torch.Tensor | None:
        return self.f(name) if self.has(name) else None

    def opt_q(self, name: str) -> QTensor | None:
        return self.q(name) if self.has(name) else None


def _check_shape(gf: GGUFFile, qt: QTensor, name: str, shape: tuple[int, ...]) -> QTensor:
    if qt.shape != shape:
        raise GGUFError(
            gf.path, f"tensor {name} has shape {qt.shape}, expected {shape} from the metadata", ""
        )
    return qt


class DecoderLM:
    """Layers `layers` of a decoder model on `device`, computing in `dtype`."""

    def __init__(
        self,
        cfg: ModelConfig,
        gf: GGUFFile,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        layers: range | None = None,
        embed: bool = True,
        head: bool = True,
        experts: ExpertPolicy | None = None,
        cuda_graphs: bool = True,
    ) -> None:
        self.cfg = cfg
        self.device = torch.device(device)
        self.dtype = dtype
        self.layer_range = layers if layers is not None else range(cfg.n_layer)
        ld = _Loader(gf, self.device)
        d = cfg.n_embd
        self.token_embd = (
            _check_shape(gf, ld.q(names.TOKEN_EMBD), names.TOKEN_EMBD, (cfg.n_vocab, d))
            if embed or (head and not ld.has(names.OUTPUT))
            else None
        )
        self.has_embed = embed
        self.has_head = head
        self.output_norm = ld.f(names.OUTPUT_NORM, (d,)).to(self.device) if head else None
        self.output: QTensor | None = None
        if head:
            if ld.has(names.OUTPUT):
                self.output = _check_shape(gf, ld.q(names.OUTPUT), names.OUTPUT, (cfg.n_vocab, d))
            else:
                self.output = self.token_embd  # tied embeddings
        freq_factors = ld.opt_f(names.ROPE_FREQS)
        self.rope = Rope(cfg.rope, freq_factors)
        self.rope_swa = (
            Rope(cfg.rope, freq_factors, base=cfg.rope.base_swa) if cfg.rope.base_swa else self.rope
        )
        # On CUDA the routed experts stay on the host here; the expert cache decides which go to VRAM.
        self._experts_on_host = self.device.type == "cuda" and cfg.is_moe
        self.layers = {i: self._load_layer(ld, gf, i) for i in self.layer_range}
        self.expert_cache: ExpertCache | None = None
        if self._experts_on_host:
            self.expert_cache = build_expert_cache(self, experts or ExpertPolicy())
        self.graphs = DecodeGraphs(self) if cuda_graphs and self.device.type == "cuda" else None
        # Expert selections per (layer, expert) since load: the usage profile's raw counts.
        self.expert_counts = (
            torch.zeros(cfg.n_layer, cfg.n_expert, dtype=torch.int64, device=self.device)
            if cfg.is_moe
            else None
        )
        if self.expert_cache is not None and self.expert_counts is not None:
            self.expert_cache.attach_counts(self.expert_counts)
        self.fast = fast_decode.available(self)
        if self.fast:
            for lw in self.layers.values():
                self._fuse_qkv(lw)

    def _fuse_qkv(self, lw: LayerWeights) -> None:
        fused = fast_decode.fuse_qkv(lw.q, lw.k, lw.v)
        if fused is not None:
            lw.qkv, lw.q, lw.k, lw.v = fused
        if lw.q_bias is not None or lw.k_bias is not None or lw.v_bias is not None:
            parts = [
                b if b is not None else torch.zeros(w.shape[0], device=self.device)
                for w, b in ((lw.q, lw.q_bias), (lw.k, lw.k_bias), (lw.v, lw.v_bias))
            ]
            lw.qkv_bias = torch.cat(parts).to(self.dtype)

    def _load_layer(self, ld: _Loader, gf: GGUFFile, i: int) -> LayerWeights:
        c = self.cfg
        n = names.blk
        qd, kd, vd = c.n_head * c.head_dim_k, c.n_head_kv * c.head_dim_k, c.n_head_kv * c.head_dim_v
        dev = self.device

        def f(part: str, shape: tuple[int, ...]) -> torch.Tensor:
            return ld.f(n(i, part), shape).to(dev)

        def opt(part: str, suffix: str) -> torch.Tensor | None:
            t = ld.opt_f(n(i, part, suffix))
            return t.to(dev) if t is not None else None

        def q(part: str, shape: tuple[int, ...]) -> QTensor:
            return _check_shape(gf, ld.q(n(i, part)), n(i, part), shape)

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
                return _check_shape(gf, ld.q(n(i, part), host=host), n(i, part), shape)

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

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [T] -> hidden [T, D]"""
        assert self.token_embd is not None
        h = self.token_embd.rows(tokens, torch.float32)
        if self.cfg.embed_scale != 1.0:
            h = h * self.cfg.embed_scale
        return h  # the residual stream stays float32; matmuls run in self.dtype

    def head(self, h: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        """hidden [T, D] -> logits [T, V] (float32); [1, V] for the last row only with `last_only` (a prompt
        chunk, whose other rows' logits nobody reads: 2.5 GB of them for 4,096 tokens of a 152k vocabulary)."""
        assert self.output is not None and self.output_norm is not None
        x = rms_norm(h[-1:] if last_only else h.float(), self.output_norm, self.cfg.rms_eps, self.dtype)
        logits = self.output.linear(x).float()
        cap = self.cfg.final_softcap
        if cap > 0:
            logits = cap * torch.tanh(logits / cap)
        return logits

    def layer(self, i: int, h: torch.Tensor, cache: KVCache, start: int) -> torch.Tensor:
        """hidden [T, D] at positions start..start+T -> hidden [T, D]"""
        pos = torch.arange(start, start + h.shape[0], device=h.device)
        return self.layer_at(i, h, cache, pos, start + h.shape[0])

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
        c, lw = self.cfg, self.layers[i]
        t = h.shape[0]
        if self.fast and t <= fast_decode.FAST_MAX_ROWS and cache.kv_type != "int8" and h.is_cuda:
            return fast_decode.layer(self, i, h, cache, pos, span)
        h = h.float()
        x = rms_norm(h, lw.attn_norm, c.rms_eps, self.dtype)
        q, k, v = project_qkv(x, lw.q, lw.k, lw.v, lw.q_bias, lw.k_bias, lw.v_bias)
        q = q.view(t, c.n_head, c.head_dim_k)
        k = k.view(t, c.n_head_kv, c.head_dim_k)
        v = v.view(t, c.n_head_kv, c.head_dim_v)
        swa = c.is_swa(i)
        rope = self.rope_swa if swa else self.rope
        q = rope.apply_at(q, pos, lw.q_norm, c.rms_eps)
        k = rope.apply_at(k, pos, lw.k_norm, c.rms_eps)
        keys, values = cache.store(i, pos, k, v, span)
        window = c.sliding_window if swa else 0
        mask = masks[window] if masks is not None and window in masks else causal_mask(pos, span, window)
        a = attention(q, keys, values, mask, c.attn_scale, c.attn_softcap).reshape(t, c.n_head * c.head_dim_v)
        a = lw.o.linear(a)
        if lw.post_attn_norm is not None:
            a = rms_norm(a, lw.post_attn_norm, c.rms_eps)
        h = h + a.float()
        x = rms_norm(h, lw.ffn_norm, c.rms_eps, self.dtype)
        f = self._ffn(i, lw, x)
        if lw.post_ffw_norm is not None:
            f = rms_norm(f, lw.post_ffw_norm, c.rms_eps)
        return h + f.float()

    def _ffn(self, i: int, lw: LayerWeights, x: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        act = ACTIVATIONS[c.activation]
        if lw.experts is None:
            assert lw.ffn_gate is not None and lw.ffn_up is not None and lw.ffn_down is not None
            return lw.ffn_down.linear(act(lw.ffn_gate.linear(x)) * lw.ffn_up.linear(x))
        counts = self.expert_counts[i] if self.expert_counts is not None else None
        if self.expert_cache is not None:
            y = moe_forward_cached(
                x, self.expert_cache, i, c.n_expert_used, c.expert_weights_norm, c.activation, counts
            )
        else:
            y = moe_forward(x, lw.experts, c.n_expert_used, c.expert_weights_norm, c.activation, counts)
        if lw.shexp_gate is not None:
            assert lw.shexp_up is not None and lw.shexp_down is not None
            s = lw.shexp_down.linear(act(lw.shexp_gate.linear(x)) * lw.shexp_up.linear(x))
            if lw.shexp_gate_inp is not None:
                s = s * torch.sigmoid(x.float() @ lw.shexp_gate_inp).unsqueeze(-1).to(s.dtype)  # [T, 1]
            y = y + s
        return y

    def forward(
        self, tokens: torch.Tensor, cache: KVCache, start: int, last_only: bool = False
    ) -> torch.Tensor:
        """A whole-model step: tokens [T] -> logits [T, V] ([1, V] with `last_only`); the cache then holds
        start+T positions."""
        t = tokens.shape[0]
        if t == 1 and self.graphs is not None and self.graphs.usable:
            logits = self.graphs.step(tokens, cache, start)
        else:
            pos = torch.arange(start, start + t, device=self.device)
            logits = self.forward_at(tokens.to(self.device), cache, pos, start + t, last_only)
        cache.length = start + t
        return logits

    def forward_at(
        self, tokens: torch.Tensor, cache: KVCache, pos: torch.Tensor, span: int, last_only: bool = False
    ) -> torch.Tensor:
        """tokens [T] at positions `pos` (device) -> logits [T, V]; capturable in a CUDA graph."""
        h = self.embed(tokens)
        # One mask per window size for the whole step, not one per layer.
        masks = {w: causal_mask(pos, span, w) for w in {0, self.cfg.sliding_window}}
        for i in self.layer_range:
            h = self.layer_at(i, h, cache, pos, span, masks)
        return self.head(h, last_only)

    def new_cache(self, max_ctx: int, kv_type: str) -> KVCache:
        c = self.cfg
        return KVCache(
            self.layer_range, max_ctx, c.n_head_kv, c.head_dim_k, c.head_dim_v, kv_type, self.device
        )
