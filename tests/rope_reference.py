"""Rotary position embeddings in their textbook form, the reference the tests check actlake's three-operation
form (:mod:`actlake.analysis.engine.rope`) and the contributions against: R_n y = y cos(n) + rot(y) sin(n) on
the first ``rot`` dims, rot Hugging Face's ``rotate_half`` (Llama, GPT-NeoX) or ``rotate_every_two`` (GPT-J,
Cohere: ``interleaved``); R_n^T y = y cos(n) - rot(y) sin(n) (both dims of a pair turn by one angle)."""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate_every_two(x: torch.Tensor) -> torch.Tensor:
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


def rotate(y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False,
           sign: float = 1.0) -> torch.Tensor:
    """R_n y (``sign`` -1: R_n^T y) for y (B, H, T, d_h) and the model's cos, sin (B, T, rot)."""
    rot = cos.shape[-1]
    c, s = cos[:, None].to(y.dtype), sin[:, None].to(y.dtype)
    head = y[..., :rot]
    turned = (rotate_every_two if interleaved else rotate_half)(head)
    return torch.cat([head * c + sign * turned * s, y[..., rot:]], dim=-1)


def unrotate(y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """R_n^T y for each position n."""
    return rotate(y, cos, sin, interleaved, sign=-1.0)
