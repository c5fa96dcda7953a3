"""The gated delta rule (Qwen3-Next's linear attention), its causal convolution, and the per-sequence cache that
holds the recurrent state next to the attention layers' KV.

Per value head, with a state S [Dk, Dv], a decay g_t <= 0 (log space), a write strength beta_t in (0, 1):
    S_t = exp(g_t) S_{t-1} + k_t u_t^T,   u_t = beta_t (v_t - exp(g_t) S_{t-1}^T k_t),   o_t = S_t^T q_t
`delta_rule_steps` runs it token by token (decode, and verify windows that keep every step's state);
`delta_rule_chunked` reads a prompt chunk in blocks of 64 tokens: inside a block the updates u solve one
unit-lower-triangular system, so the work is a few matrix products per block instead of one rank-1 update per token.
"""

from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.layers.kv_cache import KVCache

CHUNK = 64


def causal_conv(
    x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution with SiLU. x [T, C], state [K-1, C] (the inputs before x), weight [C, K]
    -> y [T, C], window [K-1+T, C] (state and x: its last K-1 rows are the next state)."""
    kw = weight.shape[1]
    window = torch.cat((state.to(x.dtype), x), dim=0)  # [K-1+T, C]
    taps = window.unfold(0, kw, 1)  # [T, C, K]
    y = (taps.float() * weight.float()).sum(-1)  # [T, C]
    return F.silu(y), window


def delta_rule_steps(
    q: torch.Tensor,  # [T, H, Dk]
    k: torch.Tensor,  # [T, H, Dk]
    v: torch.Tensor,  # [T, H, Dv]
    g: torch.Tensor,  # [T, H]
    beta: torch.Tensor,  # [T, H]
    state: torch.Tensor,  # [H, Dk, Dv] float32
    keep: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Token by token -> out [T, H, Dv] float32, final state, and with `keep` the state after every token
    [T, H, Dk, Dv]."""
    s = state
    outs, kept = [], []
    for t in range(q.shape[0]):
        s = s * torch.exp(g[t])[:, None, None]
        pred = torch.einsum("hk,hkv->hv", k[t], s)  # what the state already says for k_t
        u = (v[t] - pred) * beta[t][:, None]  # [H, Dv]
        s = s + k[t][:, :, None] * u[:, None, :]
        outs.append(torch.einsum("hk,hkv->hv", q[t], s))
        if keep:
            kept.append(s)
    return torch.stack(outs), s, torch.stack(kept) if keep else None


def delta_rule_chunked(
    q: torch.Tensor,  # [T, H, Dk]
    k: torch.Tensor,  # [T, H, Dk]
    v: torch.Tensor,  # [T, H, Dv]
    g: torch.Tensor,  # [T, H]
    beta: torch.Tensor,  # [T, H]
    state: torch.Tensor,  # [H, Dk, Dv] float32
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block by block -> out [T, H, Dv] float32 and the final state; the same values as `delta_rule_steps`."""
    s = state
    outs = []
    for a in range(0, q.shape[0], chunk):
        qc, kc, vc = (x[a : a + chunk].transpose(0, 1) for x in (q, k, v))  # [H, C, D]
        gc, bc = g[a : a + chunk].t(), beta[a : a + chunk].t()  # [H, C]
        n = qc.shape[1]
        cum = gc.cumsum(-1)  # [H, C]: log of the decay from the block start through t
        lower = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()  # s <= t
        rel = (cum[:, :, None] - cum[:, None, :]).masked_fill(~lower, float("-inf")).exp()  # [H, t, s]
        strict = rel.masked_fill(torch.eye(n, dtype=torch.bool, device=q.device), 0.0)
        # (I + A) U = beta V - beta exp(cum) K S0, with A[t, s] = beta_t exp(cum_t - cum_s) k_t.k_s for s < t
        a_mat = (bc[:, :, None] * (kc @ kc.transpose(1, 2))) * strict
        eye = torch.eye(n, dtype=a_mat.dtype, device=q.device)
        rhs = torch.cat((bc[:, :, None] * vc, (bc * cum.exp())[:, :, None] * kc), dim=-1)  # [H, C, Dv + Dk]
        sol = torch.linalg.solve_triangular(eye + a_mat, rhs, upper=False, unitriangular=True)
        u = sol[..., : vc.shape[-1]] - sol[..., vc.shape[-1] :] @ s  # [H, C, Dv]
        o = cum.exp()[:, :, None] * (qc @ s) + ((qc @ kc.transpose(1, 2)) * rel) @ u  # [H, C, Dv]
        decay_to_end = (cum[:, -1:] - cum).exp()  # [H, C]
        s = cum[:, -1].exp()[:, None, None] * s + (kc * decay_to_end[:, :, None]).transpose(1, 2) @ u
        outs.append(o.transpose(0, 1))
    return torch.cat(outs), s


@dataclass
class RecurrentState:
    conv: torch.Tensor  # [K-1, C] float32: the last K-1 inputs of the convolution
    ssm: torch.Tensor  # [H, Dk, Dv] float32


@dataclass
class _StepLog:
    """The states after each token of the last forward, kept on request (verify windows roll back into it)."""

    start: int  # position of the forward's first token
    tokens: int  # how many tokens it read
    conv: dict[int, torch.Tensor]  # layer -> [K-1+T, C]: rows j..j+K-2 are the conv state after j tokens
    ssm: dict[int, torch.Tensor]  # layer -> [T+1, H, Dk, Dv]: entry j is the state after j tokens


class RecurrentStateError(ValueError):
    """The recurrent state does not describe the positions a step needs (and cannot be rebuilt here)."""


class RecurrentCache(KVCache):
    """KV of the attention layers plus the recurrent state of the delta-net layers, for one sequence.

    The recurrent state cannot be indexed by position: it describes the first `state_pos` positions, whose token
    ids the cache keeps (`history`). `length` is what the KV cache holds, as for any model:
    - `truncate(n)` keeps positions < n. The state goes back exactly where it can - a checkpoint at n, or a position
      inside the last forward when `step_states` asked for per-token states (verify windows of drafted tokens) -
      else to the latest checkpoint below n (or to the empty state); the model's next forward then first reads
      the kept tokens from `state_pos` to n again, so callers see an exact truncation either way.
    - `checkpoint()` keeps the states at `state_pos`; the model takes one after every forward of more than one
      token (prompt chunks), the `max_checkpoints` latest are kept (each: every state layer's state once).
    - `snapshot()` / `restore(saved, tokens)` copy the states out and back: a prompt-cache entry of positions
      0..len(tokens)-1 must carry them along with its KV.
    - `length` set from outside (a prompt-cache restore that does not know this class) invalidates the state: the
      next forward refuses with `RecurrentStateError` rather than compute from a state of another sequence.
    - A split builds one cache from its stages' caches with `merge(other)` (each state stays on its device).
    States are updated in place, so CUDA graphs that captured their addresses stay valid.
    """

    def __init__(
        self,
        attn_layers: range | list[int],
        state_layers: dict[int, tuple[tuple[int, int], tuple[int, int, int]]],
        max_ctx: int,
        n_head_kv: int,
        head_dim_k: int,
        head_dim_v: int,
        kv_type: str,
        device: torch.device,
        max_checkpoints: int = 4,
        host_layers: Collection[int] = (),
    ) -> None:
        self._length = self.state_pos = 0
        super().__init__(
            attn_layers, max_ctx, n_head_kv, head_dim_k, head_dim_v, kv_type, device, host_layers
        )
        self.states = {
            i: RecurrentState(
                torch.zeros(conv, dtype=torch.float32, device=device),
                torch.zeros(ssm, dtype=torch.float32, device=device),
            )
            for i, (conv, ssm) in state_layers.items()
        }
        self.state_pos = 0  # positions the states have absorbed; -1: invalid
        self.history: list[int] = []  # token ids of positions 0..length-1
        self.max_checkpoints = max_checkpoints
        self.checkpoints: dict[int, dict[int, RecurrentState]] = {}
        self.step_states = 0
        self.log: _StepLog | None = None

    @property
    def length(self) -> int:  # type: ignore[override]
        return self._length

    @length.setter
    def length(self, value: int) -> None:
        if value != self._length or value != self.state_pos:
            self.state_pos = -1  # set from outside: whatever the KV now holds, the state does not follow it
        self._length = value

    @property
    def nbytes(self) -> int:
        extra = sum(s.conv.numel() * 4 + s.ssm.numel() * 4 for s in self.states.values())
        return super().nbytes + extra

    def merge(self, other: KVCache) -> None:
        """Take over another stage's layers (the in-process split builds one cache object from all stages)."""
        self.layers.update(other.layers)
        if isinstance(other, RecurrentCache):
            self.states.update(other.states)

    def state(self, layer: int) -> RecurrentState:
        st = self.states.get(layer)
        if st is None:
            raise KeyError(
                f"the cache holds no recurrent state for layer {layer}: make it with the model's new_cache "
                "(a split must merge the stages' caches with RecurrentCache.merge)"
            )
        return st

    # ---- bookkeeping the model does around a forward ----

    def replay_from(self, start: int) -> list[int]:
        """Before a forward at `start`: the token ids the states must read first (positions state_pos..start-1)."""
        if start < self._length:
            self.truncate(start)
        if start > self._length:
            raise RecurrentStateError(
                f"the cache holds positions 0-{self._length - 1} but the step starts at {start}: read from "
                f"{self._length}"
            )
        if self.state_pos < 0:
            raise RecurrentStateError(
                "the recurrent state does not match the cached keys and values (the cache length was set from "
                "outside, e.g. by a prompt-cache restore without RecurrentCache.restore): start the sequence again "
                "from position 0"
            )
        return self.history[self.state_pos : start]

    def advance(self, start: int, tokens: list[int]) -> None:
        """After a forward of `tokens` at `start`: states and KV hold start + len(tokens) positions."""
        del self.history[start:]
        self.history.extend(tokens)
        self._length = self.state_pos = start + len(tokens)

    def forward(
        self,
        tokens: torch.Tensor,
        start: int,
        step: Callable[[torch.Tensor, int, bool], torch.Tensor],
        last_only: bool,
        chunk: int,
    ) -> torch.Tensor:
        """A forward of `tokens` [T] at `start` with the bookkeeping the states need, for a model or a split of one:
        the positions the states lost to a truncation are read again first (replay_from; pieces of `chunk` tokens,
        their logits unread), then `step(tokens, start, last_only) -> logits` runs, the cache advances, and a
        forward of more than one token leaves a checkpoint."""
        replay = self.replay_from(start)
        at = self.state_pos
        for a in range(0, len(replay), chunk):
            part = replay[a : a + chunk]
            step(torch.tensor(part, dtype=torch.long), at + a, True)
            self.advance(at + a, part)
        logits = step(tokens, start, last_only)
        self.advance(start, [int(x) for x in tokens.tolist()])
        if tokens.shape[0] > 1:
            self.checkpoint()
        return logits

    # ---- snapshots, checkpoints, truncation ----

    def snapshot(self) -> dict[int, RecurrentState]:
        """A copy of every state (they describe positions 0..state_pos-1)."""
        return {i: RecurrentState(s.conv.clone(), s.ssm.clone()) for i, s in self.states.items()}

    def restore(self, saved: dict[int, RecurrentState], tokens: list[int]) -> None:
        """States saved at len(tokens) positions of the sequence `tokens`; the KV of those positions must be (or
        be put) in place by the caller."""
        self.restore_states(saved)
        self.history = list(tokens)
        self._length = self.state_pos = len(tokens)
        self.log = None
        self.checkpoints.clear()

    def restore_states(self, saved: dict[int, RecurrentState]) -> None:
        """Copy saved states back in place (nothing else changes)."""
        for i, s in self.states.items():
            s.conv.copy_(saved[i].conv)
            s.ssm.copy_(saved[i].ssm)

    def checkpoint(self) -> None:
        """Keep the states at `state_pos` (the latest `max_checkpoints` are kept)."""
        if self.max_checkpoints <= 0 or self.state_pos <= 0:
            return
        self.checkpoints[self.state_pos] = self.snapshot()
        while len(self.checkpoints) > self.max_checkpoints:
            del self.checkpoints[min(self.checkpoints)]

    def truncate(self, length: int) -> None:
        """Forget positions >= length (the state goes back as the class docstring says)."""
        if length >= self._length:
            return
        del self.history[length:]
        for p in [p for p in self.checkpoints if p > length]:
            del self.checkpoints[p]
        log, self.log = self.log, None
        self._length = length
        if self.state_pos < 0:
            return
        if self.state_pos <= length:
            return
        if log is not None and log.start <= length <= log.start + log.tokens:
            j = length - log.start  # tokens of the logged forward to keep
            for i, st in self.states.items():
                st.conv.copy_(log.conv[i][j : j + st.conv.shape[0]])
                st.ssm.copy_(log.ssm[i][j])
            self.state_pos = length
            return
        below = [p for p in self.checkpoints if p <= length]
        if below:
            self.state_pos = max(below)
            self.restore_states(self.checkpoints[self.state_pos])
        else:
            for st in self.states.values():
                st.conv.zero_()
                st.ssm.zero_()
            self.state_pos = 0
