"""Per-token, per-layer residual-stream norms ||h_t^l|| (METHODS.md §1)."""

from __future__ import annotations

import torch


def add_norms(out: torch.Tensor | None, layer: int, h: torch.Tensor, n_hidden: int) -> torch.Tensor:
    """Write hidden state ``layer``'s (B, T, d) norms into ``out`` (B, T, n_hidden) float64, allocated on
    h's device at the first call (``out`` None); returns ``out``. With device_map the layers may live on
    several devices: each layer's norms move to ``out``'s."""
    if out is None:
        out = torch.empty(*h.shape[:-1], n_hidden, dtype=torch.float64, device=h.device)
    out[..., layer] = torch.linalg.vector_norm(h, dim=-1, dtype=torch.float64).to(out.device)
    return out
