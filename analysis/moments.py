"""Mergeable per-group moments: count, mean, M2 (Chan et al.'s pairwise merge), max |x|.

All arrays are float64 numpy. ``merge`` is associative and commutative up to
floating-point rounding, so shards can be reduced in any order and grouping.
"""

from __future__ import annotations

from dataclasses import dataclass

import warnings

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
    def from_groups(cls, x: torch.Tensor, ids: torch.Tensor, n_groups: int, work: "GroupSums | None" = None) -> "Moments":
        """x: (N, d) values; ids: (N, S) the group of each value in each of S partitions of the groups
        (a value may belong to one group per partition; ``n_groups`` means none). Moments of shape (G, d).
        ``work``: a :class:`GroupSums` for these ids, reused across calls (several layers of one batch)."""
        work = work or GroupSums(ids, n_groups, x.shape[1])
        count, sums, sq = work.sums(x)
        mean = sums / count.clamp(min=1).unsqueeze(-1)
        # sum_g (x - mean_g)^2 over members, from the sum of squares (float64: outlier dimensions have
        # means far larger than their spread, so float32 would cancel away their variance)
        m2 = (sq - 2 * mean * sums + count.unsqueeze(-1) * mean * mean).clamp(min=0)
        absx = x.abs()  # max in the input precision: exact
        max_abs = absx.new_zeros(n_groups + 1, x.shape[1])
        with warnings.catch_warnings():  # "index_reduce() is in beta": the fastest grouped max here
            warnings.simplefilter("ignore", UserWarning)
            for s in range(ids.shape[1]):
                max_abs.index_reduce_(0, ids[:, s], absx, "amax")
        return cls(count.numpy(), mean.numpy(), m2.numpy(), max_abs[:n_groups].double().numpy())

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


class GroupSums:
    """Per-group count, sum and sum of squares in float64 for one set of group ids: one GEMM of the
    (G, N) membership matrix with [x | x * x] (N, 2d), in a float64 buffer reused across calls."""

    def __init__(self, ids: torch.Tensor, n_groups: int, d: int):
        member = torch.nn.functional.one_hot(ids, n_groups + 1)[..., :n_groups].sum(1)  # (N, G)
        self.member_t = member.T.to(torch.float64).contiguous()  # (G, N)
        self.count = self.member_t.sum(1)  # (G,)
        self.buf = torch.empty(ids.shape[0], 2 * d, dtype=torch.float64, device=ids.device)
        self.d = d

    def sums(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(count (G,), sum (G, d), sum of squares (G, d)) of x (N, d)."""
        d, buf = self.d, self.buf
        buf[:, :d] = x
        torch.mul(buf[:, :d], buf[:, :d], out=buf[:, d:])
        both = self.member_t @ buf  # (G, 2d)
        return self.count, both[:, :d], both[:, d:]
