"""Attention entropy per head by query category: a custom actlake analysis (README: Your own analysis)."""
from dataclasses import dataclass

import torch

from actlake.analysis import grid
from actlake.analysis.stats import SumStats, np64, tensor, zeros
from actlake.categories import ROLE


@dataclass
class AttentionEntropy(SumStats):
    name, reads, tables = "attention_entropy", frozenset({"attention"}), ("attention_entropy",)
    entropy: torch.Tensor  # (L, H, C): summed entropy (nats) of the attention of queries of category c
    n_queries: torch.Tensor  # (L, C): valid queries of category c

    @classmethod
    def create(cls, spec, **options) -> "AttentionEntropy":
        return cls(zeros(spec.n_layers, spec.n_heads, len(ROLE), device=spec.device),
                   zeros(spec.n_layers, len(ROLE), device=spec.device))

    def add_layer(self, lq) -> None:
        w = lq.weights()  # (B, H, T, T), zero rows for padded queries
        entropy = -(w * torch.log(w.clamp(min=1e-30))).sum(-1)  # (B, H, T)
        self.entropy[lq.layer] += torch.einsum("bht,btc->hc", entropy.double(), lq.query_onehot)
        self.n_queries[lq.layer] += lq.query_onehot.sum((0, 1))

    AXES = [("layer", 0), ("head", 0), ("query_category", ROLE)]

    def to_tables(self) -> dict:
        L, H, _ = self.entropy.shape
        axes = [("layer", L), ("head", H), ("query_category", ROLE)]
        values = {"entropy_sum": np64(self.entropy), "n_queries": np64(self.n_queries)[:, None].repeat(H, 1)}
        return {"attention_entropy": grid.to_arrow(axes, values)}

    @classmethod
    def from_tables(cls, tables: dict) -> "AttentionEntropy":
        v = grid.from_arrow(tables["attention_entropy"], cls.AXES, {"entropy_sum": 3, "n_queries": 3})
        return cls(tensor(v["entropy_sum"]), tensor(v["n_queries"][:, 0]))
