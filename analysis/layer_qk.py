"""Everything the attention analyses need about one layer of one batch, in one place."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from actlake.analysis.attention_mass import allowed_pairs, expand_kv


@dataclass
class LayerQK:
    layer: int
    query: torch.Tensor
    """(B, H, T, d_h) q as the model uses it (after RoPE), float32."""
    key: torch.Tensor
    """(B, H_kv, T, d_h) k as the model uses it (after RoPE), float32."""
    scaling: float
    valid: torch.Tensor
    """(B, T) 1 for real tokens, 0 for padding."""
    causal: bool
    key_onehot: torch.Tensor
    """(B, T, C) key categories (zero on padding), float64."""
    query_onehot: torch.Tensor
    """(B, T, C) query categories (zero on padding), float64."""
    x: torch.Tensor | None = None
    """(B, T, d) the input of the key projection (METHODS.md x), float32."""
    w_key: torch.Tensor | None = None
    """(H_kv, d, d_h) key projection per key head."""
    b_key: torch.Tensor | None = None
    """(H_kv, d_h) key bias, or None."""
    cos: torch.Tensor | None = None
    """(B, T, rot) rotary cos (None without RoPE)."""
    sin: torch.Tensor | None = None

    @property
    def n_heads(self) -> int:
        return self.query.shape[1]

    @property
    def key_per_query_head(self) -> torch.Tensor:
        """(B, H, T, d_h): key head h // (H / H_kv) for each query head h."""
        return expand_kv(self.key, self.n_heads)

    def pair_mask(self) -> torch.Tensor:
        return allowed_pairs(self.valid, self.causal)

    def sum_over_queries(self, per_query: torch.Tensor) -> torch.Tensor:
        """For each key n, the sum of ``per_query`` (B, H, T, ...) over the queries m that may attend to n.

        Bidirectional: all valid queries. Causal: valid queries m >= n (a reverse cumulative sum).
        ``per_query`` must already be zero on padded queries.
        """
        if self.causal:
            return per_query.flip(2).cumsum(2).flip(2)
        return per_query.sum(2, keepdim=True).expand_as(per_query)

    def queries_per_key(self) -> torch.Tensor:
        """(B, T) number of valid queries that may attend to each key (0 on padded keys)."""
        v = self.valid.to(torch.float64)
        counts = self.sum_over_queries(v[:, None, :])[:, 0]
        return counts * v


def attention_chunks(lq: LayerQK, max_elements: int = 1 << 24, key_scale: torch.Tensor | None = None):
    """Explicit softmax weights, a block of queries at a time: yields (m0, m1, alpha (B, H, m1-m0, T)).

    Memory is bounded by ``max_elements`` floats; ``key_scale`` (B, H, T) multiplies each key first.
    """
    q = lq.query
    k = lq.key_per_query_head
    if key_scale is not None:
        k = k * key_scale[..., None]
    B, H, T, _ = q.shape
    mask = lq.pair_mask()
    step = max(1, max_elements // max(1, B * H * T))
    for m0 in range(0, T, step):
        m1 = min(T, m0 + step)
        logits = torch.matmul(q[:, :, m0:m1], k.transpose(-1, -2)) * lq.scaling
        logits = logits.masked_fill(~mask[:, :, m0:m1], float("-inf"))
        alpha = torch.softmax(logits, dim=-1).nan_to_num(0.0)
        yield m0, m1, alpha * lq.valid[:, None, m0:m1, None]
