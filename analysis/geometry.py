"""Attention geometry (METHODS.md §4, seed 002): norms versus angles, and position.

Per (layer, head, key category), over valid pairs: sums of ||q'_m||, ||k'_n|| and
cos(q'_m, k'_n) (the post-RoPE vectors the score is made of, S = ||q|| ||k|| cos),
each factorised over queries like the contributions; the attention mass each
category would receive if every key had the mean key norm of its sequence and
head (direction kept, norm variation removed); and, per relative distance
m - n, the summed attention weight and number of pairs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch

from actlake.analysis import grid
from actlake.analysis.layer_qk import LayerQK, attention_chunks
from actlake.categories import ROLE


def key_norm_scale(lq: LayerQK) -> torch.Tensor:
    """(B, H, T) factor that gives every valid key the mean key norm of its sequence and head."""
    k = lq.key_per_query_head
    norms = k.norm(dim=-1)  # (B, H, T)
    v = lq.valid[:, None, :].to(norms.dtype)
    mean = (norms * v).sum(-1, keepdim=True) / v.sum(-1, keepdim=True).clamp(min=1)
    return torch.where(norms > 0, mean / norms.clamp(min=1e-30), torch.ones_like(norms)) * v + (1 - v)


@dataclass
class Geometry:
    TABLES = ("attention_geometry", "attention_by_distance")
    """Reduced table names (partials: ``<name>_by_shard``)."""

    n_pairs: np.ndarray
    """(L, C) valid pairs with the key in category c."""
    q_norm: np.ndarray
    """(L, H, C) sum over those pairs of ||q'_m||."""
    k_norm: np.ndarray
    """(L, H, C) sum over those pairs of ||k'_n||."""
    cos: np.ndarray
    """(L, H, C) sum over those pairs of cos(q'_m, k'_n)."""
    mass: np.ndarray
    """(L, H, C) attention mass received by keys of category c (ordinary softmax)."""
    mass_keynorm: np.ndarray
    """(L, H, C) the same with every key rescaled to its sequence's mean key norm."""
    n_queries: np.ndarray
    """(L,) valid queries."""
    dist_attn: np.ndarray
    """(L, H, 2T-1) summed attention weight at relative distance m - n = i - (T-1)."""
    dist_pairs: np.ndarray
    """(L, 2T-1) valid pairs at each relative distance."""

    @classmethod
    def zeros(cls, n_layers: int, n_heads: int, max_len: int) -> "Geometry":
        L, H, C, D = n_layers, n_heads, len(ROLE), 2 * max_len - 1
        z = lambda *s: np.zeros(s)
        return cls(z(L, C), z(L, H, C), z(L, H, C), z(L, H, C), z(L, H, C), z(L, H, C), z(L), z(L, H, D), z(L, D))

    @property
    def max_len(self) -> int:
        return (self.dist_pairs.shape[1] + 1) // 2

    def add_layer(self, lq: LayerQK) -> None:
        l, k_oh = lq.layer, lq.key_onehot
        valid = lq.valid.to(lq.query.dtype)
        q = lq.query * valid[:, None, :, None]  # (B, H, T, d_h)
        k = lq.key_per_query_head
        qn, kn = q.norm(dim=-1), k.norm(dim=-1)  # (B, H, T)
        per_key = lq.queries_per_key()  # (B, T)
        self.n_pairs[l] += torch.einsum("bt,btc->c", per_key, k_oh).cpu().numpy()
        self.q_norm[l] += torch.einsum("bht,btc->hc", lq.sum_over_queries(qn).double(), k_oh).cpu().numpy()
        self.k_norm[l] += torch.einsum("bht,bt,btc->hc", kn.double(), per_key, k_oh).cpu().numpy()
        q_unit = q / qn.clamp(min=1e-30)[..., None]
        k_unit = k / kn.clamp(min=1e-30)[..., None]
        cos_sum = (lq.sum_over_queries(q_unit) * k_unit).sum(-1)  # (B, H, T)
        self.cos[l] += torch.einsum("bht,btc->hc", cos_sum.double(), k_oh).cpu().numpy()
        self.n_queries[l] += float(lq.valid.sum())

        B, H, T, _ = q.shape
        if T > self.max_len:
            raise ValueError(f"window of {T} tokens is longer than the geometry's max length {self.max_len}")
        offset = self.max_len - 1
        n = torch.arange(T, device=q.device)
        for scale, target in ((None, self.mass), (key_norm_scale(lq), self.mass_keynorm)):
            for m0, m1, alpha in attention_chunks(lq, key_scale=scale):
                target[l] += torch.einsum("bhmn,bnc->hc", alpha.double(), k_oh).cpu().numpy()
                if scale is None:
                    dist = (torch.arange(m0, m1, device=q.device)[:, None] - n[None, :] + offset).reshape(-1)  # (chunk*T,)
                    summed = alpha.double().sum(0).reshape(H, -1)  # (H, chunk*T)
                    self.dist_attn[l] += torch.zeros(H, 2 * self.max_len - 1, dtype=torch.float64, device=q.device).index_add_(1, dist, summed).cpu().numpy()
                    pairs = (lq.pair_mask()[:, 0, m0:m1] & lq.valid.bool()[:, m0:m1, None]).double().sum(0).reshape(-1)
                    self.dist_pairs[l] += torch.zeros(2 * self.max_len - 1, dtype=torch.float64, device=q.device).index_add_(0, dist, pairs).cpu().numpy()

    def merge(self, o: "Geometry") -> "Geometry":
        return Geometry(*(getattr(self, f) + getattr(o, f) for f in self.__dataclass_fields__))

    def to_arrow(self) -> tuple[pa.Table, pa.Table]:
        """(attention_geometry rows, attention_by_distance rows)."""
        L, H, C = self.q_norm.shape
        geo = grid.to_arrow([("layer", L), ("head", H), ("key_category", ROLE)], {
            "n_pairs": self.n_pairs[:, None].repeat(H, 1), "q_norm_sum": self.q_norm, "k_norm_sum": self.k_norm,
            "cos_sum": self.cos, "mass": self.mass, "mass_keynorm": self.mass_keynorm,
            "n_queries": self.n_queries[:, None, None].repeat(H, 1).repeat(C, 2)})
        D = self.dist_pairs.shape[1]
        dist = grid.to_arrow([("layer", L), ("head", H), ("distance_index", D)],
                             {"attn_sum": self.dist_attn, "n_pairs": self.dist_pairs[:, None].repeat(H, 1)})
        dist = dist.append_column("distance", pa.compute.subtract(dist["distance_index"].cast(pa.int32()), pa.scalar(self.max_len - 1, pa.int32())))
        return geo, dist.drop_columns(["distance_index"])

    @classmethod
    def from_arrow(cls, geo: pa.Table, dist: pa.Table) -> "Geometry":
        g = grid.from_arrow(geo, [("layer", 0), ("head", 0), ("key_category", ROLE)],
                            {k: 3 for k in ("n_pairs", "q_norm_sum", "k_norm_sum", "cos_sum", "mass", "mass_keynorm", "n_queries")})
        max_len = -int(pa.compute.min(dist["distance"]).as_py()) + 1
        dist = dist.append_column("distance_index", pa.compute.add(dist["distance"], pa.scalar(max_len - 1, pa.int32())))
        d = grid.from_arrow(dist, [("layer", 0), ("head", 0), ("distance_index", 2 * max_len - 1)], {"attn_sum": 3, "n_pairs": 3})
        return cls(g["n_pairs"][:, 0], g["q_norm_sum"], g["k_norm_sum"], g["cos_sum"], g["mass"], g["mass_keynorm"],
                   g["n_queries"][:, 0, 0], d["attn_sum"], d["n_pairs"][:, 0])

    def to_tables(self) -> dict[str, pa.Table]:
        geo, dist = self.to_arrow()
        return {"attention_geometry": geo, "attention_by_distance": dist}

    @classmethod
    def from_tables(cls, tables: dict[str, pa.Table]) -> "Geometry":
        return cls.from_arrow(tables["attention_geometry"], tables["attention_by_distance"])
