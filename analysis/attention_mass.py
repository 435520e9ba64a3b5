"""Attention mass by query and key category per layer and head (METHODS.md §2).

mass(l, h, cq, ck) = sum over valid queries m of category cq of sum over valid
keys n of category ck of alpha_mn. The mass each query gives each key category is
the ``mass`` product of :mod:`actlake.analysis.engine.attention_weights`: read off the
explicit weights, or, without them, the attention output for V = the one-hot
key-category matrix (one fused kernel call on a (T, C) value).

A model with learned attention sinks (gpt-oss) gives part of each query's softmax to no key: that share is
key category ``sink`` (rows only for such models), so a query's mass over its key categories sums to 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import html

import numpy as np
import pyarrow as pa
import torch

from actlake.analysis.engine import grid
from actlake.analysis.protocol import Column, Headline, OneTable, TableDoc
from actlake.analysis.stats import SumStats, accumulate, np64, tensor, zeros
from actlake.categories import ROLE

KEYS = ROLE + ("sink",)
"""Key categories of the table: the token roles, and the learned sink (rows only when a sink took weight)."""


@dataclass
class AttentionMass(OneTable, SumStats):
    name = "attention_mass"
    about = 'Attention mass by query and key category per layer and head, merged into `attention_mass`.'
    graph_safe = True
    sites = frozenset({"attention"})
    products = frozenset({"mass"})
    tables = ("attention_mass",)
    table_docs = {"attention_mass": TableDoc(
        "layer × head × query category × key category (reduced; a hybrid model's attention layers only, as for every "
        "attention table)", {
            "layer": "", "head": "", "query_category": "",
            "key_category": "`role` scheme, and `sink` for the share of a model's learned attention sinks, gpt-oss: "
                            "rows only for such models, so a query's mass over its key categories sums to 1",
            "mass": "sum of attention weights over valid pairs", "n_queries": "valid queries of that query category",
            "nonfinite_tokens": "tokens of that layer left out of every attention table because their q, k or x "
                                "held inf/NaN"})}
    views = {"attention_mass_by_key": """
        SELECT source, layer, head, key_category, sum(mass) AS mass, sum(n_queries) AS n_queries,
               sum(mass) / sum(n_queries) AS mean_mass
        FROM attention_mass GROUP BY source, layer, head, key_category"""}
    view_docs = {"attention_mass_by_key": "`attention_mass` summed over query categories: `mass`, `n_queries`, "
                                          "`mean_mass` = mass / n_queries (the average attention a query gives to "
                                          "that key category; sums to 1 over key categories). Where does a query's "
                                          "attention go? (`other` gets most: most tokens are other)"}
    nonfinite_layer = "attention layer"
    headlines = (Headline(
        "attention_mass_by_key", "first_token_mass",
        "Attention mass on the leading special token ([CLS] or BOS) by layer, mean over heads", "mass on it",
        "SELECT {series} AS series, layer, avg(mean_mass) AS value FROM attention_mass_by_key{by} WHERE {rows}"
        "key_category = 'bos' GROUP BY ALL ORDER BY ALL", position=2),)

    AXES = [("layer", 0), ("query_category", ROLE), ("head", 0), ("key_category", KEYS)]
    COLUMNS = {"nonfinite_tokens": Column("nonfinite", 1), "n_queries": Column("n_queries", 2),
               "mass": Column("mass", ("layer", "head", "query_category", "key_category"))}

    mass: torch.Tensor
    """(L, H, Cq, Ck) summed attention weight from queries of category cq to keys of category ck."""
    n_queries: torch.Tensor
    """(L, Cq) valid queries of each category (the same for every head)."""
    nonfinite: torch.Tensor
    """(L,) tokens left out of every attention statistic of that layer: their q, k or x held inf/NaN."""
    sink: torch.Tensor
    """(L, H, Cq) summed share of the softmax the learned sink took from queries of category cq (0 without one)."""

    @classmethod
    def zeros(cls, n_layers: int, n_heads: int, n_cat: int = len(ROLE), device=None) -> "AttentionMass":
        return cls(zeros(n_layers, n_heads, n_cat, n_cat, device=device), zeros(n_layers, n_cat, device=device),
                   zeros(n_layers, device=device), zeros(n_layers, n_heads, n_cat, device=device))

    @classmethod
    def create(cls, spec, **options) -> "AttentionMass":
        return cls.zeros(spec.n_layers, spec.n_heads, device=spec.device)

    def nonfinite_excluded(self, layer: int, count: torch.Tensor) -> None:
        """``count`` tokens of ``layer`` left every attention statistic (their q, k or x held inf/NaN)."""
        self.nonfinite[layer] += count.to(self.nonfinite.device)

    def add_layer(self, lq) -> None:
        """Accumulate one layer of one batch (a :class:`~actlake.analysis.engine.layer_qk.LayerQK`)."""
        per_q = lq.product("mass").double()  # (B, H, T, C), zero on invalid queries
        mass = torch.einsum("bhtk,btq->hqk", per_q, lq.query_onehot.double())
        accumulate([self.mass[lq.layer], self.n_queries[lq.layer]], [mass, lq.batch.queries_by_category])
        if lq.sinks is not None:  # zero on invalid queries
            sink = torch.einsum("bht,btq->hq", lq.product("sink").double(), lq.query_onehot.double())
            accumulate([self.sink[lq.layer]], [sink])

    # overridden: the learned sink's share is key category 'sink' of column mass, with rows only when it took any
    def to_arrow(self) -> pa.Table:
        arrays = {"mass": np64(self.mass), "n_queries": np64(self.n_queries), "nonfinite": np64(self.nonfinite)}
        axes = self.AXES
        if bool((self.sink != 0).any()):
            arrays["mass"] = np.concatenate([arrays["mass"], np64(self.sink)[..., None]], axis=-1)
        else:
            axes = [(name, ROLE if name == "key_category" else spec) for name, spec in axes]
        return grid.table(axes, self.COLUMNS, arrays)

    @classmethod
    def from_arrow(cls, t: pa.Table) -> "AttentionMass":
        v = grid.arrays(t, cls.AXES, cls.COLUMNS)  # mass (L, H, Cq, Ck + 1): the last key category is the sink
        return cls(tensor(v["mass"][..., :-1]), tensor(v["n_queries"]), tensor(v["nonfinite"]),
                   tensor(v["mass"][..., -1]))

    @classmethod
    def charts(cls, con) -> list:
        import altair as alt

        df = con.execute("""
            SELECT layer, key_category, avg(mean_mass) AS mean_mass FROM attention_mass_by_key
            GROUP BY layer, key_category ORDER BY layer
        """).df()
        c = alt.Chart(df).mark_bar().encode(
            x=alt.X("layer:O", title="layer"),
            y=alt.Y("mean_mass:Q", title="mean attention per query (avg over heads)", stack="zero"),
            color=alt.Color("key_category:N", title="key category"),
            tooltip=["layer", "key_category", alt.Tooltip("mean_mass:Q", format=".3f")],
        ).properties(width=420, height=260)
        blocks = [(2, ("attention_mass", "Attention mass by key category per layer (after Maruta & Matsuzaki, Fig. 2)", c))]
        heads = first_token_mass(con)
        if not len(heads):
            blocks.append((2.5, f"<p class='note'>{html.escape(NO_FIRST_TOKEN)}</p>"))
        else:
            h = alt.Chart(heads).mark_rect().encode(
                x=alt.X("head:O", title="head"), y=alt.Y("layer:O", title="layer"),
                color=alt.Color("mean_mass:Q", title="mass on it", scale=alt.Scale(scheme="viridis")),
                tooltip=["layer", "head", alt.Tooltip("mean_mass:Q", format=".3f")],
            ).properties(width=26 * heads["head"].nunique(), height=18 * heads["layer"].nunique())
            blocks.append((2.5, ("first_token_mass", "Attention mass on the leading special token ([CLS] or BOS) "
                                                     "per layer and head: the sink, head by head", h)))
        return blocks

    @classmethod
    def run_notes(cls, con) -> list[str]:
        return [NO_FIRST_TOKEN] if no_first_token(con) else []


NO_FIRST_TOKEN = ("No first-token chart: no key of category 'bos' took any attention, because no window starts with "
                  "a special token (this tokenizer puts none first). The attention-sink statistics of the first "
                  "token are empty; set tokenization.prepend_bos: true to put the tokenizer's BOS token first.")


def no_first_token(con) -> bool:
    """Whether a run's ``attention_mass`` has no attention on key category ``bos`` (no window began with one)."""
    return con.execute("SELECT count(*) FROM attention_mass WHERE key_category = 'bos' AND mass > 0").fetchall()[0][0] == 0


def first_token_mass(con):
    """(layer, head, mean_mass) on keys of category ``bos`` (the leading special token), as a DataFrame; no rows
    when the tokenizer adds none."""
    return con.execute("""
        SELECT layer, head, mean_mass FROM attention_mass_by_key
        WHERE key_category = 'bos' AND n_queries > 0 AND mass > 0 ORDER BY layer, head
    """).df()

