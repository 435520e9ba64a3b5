"""How peaked each head's attention is: the largest attention weight of each query, summed per layer, query
category and head (``analyses.attention_peak: true``; off by default). A head whose queries put most of their
weight on one key (an attention sink, a previous-token head) has a mean peak near 1; a head that spreads its
weight evenly over T keys, 1/T."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from actlake.analysis.protocol import Column, OneTable, TableDoc
from actlake.analysis.stats import SumStats, zeros
from actlake.categories import ROLE


@dataclass
class AttentionPeak(OneTable, SumStats):
    name = "attention_peak"
    about = "Each query's largest attention weight, summed per layer, query category and head (`attention_peak`; view `attention_peak_mean`): how peaked each head is."
    default_on = False
    sites = frozenset({"attention"})
    tables = ("attention_peak",)
    table_docs = {"attention_peak": TableDoc(
        "layer × query category × head (reduced; `analyses.attention_peak: true`, off by default)", {
            "layer": "", "query_category": "", "head": "",
            "peak_sum": "Σ over valid queries of max_n α_mn, the query's largest attention weight", "n_queries": ""})}
    views = {"attention_peak_mean": "SELECT source, layer, query_category, head, "
                                    "peak_sum / nullif(n_queries, 0) AS mean_peak FROM attention_peak"}
    view_docs = {"attention_peak_mean": "`mean_peak` = peak_sum / n_queries per layer, query category and head: near 1 "
                                        "for a head whose queries each look at one key, 1/T for one that spreads "
                                        "evenly"}
    AXES = [("layer", 0), ("query_category", ROLE), ("head", 0)]
    COLUMNS = {"peak_sum": Column("peak"), "n_queries": Column("n_queries", 2)}  # n_queries: repeated over heads

    peak: torch.Tensor
    """(L, C, H) summed max_n alpha_mn over the valid queries m of category c."""
    n_queries: torch.Tensor
    """(L, C) valid queries of category c (the same for every head)."""

    @classmethod
    def create(cls, spec, **options) -> "AttentionPeak":
        L, C, H = spec.n_layers, len(ROLE), spec.n_heads
        return cls(zeros(L, C, H, device=spec.device), zeros(L, C, device=spec.device))

    def add_layer(self, lq) -> None:
        w = lq.weights()  # (B, H, T, T), zero rows for padded queries
        peak = w.amax(-1).double()  # (B, H, T)
        q_oh = lq.query_onehot.double()  # (B, T, C), zero for padded queries
        self.peak[lq.layer] += torch.einsum("bht,btc->ch", peak, q_oh)
        self.n_queries[lq.layer] += q_oh.sum((0, 1))
