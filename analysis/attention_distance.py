"""Mean attention weight as a function of relative position m - n (METHODS.md §4).

Needs the weights themselves (a fused kernel cannot group by m - n): the
``distance`` product of :mod:`actlake.analysis.engine.attention_weights`, summed over the
batch block by block, then along diagonals.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa
import torch

from actlake.analysis.engine.layer_qk import LayerQK
from actlake.analysis.protocol import Column, OneTable, TableDoc
from actlake.analysis.stats import SumStats, accumulate, zeros

SHOWN_DISTANCE = 32
"""The report's chart draws relative positions |m - n| up to this (its title says so); the table holds every one."""


@dataclass
class AttentionByDistance(OneTable, SumStats):
    name = "attention_by_distance"
    about = 'Mean attention weight per relative position m - n (needs the weights: explicit blocks, or a Triton kernel on the FlashAttention path; not `attention_weights: fused`).'
    graph_safe = True
    sites = frozenset({"attention"})
    products = frozenset({"distance"})
    tables = ("attention_by_distance",)
    table_docs = {"attention_by_distance": TableDoc("layer × head × relative position (reduced)", {
        "layer": "", "head": "", "distance": "m − n: query minus key position", "attn_sum": "Σ α_mn",
        "n_pairs": ""})}
    views = {"attention_by_distance_mean": """
        SELECT source, layer, head, distance, n_pairs, attn_sum / nullif(n_pairs, 0) AS mean_attention
        FROM attention_by_distance WHERE n_pairs > 0"""}
    view_docs = {"attention_by_distance_mean": "`mean_attention` = attn_sum / n_pairs per relative position"}

    AXES = [("layer", 0), ("head", 0), ("distance_index", 0)]
    COLUMNS = {"attn_sum": Column("attn"), "n_pairs": Column("pairs", ("layer", "distance_index"))}

    attn: torch.Tensor
    """(L, H, 2T-1) summed attention weight at m - n = i - (T - 1)."""
    pairs: torch.Tensor
    """(L, 2T-1) valid pairs at each m - n."""

    @classmethod
    def zeros(cls, n_layers: int, n_heads: int, max_len: int, device=None) -> "AttentionByDistance":
        return cls(zeros(n_layers, n_heads, 2 * max_len - 1, device=device), zeros(n_layers, 2 * max_len - 1, device=device))

    @classmethod
    def create(cls, spec, **options) -> "AttentionByDistance":
        return cls.zeros(spec.n_layers, spec.n_heads, spec.max_length, device=spec.device)

    @property
    def max_len(self) -> int:
        return (self.pairs.shape[1] + 1) // 2

    def add_layer(self, lq: LayerQK) -> None:
        T = lq.query.shape[2]
        if T > self.max_len:
            raise ValueError(f"window of {T} tokens is longer than the distance profile's {self.max_len}")
        off = self.max_len - T  # the batch's m - n = 0 sits at index T - 1, ours at max_len - 1
        accumulate([self.attn[lq.layer, :, off : off + 2 * T - 1], self.pairs[lq.layer]],
                   [lq.product("distance"), lq.batch.pairs_by_distance(self.max_len)])

    # overridden: the table's distance is m - n, centred (index - (max_len - 1)), and its column comes last
    def to_arrow(self) -> pa.Table:
        t = super().to_arrow()
        distance = pa.compute.subtract(t["distance_index"], pa.scalar(self.max_len - 1, pa.int32()))
        return t.append_column("distance", distance).drop_columns(["distance_index"])

    @classmethod
    def from_arrow(cls, t: pa.Table) -> "AttentionByDistance":
        max_len = -int(pa.compute.min(t["distance"]).as_py()) + 1
        return super().from_arrow(t.append_column(
            "distance_index", pa.compute.add(t["distance"], pa.scalar(max_len - 1, pa.int32()))))

    @classmethod
    def charts(cls, con) -> list:
        import altair as alt

        df = con.execute(f"""
            SELECT layer, distance, sum(attn_sum) / sum(n_pairs) AS mean_attention FROM attention_by_distance
            WHERE n_pairs > 0 AND abs(distance) <= {SHOWN_DISTANCE} GROUP BY layer, distance ORDER BY layer, distance
        """).df()
        c = alt.Chart(df).mark_line().encode(
            x=alt.X("distance:Q", title=f"relative position m - n (query minus key), |m - n| <= {SHOWN_DISTANCE}"),
            y=alt.Y("mean_attention:Q", title="mean attention weight", scale=alt.Scale(type="log")),
            color=alt.Color("layer:O", title="layer"),
            tooltip=["layer", "distance", alt.Tooltip("mean_attention:Q", format=".4f")],
        ).properties(width=520, height=260)
        return [(9, ("attention_by_distance", "Attention by relative position (mean over heads), |m - n| up to "
                                              f"{SHOWN_DISTANCE}; the table attention_by_distance holds every distance", c))]

