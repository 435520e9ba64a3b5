"""Per-token, per-layer residual-stream norms ||h_t^l|| (METHODS.md §1)."""

from __future__ import annotations

import torch


def residual_norms(hidden_states, valid: torch.Tensor) -> torch.Tensor:
    """L+1 tensors (B, T, d) -> (N_valid, L+1) float64 norms, rows in (batch, position) order."""
    norms = torch.stack([torch.linalg.vector_norm(h, dim=-1, dtype=torch.float64) for h in hidden_states], dim=-1)  # (B, T, L+1)
    return norms[valid.bool()]
