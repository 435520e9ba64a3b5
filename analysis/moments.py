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
        max_abs = work.max_abs(x)
        return cls(count.numpy(), mean.numpy(), m2.numpy(), max_abs.double().numpy())

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
    """Per-group count, sum, sum of squares (float64) and max |x| for one set of group ids, reused
    across calls (the layers of one batch).

    Sums: the (G, N) membership matrix times [x | x * x] (N, 2d) in float64, ``rows`` tokens at a
    time so the float64 block stays in cache (twice as fast as one product over the batch).
    Maxima: one grouped max per partition of the ids, a plain max for a partition with one group.
    """

    def __init__(self, ids: torch.Tensor, n_groups: int, d: int, rows: int = 512):
        member = torch.nn.functional.one_hot(ids, n_groups + 1)[..., :n_groups].sum(1)  # (N, G)
        self.member_t = member.T.to(torch.float64).contiguous()  # (G, N)
        self.count = self.member_t.sum(1)  # (G,)
        self.buf = torch.empty(max(1, min(rows, ids.shape[0])), 2 * d, dtype=torch.float64, device=ids.device)
        self.ids, self.n_groups, self.d = ids, n_groups, d
        self.single = []  # per partition: (its one group, the rows in it or None for all) or None
        for s in range(ids.shape[1]):
            groups = torch.unique(ids[:, s])
            groups = groups[groups != n_groups]
            if len(groups) != 1:
                self.single.append(None)
                continue
            inside = ids[:, s] == groups[0]
            self.single.append((int(groups[0]), None if bool(inside.all()) else torch.nonzero(inside).flatten()))

    def sums(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(count (G,), sum (G, d), sum of squares (G, d)) of x (N, d)."""
        d, rows = self.d, self.buf.shape[0]
        both = self.buf.new_zeros(self.n_groups, 2 * d)  # (G, 2d)
        for r0 in range(0, x.shape[0], rows):
            block = self.buf[: min(rows, x.shape[0] - r0)]
            block[:, :d] = x[r0 : r0 + rows]
            torch.mul(block[:, :d], block[:, :d], out=block[:, d:])
            both.addmm_(self.member_t[:, r0 : r0 + rows], block)
        return self.count, both[:, :d], both[:, d:]

    def max_abs(self, x: torch.Tensor) -> torch.Tensor:
        """(G, d) largest |x| per group (0 for an empty group), in x's precision (exact)."""
        absx = x.abs()
        out = absx.new_zeros(self.n_groups + 1, x.shape[1])
        for s, single in enumerate(self.single):
            if single is None:
                with warnings.catch_warnings():  # "index_reduce() is in beta": the fastest grouped max here
                    warnings.simplefilter("ignore", UserWarning)
                    out.index_reduce_(0, self.ids[:, s], absx, "amax")
            else:
                group, rows = single
                torch.maximum(out[group], (absx if rows is None else absx[rows]).amax(0), out=out[group])
        return out[: self.n_groups]
