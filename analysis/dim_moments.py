"""Per (layer, category, dimension) moments of the residual stream (METHODS.md §1).

Layer 0 is the embedding output. Categories: ``all`` plus the ``role`` and
``type8`` schemes. Tokens whose vector holds inf/NaN are counted per layer and
left out of the moments.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch

from actlake.analysis.moments import Moments
from actlake.categories import SCHEMES

GROUPS: tuple[tuple[str, str], ...] = tuple((s, c) for s, cats in SCHEMES.items() for c in cats)
"""(scheme, category) of each group index."""


def group_membership(valid: torch.Tensor, role: torch.Tensor, type8: torch.Tensor) -> torch.Tensor:
    """(B, T) masks and ids -> (B, T, G) 0/1 membership in each group of GROUPS."""
    cols = [valid.to(torch.float64).unsqueeze(-1)]
    for ids, n in ((role, len(SCHEMES["role"])), (type8, len(SCHEMES["type8"]))):
        cols.append(torch.nn.functional.one_hot(ids.clamp(min=0), n).to(torch.float64) * valid.unsqueeze(-1))
    return torch.cat(cols, dim=-1)


@dataclass
class DimMoments:
    moments: Moments
    """Shape (L+1, G, d)."""
    nonfinite: np.ndarray
    """(L+1,) tokens left out per layer because their vector held inf or NaN."""

    @classmethod
    def from_batch(cls, hidden_states, valid, role, type8) -> "DimMoments":
        """hidden_states: L+1 tensors (B, T, d); valid/role/type8: (B, T)."""
        member = group_membership(valid, role, type8).reshape(-1, len(GROUPS))  # (B*T, G)
        per_layer, nonfinite = [], []
        for h in hidden_states:
            x = h.reshape(-1, h.shape[-1])  # (B*T, d)
            finite = torch.isfinite(x).all(-1)
            nonfinite.append(float(((~finite) & valid.reshape(-1).bool()).sum()))
            keep = finite.to(torch.float64).unsqueeze(-1)
            per_layer.append(Moments.from_groups(torch.where(finite.unsqueeze(-1), x, 0), member * keep))
        stack = lambda name: np.stack([getattr(m, name) for m in per_layer])
        return cls(Moments(stack("count"), stack("mean"), stack("m2"), stack("max_abs")), np.array(nonfinite))

    def merge(self, other: "DimMoments") -> "DimMoments":
        return DimMoments(self.moments.merge(other.moments), self.nonfinite + other.nonfinite)

    def to_arrow(self) -> pa.Table:
        m = self.moments
        L1, G, d = m.mean.shape
        layer, group, dim = np.meshgrid(np.arange(L1), np.arange(G), np.arange(d), indexing="ij")
        g = group.ravel()
        return pa.table({
            "layer": pa.array(layer.ravel(), pa.int16()),
            "scheme": pa.array([GROUPS[i][0] for i in g]),
            "category": pa.array([GROUPS[i][1] for i in g]),
            "dim": pa.array(dim.ravel(), pa.int32()),
            "count": pa.array(np.broadcast_to(m.count[..., None], m.mean.shape).ravel(), pa.float64()),
            "mean": pa.array(m.mean.ravel(), pa.float64()),
            "m2": pa.array(m.m2.ravel(), pa.float64()),
            "max_abs": pa.array(m.max_abs.ravel(), pa.float64()),
            "nonfinite_tokens": pa.array(np.broadcast_to(self.nonfinite[:, None, None], m.mean.shape).ravel(), pa.float64()),
        })

    @classmethod
    def from_arrow(cls, t: pa.Table) -> "DimMoments":
        L1 = int(pa.compute.max(t["layer"]).as_py()) + 1
        d = int(pa.compute.max(t["dim"]).as_py()) + 1
        G = len(GROUPS)
        index = {g: i for i, g in enumerate(GROUPS)}
        cols = t.to_pydict()
        order = np.array([
            (lay * G + index[(s, c)]) * d + j
            for lay, s, c, j in zip(cols["layer"], cols["scheme"], cols["category"], cols["dim"])
        ])
        def grid(name):
            out = np.zeros(L1 * G * d)
            out[order] = np.asarray(cols[name], dtype=np.float64)
            return out.reshape(L1, G, d)
        mom = Moments(grid("count")[..., 0], grid("mean"), grid("m2"), grid("max_abs"))
        return cls(mom, grid("nonfinite_tokens")[:, 0, 0])
