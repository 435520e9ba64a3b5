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

import torch

from actlake.analysis.engine.device import tf32
from actlake.analysis.engine.layer_qk import LayerQK
from actlake.analysis.protocol import Column, OneTable, TableDoc
from actlake.analysis.stats import SumStats, accumulate, zeros
from actlake.categories import ROLE


@dataclass
class Geometry(OneTable, SumStats):
    name = "geometry"
    about = 'Mean ||q||, ||k||, cos(q, k) per key category and the key-normalised attention mass (`attention_geometry`).'
    graph_safe = True
    sites = frozenset({"attention"})
    products = frozenset({"mass", "mass_keynorm"})
    tables = ("attention_geometry",)
    table_docs = {"attention_geometry": TableDoc("layer × head × key category (reduced)", {
        "layer": "", "head": "", "key_category": "", "n_pairs": "", "q_norm_sum": "", "k_norm_sum": "",
        "cos_sum": "sums over valid pairs of ‖q′_m‖, ‖k′_n‖, cos(q′_m, k′_n); post-RoPE vectors",
        "mass": "attention received",
        "mass_keynorm": "attention received when every key is rescaled to the mean key norm of its sequence and head",
        "n_queries": ""})}
    views = {"attention_geometry_mean": """
        SELECT source, layer, head, key_category, n_pairs,
               q_norm_sum / nullif(n_pairs, 0) AS mean_q_norm, k_norm_sum / nullif(n_pairs, 0) AS mean_k_norm,
               cos_sum / nullif(n_pairs, 0) AS mean_cos, mass / nullif(n_queries, 0) AS mean_mass,
               mass_keynorm / nullif(n_queries, 0) AS mean_mass_keynorm
        FROM attention_geometry""",
             # which key category draws the most attention per key token (mean_mass favours the most frequent)
             "attention_per_key": """
        SELECT source, layer, key_category, sum(n_pairs) AS n_pairs, sum(mass) / nullif(sum(n_pairs), 0) AS weight_per_key,
               (sum(mass) / nullif(sum(n_pairs), 0))
                 / (sum(sum(mass)) OVER w / nullif(sum(sum(n_pairs)) OVER w, 0)) AS lift
        FROM attention_geometry GROUP BY source, layer, key_category
        WINDOW w AS (PARTITION BY source, layer)"""}
    view_docs = {
        "attention_geometry_mean": "`mean_q_norm`, `mean_k_norm`, `mean_cos` (over valid pairs), `mean_mass`, "
                                   "`mean_mass_keynorm` (per query)",
        "attention_per_key": "per layer and key category over the heads: `n_pairs`, `weight_per_key` = mass / n_pairs "
                             "(the attention one key token of that category gets from a query that sees it), `lift` = "
                             "that over the layer's weight per key of any category. Which key token draws the most "
                             "attention? (MiniLM on 8 sample documents: [CLS], lift 17-21 in layers 1-4, weight "
                             "0.36-0.43 per query)"}
    AXES = [("layer", 0), ("head", 0), ("key_category", ROLE)]
    COLUMNS = {"n_pairs": Column("n_pairs", ("layer", "key_category")), "q_norm_sum": Column("q_norm"),
               "k_norm_sum": Column("k_norm"), "cos_sum": Column("cos"), "mass": Column("mass"),
               "mass_keynorm": Column("mass_keynorm"), "n_queries": Column("n_queries", 1)}

    n_pairs: torch.Tensor
    """(L, C) valid pairs with the key in category c."""
    q_norm: torch.Tensor
    """(L, H, C) sum over those pairs of ||q'_m||."""
    k_norm: torch.Tensor
    """(L, H, C) sum over those pairs of ||k'_n||."""
    cos: torch.Tensor
    """(L, H, C) sum over those pairs of cos(q'_m, k'_n)."""
    mass: torch.Tensor
    """(L, H, C) attention mass received by keys of category c (ordinary softmax)."""
    mass_keynorm: torch.Tensor
    """(L, H, C) the same with every key rescaled to its sequence's mean key norm."""
    n_queries: torch.Tensor
    """(L,) valid queries."""

    @classmethod
    def zeros(cls, n_layers: int, n_heads: int, device=None) -> "Geometry":
        L, H, C = n_layers, n_heads, len(ROLE)
        z = lambda *s: zeros(*s, device=device)
        return cls(z(L, C), z(L, H, C), z(L, H, C), z(L, H, C), z(L, H, C), z(L, H, C), z(L))

    @classmethod
    def create(cls, spec, **options) -> "Geometry":
        return cls.zeros(spec.n_layers, spec.n_heads, device=spec.device)

    def add_layer(self, lq: LayerQK) -> None:
        l, b = lq.layer, lq.batch
        q, k = lq.valid_query, lq.key_per_query_head  # (B, H, T, d_h), q zero on invalid queries
        qn, kn = q.norm(dim=-1), lq.key_norms  # (B, H, T)
        # at each key, the sums over the queries that see it of the unit queries and of their norms
        if lq.causal:  # m >= n: one reverse cumulative sum of [q / ||q|| | ||q||]
            both = torch.cat([q / qn[..., None].clamp(min=1e-30), qn[..., None]], dim=-1)  # (B, H, T, d_h + 1)
            seen = lq.sum_over_queries(both)
            q_norms_seen, cos_sum = seen[..., -1], (k * seen[..., :-1]).sum(-1)  # (B, H, T)
        else:  # every valid query of the sequence, the same sums at each key: two small products
            with tf32(False):  # TF32 would round the reciprocal norms and their sums
                unit_sum = torch.matmul(qn.clamp(min=1e-30).reciprocal()[:, :, None], q)  # (B, H, 1, d_h)
                cos_sum = torch.matmul(k, unit_sum.transpose(-1, -2))[..., 0]  # (B, H, T)
            q_norms_seen = qn.sum(-1, keepdim=True).expand_as(kn)
        cos_sum = cos_sum / lq.key_norms_safe
        per_key = torch.stack([q_norms_seen, kn * b.queries_per_key_f32[:, None], cos_sum])
        by_cat = torch.einsum("sbht,btc->shc", per_key.double(), lq.key_onehot.double())  # (3, H, C)
        # mass per key category, as computed and with keys at their mean norm (zero on invalid queries)
        mass = [lq.product(p).sum((0, 2), dtype=torch.float64) for p in ("mass", "mass_keynorm")]  # (H, C)
        accumulate([self.n_pairs[l], self.q_norm[l], self.k_norm[l], self.cos[l], self.mass[l], self.mass_keynorm[l],
                    self.n_queries[l]], [b.pairs_by_key_category, *by_cat, *mass, b.n_valid])

    @classmethod
    def charts(cls, con) -> list:
        import altair as alt

        df = con.execute("""
            SELECT layer, key_category, sum(k_norm_sum) / sum(n_pairs) AS mean_k_norm,
                   sum(q_norm_sum) / sum(n_pairs) AS mean_q_norm, sum(cos_sum) / sum(n_pairs) AS mean_cos,
                   sum(mass) / sum(n_queries) AS mass, sum(mass_keynorm) / sum(n_queries) AS mass_keynorm
            FROM attention_geometry WHERE n_pairs > 0 GROUP BY layer, key_category ORDER BY layer
        """).df()
        base = alt.Chart(df).encode(x=alt.X("layer:O", title="layer"), color=alt.Color("key_category:N", title="key category"))
        norms = alt.hconcat(
            base.mark_line(point=True).encode(y=alt.Y("mean_k_norm:Q", title="mean ||k|| over pairs")).properties(width=250, height=200),
            base.mark_line(point=True).encode(y=alt.Y("mean_cos:Q", title="mean cos(q, k) over pairs")).properties(width=250, height=200),
        )
        long = df.melt(id_vars=["layer", "key_category"], value_vars=["mass", "mass_keynorm"], var_name="logits", value_name="m")
        long["logits"] = long["logits"].map({"mass": "as computed (solid)", "mass_keynorm": "at mean norm (dashed)"})
        keynorm = alt.Chart(long).mark_line(point=True).encode(
            x=alt.X("layer:O", title="layer"), y=alt.Y("m:Q", title="mean attention per query"),
            color=alt.Color("key_category:N", title="key category"),
            strokeDash=alt.StrokeDash("logits:N", legend=None),
            shape=alt.Shape("logits:N", title="keys"),  # the legend's marks; the labels name the dashes
            tooltip=["layer", "key_category", "logits", alt.Tooltip("m:Q", format=".3f")],
        ).properties(width=520, height=260)
        return [(7, ("geometry_norms", "Attention geometry: key norm and q-k angle by key category (norm or direction?)", norms)),
                (8, ("keynorm_mass", "How much of each category's attention is key norm: mass with keys rescaled to "
                                     "their mean norm", keynorm))]

