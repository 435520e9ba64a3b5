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

from actlake.analysis import grid
from actlake.analysis.moments import GroupSums, Moments
from actlake.categories import SCHEMES

GROUPS: tuple[tuple[str, str], ...] = tuple((s, c) for s, cats in SCHEMES.items() for c in cats)
"""(scheme, category) of each group index."""


def group_ids(valid: torch.Tensor, role: torch.Tensor, type8: torch.Tensor) -> torch.Tensor:
    """(B, T) masks and ids -> (B, T, 3) the group (index into GROUPS) of each token in each scheme;
    len(GROUPS) (no group) on padding."""
    n_role = len(SCHEMES["role"])
    ids = torch.stack([torch.zeros_like(role), 1 + role.clamp(min=0), 1 + n_role + type8.clamp(min=0)], dim=-1)
    return torch.where(valid.bool()[..., None], ids, len(GROUPS))


@dataclass
class DimMoments:
    TABLES = ("dim_moments",)
    """Reduced table names (partials: ``<name>_by_shard``)."""

    moments: Moments
    """Shape (L+1, G, d)."""
    nonfinite: np.ndarray
    """(L+1,) tokens left out per layer because their vector held inf or NaN."""

    @classmethod
    def from_batch(cls, hidden_states, valid, role, type8) -> "DimMoments":
        """hidden_states: L+1 tensors (B, T, d); valid/role/type8: (B, T)."""
        ids = group_ids(valid, role, type8).reshape(-1, 3)  # (B*T, 3)
        work = GroupSums(ids, len(GROUPS), hidden_states[0].shape[-1])  # shared by the layers
        per_layer, nonfinite = [], []
        for h in hidden_states:
            x = h.reshape(-1, h.shape[-1])  # (B*T, d)
            layer_ids, layer_work, bad = ids, work, 0.0
            if not bool(torch.isfinite(x.sum())):  # inf/NaN somewhere (a sum keeps them): find the tokens
                finite = torch.isfinite(x).all(-1)
                bad = float(((~finite) & valid.reshape(-1).bool()).sum())
                layer_ids = torch.where(finite[:, None], ids, len(GROUPS))
                layer_work = GroupSums(layer_ids, len(GROUPS), x.shape[-1])
                x = torch.where(finite[:, None], x, 0)
            nonfinite.append(bad)
            per_layer.append(Moments.from_groups(x, layer_ids, len(GROUPS), layer_work))
        stack = lambda name: np.stack([getattr(m, name) for m in per_layer])
        return cls(Moments(stack("count"), stack("mean"), stack("m2"), stack("max_abs")), np.array(nonfinite))

    def merge(self, other: "DimMoments") -> "DimMoments":
        return DimMoments(self.moments.merge(other.moments), self.nonfinite + other.nonfinite)

    def axes(self) -> list:
        L1, G, d = self.moments.mean.shape
        return [("layer", L1), ("group", G), ("dim", d)]

    def to_arrow(self) -> pa.Table:
        m = self.moments
        t = grid.to_arrow(self.axes(), {"count": m.count, "mean": m.mean, "m2": m.m2, "max_abs": m.max_abs,
                                        "nonfinite_tokens": self.nonfinite})
        g = t["group"].to_numpy()
        schemes = np.array([s for s, _ in GROUPS])[g]
        cats = np.array([c for _, c in GROUPS])[g]
        return (t.drop_columns(["group"]).add_column(1, "scheme", pa.array(schemes)).add_column(2, "category", pa.array(cats)))

    @classmethod
    def from_arrow(cls, t: pa.Table) -> "DimMoments":
        keys = [f"{s}/{c}" for s, c in GROUPS]
        combined = pa.compute.binary_join_element_wise(t["scheme"], t["category"], "/")
        group = pa.compute.index_in(combined, pa.array(keys)).to_numpy()
        t = t.append_column("group", pa.array(group, pa.int32()))
        v = grid.from_arrow(t, [("layer", 0), ("group", len(GROUPS)), ("dim", 0)],
                            {"count": 2, "mean": 3, "m2": 3, "max_abs": 3, "nonfinite_tokens": 1})
        return cls(Moments(v["count"], v["mean"], v["m2"], v["max_abs"]), v["nonfinite_tokens"])

    def to_tables(self) -> dict[str, pa.Table]:
        return {"dim_moments": self.to_arrow()}

    @classmethod
    def from_tables(cls, tables: dict[str, pa.Table]) -> "DimMoments":
        return cls.from_arrow(tables["dim_moments"])
