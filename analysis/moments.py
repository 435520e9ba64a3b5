"""Mergeable per-group moments: count, mean, M2 (Chan et al.'s pairwise merge), max |x|.

All arrays are float64 numpy. ``merge`` is associative and commutative up to
floating-point rounding, so shards can be reduced in any order and grouping.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class Moments:
    count: np.ndarray
    """(..., G) number of values per group."""
    mean: np.ndarray
    """(..., G, d) mean per group and dimension."""
    m2: np.ndarray
    """(..., G, d) sum of squared deviations from the mean."""
    max_abs: np.ndarray
    """(..., G, d) largest |value| seen."""

    @classmethod
    def zeros(cls, shape: tuple[int, ...], d: int) -> "Moments":
        return cls(np.zeros(shape), np.zeros(shape + (d,)), np.zeros(shape + (d,)), np.zeros(shape + (d,)))

    @classmethod
    def from_groups(cls, x: torch.Tensor, groups: torch.Tensor) -> "Moments":
        """x: (N, d) values; groups: (N, G) 0/1 membership. Returns moments of shape (G, d)."""
        x = x.to(torch.float64)
        g = groups.to(torch.float64)
        count = g.sum(0)  # (G,)
        sums = g.T @ x  # (G, d)
        mean = sums / count.clamp(min=1).unsqueeze(-1)
        # two-pass within the batch: sum_g (x - mean_g)^2 over members
        sq = g.T @ (x * x)
        m2 = (sq - 2 * mean * sums + count.unsqueeze(-1) * mean * mean).clamp(min=0)
        absx = x.abs()
        max_abs = torch.zeros_like(sums)
        for i in torch.nonzero(count).flatten().tolist():
            max_abs[i] = absx[g[:, i] > 0].amax(0)
        return cls(count.numpy(), mean.numpy(), m2.numpy(), max_abs.numpy())

    def merge(self, other: "Moments") -> "Moments":
        n_a, n_b = self.count[..., None], other.count[..., None]
        n = n_a + n_b
        safe = np.where(n > 0, n, 1)
        delta = other.mean - self.mean
        mean = np.where(n > 0, self.mean + delta * (n_b / safe), 0.0)
        m2 = self.m2 + other.m2 + delta * delta * (n_a * n_b / safe)
        return Moments(self.count + other.count, mean, m2, np.maximum(self.max_abs, other.max_abs))

    @property
    def variance(self) -> np.ndarray:
        """Population variance per group and dimension (NaN where count is 0)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return self.m2 / self.count[..., None]
