"""Attention entropy per layer, query category and head: a custom analysis (docs: Writing an analysis).

Tensor fields are float64 sums (SumStats merges them), sized in create, updated per layer in add_layer on
the model's device, and written as one long table over AXES with a column per entry of COLUMNS."""
from dataclasses import dataclass

import torch

from actlake.analysis.protocol import Column, OneTable
from actlake.analysis.stats import SumStats, zeros
from actlake.categories import ROLE


@dataclass
class AttentionEntropy(OneTable, SumStats):
    name = "attention_entropy"
    sites = frozenset({"attention"})  # add_layer gets each layer's LayerQK
    tables = ("attention_entropy",)
    views = {"attention_entropy_mean": "SELECT source, layer, query_category, head, "
                                       "entropy_sum / nullif(n_queries, 0) AS mean_entropy FROM attention_entropy"}
    AXES = [("layer", 0), ("query_category", ROLE), ("head", 0)]  # 0: length from the tensors or the table
    COLUMNS = {"entropy_sum": Column("entropy"),  # column: the field it holds, spanning every axis
               "n_queries": Column("n_queries", 2)}  # or the first two: repeated over heads

    entropy: torch.Tensor  # (L, C, H) summed entropy (nats) of the attention of queries of category c
    n_queries: torch.Tensor  # (L, C) valid queries of category c (the same for every head)

    @classmethod
    def create(cls, spec, **options) -> "AttentionEntropy":
        L, C, H = spec.n_layers, len(ROLE), spec.n_heads
        return cls(zeros(L, C, H, device=spec.device), zeros(L, C, device=spec.device))

    def add_layer(self, lq) -> None:
        w = lq.weights()  # (B, H, T, T), zero rows for padded queries
        entropy = -(w * torch.log(w.clamp(min=1e-30))).sum(-1)  # (B, H, T)
        self.entropy[lq.layer] += torch.einsum("bht,btc->ch", entropy.double(), lq.query_onehot.double())
        self.n_queries[lq.layer] += lq.query_onehot.double().sum((0, 1))
