"""Rotary position embeddings, as Hugging Face applies them (rotate_half convention).

R_n y = y cos(n) + rotate_half(y) sin(n) on the first ``rot`` dims (partial rotary
leaves the rest unchanged). R_n is orthogonal, so R_n^T y = y cos(n) - rotate_half(y) sin(n).
With rotate_half(y1, y2) = (-y2, y1) = swap(y) * (-1, 1), both are y cos + swap(y) s for a signed
sin s, which :func:`factors` builds once per batch; :func:`apply` is then three operations.
"""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def factors(cos: torch.Tensor, sin: torch.Tensor, sign: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, signed sin), each (B, 1, T, rot), from the model's (B, T, rot): R_n (``sign`` 1) or R_n^T (-1)."""
    half = cos.shape[-1] // 2
    signed = torch.cat([-sign * sin[..., :half], sign * sin[..., half:]], dim=-1)
    return cos[:, None], signed[:, None]


def apply(y: torch.Tensor, f: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """R y (or R^T y) for y (B, H, T, ..., d_h): :func:`factors` broadcast over heads and any axes
    between T and d_h (several stacked vectors per token)."""
    c, s = f
    for _ in range(y.dim() - 4):
        c, s = c.unsqueeze(-2), s.unsqueeze(-2)
    c, s = c.to(y.dtype), s.to(y.dtype)
    rot = c.shape[-1]
    head = y[..., :rot]
    swapped = head.unflatten(-1, (2, rot // 2)).flip(-2).flatten(-2)  # (y2, y1)
    out = torch.addcmul(head * c, swapped, s)
    return torch.cat([out, y[..., rot:]], dim=-1) if y.shape[-1] > rot else out


def rotate(y, cos, sin):
    """R_n y for each position n."""
    return apply(y, factors(cos, sin, 1.0))


def unrotate(y, cos, sin):
    """R_n^T y for each position n."""
    return apply(y, factors(cos, sin, -1.0))
