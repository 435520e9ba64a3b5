"""Mergeable per-group moments: count, mean, M2 (Chan et al.'s pairwise merge), max |x|.

All fields are float64 tensors on one device (the model's while a shard runs, the host after).
``merge`` is associative and commutative up to floating-point rounding, so shards can be reduced
in any order and grouping.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from actlake.analysis.engine.device import to_device


@dataclass
class Moments:
    count: torch.Tensor
    """(..., G) number of values per group."""
    mean: torch.Tensor
    """(..., G, d) mean per group and dimension."""
    m2: torch.Tensor
    """(..., G, d) sum of squared deviations from the mean."""
    max_abs: torch.Tensor
    """(..., G, d) largest |value| seen."""

    @classmethod
    def from_sums(cls, count: torch.Tensor, sums: torch.Tensor, sq: torch.Tensor, max_abs: torch.Tensor) -> "Moments":
        """Moments from per-group counts (..., G), float64 sums and sums of squares (..., G, d) and maxima
        (any leading axes: the layers of a batch at once)."""
        mean = sums / count.clamp(min=1).unsqueeze(-1)
        # sum_g (x - mean_g)^2 over members, from the sum of squares (float64: outlier dimensions have
        # means far larger than their spread, so float32 would cancel away their variance)
        m2 = (sq - mean * sums).clamp_(min=0)  # sum x^2 - 2 mean sum x + n mean^2, with n mean = sum x
        return cls(count, mean, m2, max_abs.double())

    def merge(self, other: "Moments") -> "Moments":
        other = other.to(self.count.device)
        n_a, n_b = self.count[..., None], other.count[..., None]
        n = n_a + n_b
        safe = n.clamp(min=1)
        delta = other.mean - self.mean
        mean = torch.where(n > 0, self.mean + delta * (n_b / safe), 0.0)
        m2 = self.m2 + other.m2 + delta * delta * (n_a * n_b / safe)
        return Moments(self.count + other.count, mean, m2, torch.maximum(self.max_abs, other.max_abs))

    def to(self, device) -> "Moments":
        return Moments(*(getattr(self, f).to(device) for f in ("count", "mean", "m2", "max_abs")))

    @property
    def variance(self) -> torch.Tensor:
        """Population variance per group and dimension (NaN where count is 0)."""
        return self.m2 / self.count[..., None]


class GroupSums:
    """Per-group count, sum, sum of squares (float64) and max |x| for one set of group ids, reused
    across calls (the layers of one batch).

    ``ids`` may live on the host while the values live on ``device``: everything that depends on the
    ids' values is decided on the host, so nothing here waits for the device. Sums: the (G, N)
    membership matrix times [x | x * x] (N, 2d) in float64, ``rows`` tokens at a time (on a CPU 512,
    so the float64 block stays in cache: twice as fast as one product over the batch; on a GPU one
    product). Maxima: on a CPU one grouped max (``index_reduce_``) per partition of the ids, a plain
    max for a partition with one group. With ``segmented`` (default on a GPU, where grouped atomics over
    every row contend and ``segment_reduce`` is slow): every group's rows, in every partition, cut into
    chunks of ``chunk`` rows (the last one padded with a repeat of its own rows); one gather, one max
    per chunk, then a grouped max over the few chunk maxima. Four operations per call whatever the
    number of groups.
    """

    def __init__(self, ids: torch.Tensor, n_groups: int, d: int, rows: int | None = None, device=None,
                 segmented: bool | None = None, chunk: int = 256):
        device = torch.device(device) if device is not None else ids.device
        segmented = device.type != "cpu" if segmented is None else segmented
        rows = rows or (512 if device.type == "cpu" else 1 << 16)
        host_ids = ids.cpu()
        self.single = []  # per partition: (its one group, the rows in it or None for all) or None
        self.chunks = _chunks(host_ids, n_groups, chunk, device) if segmented else None
        for s in range(ids.shape[1] if self.chunks is None else 0):  # the chunks cover every partition
            groups = torch.unique(host_ids[:, s])
            groups = groups[groups != n_groups]
            if len(groups) != 1:
                self.single.append(None)
                continue
            inside = host_ids[:, s] == groups[0]
            rows_in = None if bool(inside.all()) else to_device(torch.nonzero(inside).flatten(), device)
            self.single.append((int(groups[0]), rows_in))
        member = torch.nn.functional.one_hot(host_ids, n_groups + 1)[..., :n_groups].sum(1)  # (N, G)
        self.member_t = to_device(member.T.to(torch.float64).contiguous(), device)  # (G, N)
        self.count = self.member_t.sum(1)  # (G,)
        self.ids = to_device(host_ids, device)
        self.rows = max(1, min(rows, ids.shape[0]))  # the float64 scratch is allocated per call, not held
        self.n_groups, self.d = n_groups, d

    def sums(self, x: torch.Tensor, out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(count (G,), sum (G, d), sum of squares (G, d)) of x (N, d). ``out``: a zeroed (G, 2d) float64
        buffer the sums go into (else a new one)."""
        d, rows = self.d, self.rows
        buf = torch.empty(rows, 2 * d, dtype=torch.float64, device=self.member_t.device)
        both = buf.new_zeros(self.n_groups, 2 * d) if out is None else out  # (G, 2d)
        for r0 in range(0, x.shape[0], rows):
            block = buf[: min(rows, x.shape[0] - r0)]
            block[:, :d] = x[r0 : r0 + rows]
            torch.mul(block[:, :d], block[:, :d], out=block[:, d:])
            both.addmm_(self.member_t[:, r0 : r0 + rows], block)
        return self.count, both[:, :d], both[:, d:]

    def max_abs(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """(G, d) largest |x| per group (0 for an empty group), in x's precision (exact). ``out``: a zeroed
        (G + 1, d) buffer of x's dtype the maxima go into (row G is scratch)."""
        absx = x.abs()
        out = absx.new_zeros(self.n_groups + 1, x.shape[1]) if out is None else out
        if self.chunks is not None:  # one max per chunk of a group's rows, then per group over its chunks
            rows, group = self.chunks
            _index_amax(out, group, absx[rows].amax(1))
            return out[: self.n_groups]
        for s, single in enumerate(self.single):
            if single is None:
                _index_amax(out, self.ids[:, s], absx)
            else:
                group, rows = single
                torch.maximum(out[group], (absx if rows is None else absx[rows]).amax(0), out=out[group])
        return out[: self.n_groups]


def _index_amax(out: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> None:
    """out[index[i]] = max(out[index[i]], values[i]) for every row i."""
    with warnings.catch_warnings():  # "index_reduce() is in beta": the fastest grouped max here
        warnings.simplefilter("ignore", UserWarning)
        out.index_reduce_(0, index, values, "amax")


def _chunks(host_ids: torch.Tensor, n_groups: int, chunk: int, device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(rows (K, chunk) long, group (K,) long) on ``device``: every non-empty group of every partition,
    its rows cut into chunks of ``chunk`` (the last padded by repeating the group's first rows). None
    when no row belongs to a group."""
    rows, group = [], []
    for s in range(host_ids.shape[1]):
        ids = host_ids[:, s]
        order = torch.argsort(ids, stable=True)
        ends = torch.bincount(ids, minlength=n_groups + 1)[:n_groups].cumsum(0).tolist()
        for g, (a, b) in enumerate(zip([0] + ends[:-1], ends)):
            if b == a:
                continue
            members = order[a:b]
            n = -(-(b - a) // chunk) * chunk
            rows.append(members.repeat(-(-n // (b - a)))[:n].view(-1, chunk))
            group.append(torch.full((n // chunk,), g))
    if not rows:
        return None
    return to_device(torch.cat(rows), device), to_device(torch.cat(group), device)
