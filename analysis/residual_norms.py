"""Per-token, per-layer residual-stream norms ||h_t^l|| (METHODS.md §1)."""

from __future__ import annotations

import torch


def residual_norms(hidden_states) -> torch.Tensor:
    """L+1 tensors (B, T, d) -> (B, T, L+1) float64 norms, on the hidden states' device (padding included:
    the caller keeps the valid tokens once the norms are on the host)."""
    dev = hidden_states[0].device  # with device_map the layers may live on several devices
    return torch.stack([torch.linalg.vector_norm(h, dim=-1, dtype=torch.float64).to(dev) for h in hidden_states], dim=-1)
