"""Everything the attention analyses need about one layer of one batch, in one place.

:class:`BatchInfo` holds what is the same for every layer of a batch (masks,
categories, pair counts) and computes each once; :class:`LayerQK` adds one
layer's tensors and caches its explicit attention weights for all analyses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch

from actlake.analysis.attention_mass import allowed_pairs, expand_kv


@dataclass(eq=False)
class BatchInfo:
    valid: torch.Tensor
    """(B, T) 1 for real tokens, 0 for padding."""
    causal: bool
    key_onehot: torch.Tensor
    """(B, T, C) key categories (zero on padding), float64."""
    query_onehot: torch.Tensor
    """(B, T, C) query categories (zero on padding), float64."""

    @cached_property
    def pair_mask(self) -> torch.Tensor:
        """(B, 1, T, T) bool: query m may attend to key n."""
        return allowed_pairs(self.valid, self.causal)

    @cached_property
    def additive_mask(self) -> torch.Tensor:
        """(B, 1, T, T) float32: 0 where allowed, -inf elsewhere."""
        zero = torch.zeros((), dtype=torch.float32, device=self.valid.device)
        return torch.where(self.pair_mask, zero, torch.tensor(float("-inf"), device=self.valid.device))

    @cached_property
    def validf(self) -> torch.Tensor:
        return self.valid.to(torch.float32)

    def sum_over_queries(self, per_query: torch.Tensor) -> torch.Tensor:
        """For each key n, the sum of ``per_query`` (B, H, T, ...) over the queries m that may attend to n.

        Bidirectional: all valid queries. Causal: valid queries m >= n (a reverse cumulative sum).
        ``per_query`` must already be zero on padded queries.
        """
        if self.causal:
            return per_query.flip(2).cumsum(2).flip(2)
        return per_query.sum(2, keepdim=True).expand_as(per_query)

    @cached_property
    def queries_per_key(self) -> torch.Tensor:
        """(B, T) float64: valid queries that may attend to each key (0 on padded keys)."""
        v = self.valid.to(torch.float64)
        return self.sum_over_queries(v[:, None, :])[:, 0] * v

    @cached_property
    def key_category_index(self) -> list[torch.Tensor]:
        """Per key category, the flat (b * T + n) indices of its valid tokens."""
        cat = self.key_onehot.argmax(-1).reshape(-1)
        keep = self.key_onehot.sum(-1).reshape(-1) > 0
        return [torch.nonzero(keep & (cat == c)).flatten() for c in range(self.key_onehot.shape[-1])]

    def pairs_by_distance(self, max_len: int) -> torch.Tensor:
        """(2 * max_len - 1,) float64: valid pairs at each m - n (index m - n + max_len - 1)."""
        cache = self.__dict__.setdefault("_pairs_by_distance", {})
        if max_len not in cache:
            counts = (self.pair_mask[:, 0] & self.valid.bool()[:, :, None]).to(torch.float64).sum(0)  # (T, T)
            cache[max_len] = diagonal_sums(counts[None], max_len)[0]
        return cache[max_len]

    def select(self, rows: slice) -> "BatchInfo":
        return BatchInfo(self.valid[rows], self.causal, self.key_onehot[rows], self.query_onehot[rows])


def diagonal_sums(a: torch.Tensor, max_len: int) -> torch.Tensor:
    """(H, T, T) -> (H, 2 * max_len - 1): sums of a[:, m, n] over m - n = i - (max_len - 1)."""
    H, T, _ = a.shape
    m = torch.arange(T, device=a.device)
    index = (m[:, None] - m[None, :] + max_len - 1).reshape(-1)
    out = torch.zeros(H, 2 * max_len - 1, dtype=a.dtype, device=a.device)
    return out.index_add_(1, index, a.reshape(H, -1))


@dataclass(eq=False)
class LayerQK:
    layer: int
    query: torch.Tensor
    """(B, H, T, d_h) q as the model uses it (after RoPE), float32."""
    key: torch.Tensor
    """(B, H_kv, T, d_h) k as the model uses it (after RoPE), float32."""
    scaling: float
    batch: BatchInfo
    x: torch.Tensor | None = None
    """(B, T, d) the input of the key projection (METHODS.md x), float32."""
    w_key: torch.Tensor | None = None
    """(H_kv, d, d_h) key projection per key head."""
    b_key: torch.Tensor | None = None
    """(H_kv, d_h) key bias, or None."""
    cos: torch.Tensor | None = None
    """(B, T, rot) rotary cos (None without RoPE)."""
    sin: torch.Tensor | None = None
    _cache: dict = field(default_factory=dict, repr=False)

    # shortcuts to the batch
    valid = property(lambda self: self.batch.valid)
    causal = property(lambda self: self.batch.causal)
    key_onehot = property(lambda self: self.batch.key_onehot)
    query_onehot = property(lambda self: self.batch.query_onehot)

    @property
    def n_heads(self) -> int:
        return self.query.shape[1]

    @property
    def key_per_query_head(self) -> torch.Tensor:
        """(B, H, T, d_h): key head h // (H / H_kv) for each query head h."""
        if "k" not in self._cache:
            self._cache["k"] = expand_kv(self.key, self.n_heads)
        return self._cache["k"]

    def sum_over_queries(self, per_query: torch.Tensor) -> torch.Tensor:
        return self.batch.sum_over_queries(per_query)

    def queries_per_key(self) -> torch.Tensor:
        return self.batch.queries_per_key

    def pair_mask(self) -> torch.Tensor:
        return self.batch.pair_mask

    def per_query_mass(self, key_scale: torch.Tensor | None = None) -> torch.Tensor:
        """(B, H, T, C) attention each query gives each key category (one fused kernel call with
        V = one-hot categories); ``key_scale`` (B, H, T) rescales each key first."""
        from actlake.analysis.attention_mass import per_query_category_mass

        if key_scale is None and "per_query_mass" in self._cache:
            return self._cache["per_query_mass"]
        k = self.key_per_query_head if key_scale is None else self.key_per_query_head * key_scale[..., None]
        out = per_query_category_mass(self.query, k, self.scaling, self.batch.pair_mask, self.key_onehot)
        if key_scale is None:
            self._cache["per_query_mass"] = out
        return out

    def attention_chunks(self, key_scale: torch.Tensor | None = None, max_elements: int = 1 << 24):
        """Explicit attention weights by query block: yields (m0, m1, alpha (B, H, m1 - m0, T)), zero on
        padded queries. ``key_scale`` (B, H, T) multiplies each key (so each logit) first. When one block
        holds the whole layer, the logits and the plain weights are kept for the next caller."""
        B, H, T, _ = self.query.shape
        step = max(1, max_elements // max(1, B * H * T))
        if step < T:
            return self._chunks(key_scale, step)
        if key_scale is not None:
            scores = self._scores() * key_scale[:, :, None, :]
            return iter([(0, T, self._softmax(scores, 0, T))])
        if "alpha" not in self._cache:
            self._cache["alpha"] = self._softmax(self._scores().clone(), 0, T)
        return iter([(0, T, self._cache["alpha"])])

    def _scores(self) -> torch.Tensor:
        """(B, H, T, T) scaled scores, unmasked (kept: the key-normalised weights reuse them)."""
        if "scores" not in self._cache:
            self._cache["scores"] = torch.matmul(self.query, self.key_per_query_head.transpose(-1, -2)).mul_(self.scaling)
        return self._cache["scores"]

    def _softmax(self, logits, m0, m1):
        """Masked softmax of a fresh ``logits`` tensor, in place; rows of padded queries zeroed."""
        logits.add_(self.batch.additive_mask[:, :, m0:m1])
        alpha = torch.softmax(logits, dim=-1)
        return alpha.mul_(self.batch.validf[:, None, m0:m1, None])

    def _chunks(self, key_scale, step):
        k = self.key_per_query_head
        if key_scale is not None:
            k = k * key_scale[..., None]
        T = self.query.shape[2]
        for m0 in range(0, T, step):
            m1 = min(T, m0 + step)
            logits = torch.matmul(self.query[:, :, m0:m1], k.transpose(-1, -2)).mul_(self.scaling)
            yield m0, m1, self._softmax(logits, m0, m1)

    def select(self, rows: slice) -> "LayerQK":
        """The same layer for a subset of the batch's sequences."""
        cut = lambda t: None if t is None else t[rows]
        return LayerQK(self.layer, self.query[rows], self.key[rows], self.scaling, self.batch.select(rows),
                       cut(self.x), self.w_key, self.b_key, cut(self.cos), cut(self.sin))

