"""Which keys a query may attend to, and grouped-query heads expanded to one key head per query head."""

from __future__ import annotations

import torch


def allowed_pairs(valid: torch.Tensor, causal: bool, window: int | None = None) -> torch.Tensor:
    """(B, T) validity -> (B, 1, T, T) bool mask of pairs (m, n) a query may attend to; with a sliding ``window``
    W (transformers' convention) only 0 <= m - n < W (causal) or |m - n| < W (bidirectional)."""
    T = valid.shape[1]
    mask = valid.bool()[:, None, None, :].expand(-1, 1, T, T)
    if causal:
        mask = mask & torch.ones(T, T, dtype=torch.bool, device=valid.device).tril()
    if window is not None:
        m = torch.arange(T, device=valid.device)
        mask = mask & ((m[:, None] - m[None, :]).abs() < window)
    return mask


def expand_kv(key: torch.Tensor, n_heads: int) -> torch.Tensor:
    """(B, H_kv, T, d) -> (B, H, T, d): query head h reads key head h // (H / H_kv)."""
    rep = n_heads // key.shape[1]
    return key if rep == 1 else key.repeat_interleave(rep, dim=1)


def capped(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(logits / cap) (attention logit softcapping), or ``logits`` without a cap."""
    return logits if cap is None else torch.tanh(logits / cap) * cap
