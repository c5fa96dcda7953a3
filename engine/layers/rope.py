"""Rotary position embeddings: NEOX (rotate halves) and NORM (adjacent pairs) layouts, linear and YaRN scaling,
per-dimension frequency factors (`rope_freqs.weight`, Llama 3 style)."""

import math

import torch

from engine import kernels
from engine.gguf.model_config import RopeConfig
from engine.kernels import cpu_blocks
from engine.layers.norm import rms_norm


def _yarn_corr_dim(n_dims: int, n_ctx_orig: int, n_rot: float, base: float) -> float:
    return n_dims * math.log(n_ctx_orig / (n_rot * 2 * math.pi)) / (2 * math.log(base))


class Rope:
    def __init__(
        self, cfg: RopeConfig, freq_factors: torch.Tensor | None = None, base: float | None = None
    ) -> None:
        self.cfg = cfg
        self.base = base if base is not None else cfg.base
        dim = cfg.dim
        inv = self.base ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)  # [dim/2]
        if freq_factors is not None:
            inv = inv / freq_factors.double()[: dim // 2]
        self.mscale = 1.0
        self.ramp_mix: torch.Tensor | None = None
        if cfg.scaling == "linear":
            inv = inv / cfg.factor
        elif cfg.scaling == "yarn":
            # llama.cpp's rope_yarn: interpolate low frequencies, extrapolate high ones, ramp in between.
            freq_scale = 1.0 / cfg.factor
            ext = cfg.yarn_ext_factor if cfg.yarn_ext_factor >= 0 else 1.0
            orig = cfg.orig_ctx or 4096
            low = max(0.0, math.floor(_yarn_corr_dim(dim, orig, cfg.yarn_beta_fast, self.base)))
            high = min(dim - 1.0, math.ceil(_yarn_corr_dim(dim, orig, cfg.yarn_beta_slow, self.base)))
            i0 = torch.arange(0, dim, 2, dtype=torch.float64) / 2
            y = (i0 - low) / max(0.001, high - low)
            self.ramp_mix = (1 - y.clamp(0, 1)) * ext
            self.interp_scale = freq_scale
            if ext != 0:
                self.mscale = cfg.yarn_attn_factor * (1.0 + 0.1 * math.log(1.0 / freq_scale))
            else:
                self.mscale = cfg.yarn_attn_factor
        self.inv_freq = inv
        self._cache: dict[torch.device, torch.Tensor] = {}
        # theta = pos * inv_eff: YaRN's mix of interpolated and extrapolated angles is linear in the position.
        eff = (
            inv if self.ramp_mix is None else inv * (self.interp_scale * (1 - self.ramp_mix) + self.ramp_mix)
        )
        self.inv_freq_effective = eff.float()
        self._eff_cache: dict[torch.device, torch.Tensor] = {}
        # the last CPU step's angles: every layer of a step (queries and keys) rotates at the same positions
        self._last: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def _inv(self, device: torch.device) -> torch.Tensor:
        if device not in self._cache:
            self._cache[device] = self.inv_freq.to(device)
        return self._cache[device]

    def inv_effective(self, device: torch.device) -> torch.Tensor:
        """[dim/2] float32 inverse frequencies (YaRN's mix folded in) on `device`, for the fused kernels."""
        if device not in self._eff_cache:
            self._eff_cache[device] = self.inv_freq_effective.to(device)
        return self._eff_cache[device]

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, dim/2] in float32. On the CPU the last answer is kept for the same
        positions: a decode step of Gemma 3 270M computed them 36 times, its queries' and keys' in each layer."""
        last = self._last
        if last is not None and not positions.is_cuda and torch.equal(last[0], positions):
            return last[1], last[2]
        theta = positions.double()[:, None] * self._inv(positions.device)[None, :]  # [T, dim/2]
        if self.ramp_mix is not None:
            mix = self.ramp_mix.to(positions.device)
            theta = theta * self.interp_scale * (1 - mix) + theta * mix
        cos, sin = (theta.cos() * self.mscale).float(), (theta.sin() * self.mscale).float()
        if not positions.is_cuda:  # a CUDA graph's positions change in place inside captured work: never kept
            self._last = (positions.clone(), cos, sin)
        return cos, sin

    def apply_at(
        self, x: torch.Tensor, pos: torch.Tensor, norm_weight: torch.Tensor | None = None, eps: float = 1e-6
    ) -> torch.Tensor:
        """x [T, H, D] at positions pos [T]: optional per-head RMS norm, then the rotation. One fused kernel on
        CUDA; the same math in torch elsewhere."""
        if x.is_cuda:
            fused = kernels.loaded("fused")
            if fused is not None:
                inv = self.inv_effective(x.device)
                return fused.norm_rope(
                    x, norm_weight, eps, pos, inv, self.cfg.dim, self.cfg.neox, self.mscale
                )
        if norm_weight is not None:
            x = rms_norm(x, norm_weight, eps)
        cos, sin = self.cos_sin(pos)
        return self.apply(x, cos, sin)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, H, D]; rotates the first `dim` features of each head (on the CPU in one kernel call where the
        block kernels run: the same bits as the torch form below)."""
        if (
            not x.is_cuda
            and x.dtype == torch.float32
            and x.dim() == 3
            and x.is_contiguous()
            and cos.dtype == sin.dtype == torch.float32
            and cos.is_contiguous()
            and sin.is_contiguous()
            and cpu_blocks.available()[0]
        ):
            return cpu_blocks.rotate(x, cos, sin, self.cfg.dim, self.cfg.neox)
        return self.apply_torch(x, cos, sin)

    def apply_torch(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """apply's torch form (any device and dtype)."""
        dim = self.cfg.dim
        xr = x[..., :dim].float()
        c, s = cos[:, None, :], sin[:, None, :]  # [T, 1, dim/2]
        if self.cfg.neox:
            x1, x2 = xr[..., : dim // 2], xr[..., dim // 2 :]
            out = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
        else:
            x1, x2 = xr[..., 0::2], xr[..., 1::2]
            out = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
        out = out.to(x.dtype)
        if dim == x.shape[-1]:
            return out
        return torch.cat((out, x[..., dim:]), dim=-1)
