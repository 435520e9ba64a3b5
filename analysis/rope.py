"""Rotary position embeddings, as Hugging Face applies them (rotate_half convention).

R_n y = y cos(n) + rotate_half(y) sin(n) on the first ``rot`` dims (partial rotary
leaves the rest unchanged). R_n is orthogonal, so R_n^T y = y cos(n) - rotate_half(y) sin(n).
"""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _apply(y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float) -> torch.Tensor:
    """y: (B, H, T, d_h); cos, sin: (B, T, rot) as the model's rotary embedding returns them."""
    rot = cos.shape[-1]
    c, s = cos[:, None].to(y.dtype), sin[:, None].to(y.dtype)
    head, tail = y[..., :rot], y[..., rot:]
    out = head * c + sign * rotate_half(head) * s
    return torch.cat([out, tail], dim=-1) if tail.shape[-1] else out


def rotate(y, cos, sin):
    """R_n y for each position n."""
    return _apply(y, cos, sin, 1.0)


def unrotate(y, cos, sin):
    """R_n^T y for each position n."""
    return _apply(y, cos, sin, -1.0)
