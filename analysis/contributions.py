"""Per-dimension contributions C_j to attention scores, aggregated by token category (METHODS.md §3).

C(m, n) = u(m, n) * x_n with u(m, n) = W_K R_n^T q'_m, so that
sum_j C_j(m, n) = S(m, n) - q'_m . R_n b_K  (the bias term moves no attention weight).
With a key norm (q/k norm: Qwen3, OLMo 2, Gemma 3) W_K and b_K carry its gain and u(m, n) the key's
1 / r_n (``LayerQK.key_scale``). With attention softcapping, S is the score before the cap.

Sums over all valid pairs with the key in category c never build the T x T x d tensor:
sum_{n in c} x_n * W_K R_n^T (sum_{m valid for n} q'_m), an O(T d d_h) computation per head.
The attention-weighted variant replaces the inner sum by sum_m alpha_mn q'_m. For
bidirectional attention without RoPE the inner sum is the same for every key of a
sequence, and the whole sum is (sum_{n in c} x_n) * W_K (sum_m q_m): per sequence.
"""

from __future__ import annotations

import html
from dataclasses import dataclass

import torch

from actlake.analysis.dim_moments import top_outlier_dims
from actlake.analysis.engine.device import tf32
from actlake.analysis.engine.layer_qk import LayerQK
from actlake.analysis.protocol import Column, LabelsOf, NoOptions, OneTable, TableDoc
from actlake.analysis.stats import SumStats, accumulate, zeros
from actlake.categories import ROLE

QUERY_GROUPS_ALL = ("all",)
QUERY_GROUPS_BY_ROLE = ("all",) + ROLE


def _kv_expanded(lq: LayerQK, t: torch.Tensor) -> torch.Tensor:
    """(H_kv, ...) per key head -> (H, ...) per query head."""
    rep = lq.n_heads // t.shape[0]
    return t.repeat_interleave(rep, dim=0) if rep > 1 else t


def contributions_by_category(lq: LayerQK, *qsums: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """For each (B, H, T, d_h) ``qsum``: ((H, C, d), (H, C)) float64, the sums over keys n in category c
    of x_n * W_K R_n^T qsum(n) and of the bias term (R_n^T qsum(n)) . b_K.

    Never builds the (B, H, T, d) tensor: the batch's valid keys are gathered sorted by category
    (:class:`~actlake.analysis.engine.layer_qk.KeyOrder`), then per category M = X_c^T [Q_c ...] (d, H * k * d_h)
    is one GEMM over that category's rows for all heads and ``qsums`` at once, and
    C_j = sum_k W_K[j, k] M[j, k] per head. Cost O(T d d_h) per head and qsum, the order of one projection.
    """
    q = lq.unrotate(torch.stack(qsums, dim=3))  # (B, H, T, k, d_h)
    q = lq.scale_keys(q)  # a key norm: the pair's contributions scale with 1 / r_n (on the dims it norms)
    B, H, T, k, dh = q.shape
    d, C = lq.x.shape[-1], lq.key_onehot.shape[-1]
    keys = lq.batch.key_order
    xs = lq.x.reshape(B * T, d).index_select(0, keys.rows)  # (N, d): valid keys, category by category
    qs = q.permute(0, 2, 1, 3, 4)[keys.seq, keys.pos].view(-1, H * k * dh)  # (N, H * k * d_h), one gather
    m = xs.new_empty(C, d, H * k * dh)  # (C, d, H * k * d_h), every category written below
    for c, (a, b) in enumerate(keys.spans):
        if b > a:
            torch.mm(xs[a:b].T, qs[a:b], out=m[c])
        else:
            m[c].zero_()
    # C_j = sum_k W_K[j, k] M[j, k] per head and qsum (d_h terms: float32 is as exact as the GEMM), as a
    # batched product (k x d_h) @ (d_h x 1): 4x faster on a CPU than multiplying and summing; in full
    # float32 (M's entries are sums, which TF32 would round)
    w = _kv_expanded(lq, lq.w_key).transpose(0, 1)  # (d, H, d_h)
    with tf32(False):
        per_dim = torch.matmul(m.view(C, d, H, k, dh), w[..., None])[..., 0]  # (C, d, H, k)
    per_dim = per_dim.permute(3, 2, 0, 1).double()  # (k, H, C, d)
    bias = per_dim.new_zeros(k, H, C)
    if lq.b_key is not None:
        with tf32(False):  # (C, H * k * d_h): each category's sum, what the bias term needs
            q_by_cat = torch.mm(keys.member, qs)
        bk = _kv_expanded(lq, lq.b_key)  # (H, d_h)
        bias = torch.einsum("chik,hk->ihc", q_by_cat.view(C, H, k, dh).double(), bk.double())
    if lq.shift_per_token:  # clipped keys' correction, one per key: R_n delta_n
        qu = lq.unrotate(torch.stack(qsums, dim=3)).permute(0, 2, 1, 3, 4)[keys.seq, keys.pos]  # (n, H, k, d_h)
        shift = _kv_expanded(lq, lq.key_shift.transpose(0, 1)).transpose(0, 1).permute(0, 2, 1, 3)[keys.seq, keys.pos]
        per_key = torch.einsum("nhid,nhd->nhi", qu.double(), shift.double()).reshape(qu.shape[0], -1)
        bias = bias + torch.mm(keys.member.double(), per_key).view(C, H, k).permute(2, 1, 0)
    elif lq.key_shift is not None:  # a key LayerNorm's bias: R_n beta, not scaled by 1 / r_n
        qu = lq.unrotate(torch.stack(qsums, dim=3)).permute(0, 2, 1, 3, 4)[keys.seq, keys.pos].reshape(-1, H * k * dh)
        with tf32(False):
            q_by_cat = torch.mm(keys.member, qu)
        bias = bias + torch.einsum("chik,hk->ihc", q_by_cat.view(C, H, k, dh).double(),
                                   _kv_expanded(lq, lq.key_shift).double())
    return list(zip(per_dim, bias))


def contributions_per_sequence(lq: LayerQK, qsum: torch.Tensor) -> torch.Tensor:
    """(H, C, d) float64 as :func:`contributions_by_category` for a ``qsum`` (B, H, d_h) that is the same
    at every key of a sequence (bidirectional attention without RoPE): then the sum over keys in c is
    (sum_{n in c} x_n) * W_K qsum, one (C, d) sum per sequence instead of a GEMM over tokens."""
    w = _kv_expanded(lq, lq.w_key).double()  # (H, d, d_h)
    # per sequence (at most one window of tokens) float32 sums are exact enough; float64 from here
    x_by_cat = torch.bmm(lq.key_onehot.transpose(1, 2).to(lq.x.dtype), lq.x).double()  # (B, C, d)
    u = torch.einsum("bhk,hdk->bhd", qsum.double(), w)  # (B, H, d): W_K qsum per sequence
    return (x_by_cat[:, None] * u[:, :, None]).sum(0)  # (H, C, d); elementwise: tiny batched GEMMs are slow


def bias_term(lq: LayerQK, qsum: torch.Tensor) -> torch.Tensor:
    """(B, H, T): (R_n^T qsum(n)) . b_K, the part of the summed scores no dimension of x owns."""
    out = qsum.new_zeros(qsum.shape[:3])
    if lq.b_key is not None:
        out = torch.einsum("bhtk,hk->bht", lq.scale_keys(lq.unrotate(qsum)), _kv_expanded(lq, lq.b_key))
    if lq.shift_per_token:  # clipped keys' correction, one per key
        shift = _kv_expanded(lq, lq.key_shift.transpose(0, 1)).transpose(0, 1)  # (B, H, T, d_h)
        out = out + torch.einsum("bhtk,bhtk->bht", lq.unrotate(qsum), shift.to(qsum.dtype))
    elif lq.key_shift is not None:  # a key LayerNorm's bias (not scaled by 1 / r_n)
        out = out + torch.einsum("bhtk,hk->bht", lq.unrotate(qsum), _kv_expanded(lq, lq.key_shift))
    return out


@dataclass
class Contributions(OneTable, SumStats):
    name = "contributions"
    about = 'Per-dimension contributions to attention scores by key category (and their attention-weighted sums), merged into `contributions`.'
    graph_safe = True
    sites = frozenset({"attention", "layer_inputs"})
    products = frozenset({"weighted_qsum"})
    tables = ("contributions",)
    table_docs = {"contributions": TableDoc(
        "layer × head × key category × query category × dimension (reduced)", {
            "layer": "", "head": "", "key_category": "",
            "query_category": "`all` unless `analyses.contributions: {by_query_category: true}`", "dim": "",
            "contribution_sum": "Σ C_j over valid pairs, score units before the 1/√d_h scale", "n_pairs": "",
            "bias_sum": "Σ q′·R_n b_K, the part of the scores no dimension owns",
            "weighted_sum": "Σ α_mn C_j(m, n), query category `all` only", "weighted_bias_sum": "", "n_queries": ""},
        intro="per-dimension contributions C_j to attention scores (METHODS.md §3; seed 001 eq. 7)")}
    views = {"contributions_mean": """
        SELECT source, layer, head, query_category, key_category, dim, n_pairs,
               contribution_sum / nullif(n_pairs, 0) AS mean_contribution,
               bias_sum / nullif(n_pairs, 0) AS mean_bias_term,
               CASE WHEN query_category = 'all' THEN weighted_sum / nullif(n_queries, 0) END AS weighted_per_query
        FROM contributions"""}
    view_docs = {"contributions_mean": "`mean_contribution` = contribution_sum / n_pairs (seed 001 Table 1 is "
                                       "`SELECT key_category, avg(mean_contribution) FROM contributions_mean WHERE "
                                       "layer = L AND dim = J AND query_category = 'all' GROUP BY 1`), "
                                       "`mean_bias_term`, `weighted_per_query`"}

    AXES = [("layer", 0), ("head", 0), ("key_category", ROLE),
            ("query_category", LabelsOf("query_groups", (QUERY_GROUPS_ALL, QUERY_GROUPS_BY_ROLE))), ("dim", 0)]
    COLUMNS = {"n_pairs": Column("n_pairs", ("layer", "query_category", "key_category")),
               "bias_sum": Column("bias", ("layer", "head", "query_category", "key_category")),
               # the weighted sums belong to query category 'all' only (0 in the other categories' rows)
               "weighted_bias_sum": Column("weighted_bias", ("layer", "head", "key_category"),
                                           first_only=("query_category",)),
               "contribution_sum": Column("contrib", ("layer", "head", "query_category", "key_category", "dim")),
               "weighted_sum": Column("weighted", ("layer", "head", "key_category", "dim"), first_only=("query_category",)),
               "n_queries": Column("n_queries", 1)}

    contrib: torch.Tensor
    """(L, H, G, C, d) sum over valid pairs (query in group g, key in category c) of C_j."""
    bias: torch.Tensor
    """(L, H, G, C) sum over the same pairs of q'_m . R_n b_K."""
    n_pairs: torch.Tensor
    """(L, G, C) number of valid pairs."""
    weighted: torch.Tensor
    """(L, H, C, d) sum over queries and keys in c of alpha_mn C_j(m, n)."""
    weighted_bias: torch.Tensor
    """(L, H, C) sum of alpha_mn q'_m . R_n b_K."""
    n_queries: torch.Tensor
    """(L,) valid queries (the weighted sums are over them)."""
    query_groups: tuple[str, ...] = QUERY_GROUPS_ALL
    weighted_on: bool = True
    """Accumulate the attention-weighted sums (they need the ``weighted_qsum`` product)."""

    class Options(NoOptions):
        weighted: bool = True
        """The attention-weighted sums too (they need explicit attention weights, computed in query blocks): the
        costliest analysis (docs: Benchmarks)."""
        by_query_category: bool = False
        """Also split the contributions by the query's category (one more pass per query category)."""

    @classmethod
    def products_for(cls, options: dict) -> frozenset:
        return cls.products if options.get("weighted", True) else frozenset()

    @classmethod
    def create(cls, spec, by_query_category: bool = False, weighted: bool = True) -> "Contributions":
        groups = QUERY_GROUPS_BY_ROLE if by_query_category else QUERY_GROUPS_ALL
        out = cls.zeros(spec.n_layers, spec.n_heads, spec.d_model, groups, device=spec.device)
        out.weighted_on = weighted
        if not weighted:
            out.products = frozenset()
        return out

    @classmethod
    def zeros(cls, n_layers, n_heads, d, query_groups=QUERY_GROUPS_ALL, device=None) -> "Contributions":
        L, H, G, C = n_layers, n_heads, len(query_groups), len(ROLE)
        z = lambda *s: zeros(*s, device=device)
        return cls(z(L, H, G, C, d), z(L, H, G, C), z(L, G, C), z(L, H, C, d), z(L, H, C), z(L), tuple(query_groups))

    def add_layer(self, lq: LayerQK, weighted: bool | None = None) -> None:
        """Accumulate one layer; ``weighted`` (default: as created) adds the attention-weighted sums."""
        weighted = self.weighted_on if weighted is None else weighted
        l, k_oh = lq.layer, lq.key_onehot  # (B, T, C)
        # bidirectional without RoPE: every key of a sequence is seen by the same queries
        per_sequence = not lq.causal and lq.cos is None and lq.key_scale is None and lq.batch.window is None
        targets, values = [], []  # accumulated together at the end (one operation on a GPU)
        general = []  # (query group or None for weighted, qsum (B, H, T, d_h)) for the per-token path
        for g, group in enumerate(self.query_groups):
            if group == "all":
                q = lq.valid_query  # (B, H, T, d_h), zero outside the group
                n_pairs = lq.batch.pairs_by_key_category
            else:
                qmask = lq.query_onehot[..., ROLE.index(group)].to(torch.float32)
                q = lq.query * qmask[:, None, :, None]
                counts = lq.sum_over_queries(qmask.double()[:, None, :])[:, 0] * lq.valid  # (B, T)
                n_pairs = torch.einsum("bt,btc->c", counts.double(), k_oh)
            targets.append(self.n_pairs[l, g])
            values.append(n_pairs)
            if per_sequence:
                qsum = q.sum(2)  # (B, H, d_h)
                bias = bias_term(lq, qsum[:, :, None]).double()[..., 0]  # (B, H)
                targets += [self.contrib[l, :, g], self.bias[l, :, g]]
                values += [contributions_per_sequence(lq, qsum), torch.einsum("bh,btc->hc", bias, k_oh)]
            else:  # at each key n, the sum of q'_m over the queries that may attend to it
                general.append((g, lq.sum_over_queries(q)))
        if weighted:
            general.append((None, lq.product("weighted_qsum")))
        if general:
            sums = contributions_by_category(lq, *(qsum for _, qsum in general))
            for (g, _), (s, bias) in zip(general, sums):
                if g is None:
                    targets += [self.weighted[l], self.weighted_bias[l]]
                else:
                    targets += [self.contrib[l, :, g], self.bias[l, :, g]]
                values += [s, bias]
        accumulate(targets + [self.n_queries[l]], values + [lq.batch.n_valid])

    def merge(self, other: "Contributions") -> "Contributions":
        assert self.query_groups == other.query_groups
        return super().merge(other)


    @classmethod
    def charts(cls, con) -> list:
        import altair as alt

        layers = contribution_layers(con)
        df = contribution_ranges(con, layers)
        base = alt.Chart(df).encode(x=alt.X("dim:Q", title="dimension j", scale=alt.Scale(nice=False)))
        tips = ["layer", "dim", alt.Tooltip("lowest:Q", format=".3f"), alt.Tooltip("mean:Q", format=".3f"),
                alt.Tooltip("highest:Q", format=".3f")]
        c = alt.layer(
            base.mark_rule(opacity=0.5).encode(y=alt.Y("lowest:Q", title="mean C_j"),
                                               y2="highest:Q", tooltip=tips),
            base.mark_circle(size=8, color="black").encode(y="mean:Q", tooltip=tips),
        ).properties(width=640, height=150).facet(row=alt.Row("layer:O", title="layer"))
        blocks = [(6, ("contributions", "Per-dimension contributions to attention scores over all keys, each "
                                        "dimension's range over the heads and their mean (after Maruta & Matsuzaki, Fig. 4)", c))]
        have = {r[0] for r in con.execute("SELECT table_name FROM information_schema.tables").fetchall()}
        if "outliers" in have:
            blocks.append((5, table1_html(con)))
        return blocks


def contribution_layers(con) -> list[int]:
    """The second, middle and last attention layer of the table (Maruta & Matsuzaki show layers 2, 6 and 12 of 12);
    a hybrid's table has its attention layers only, so they are picked among those."""
    layers = [r[0] for r in con.execute("SELECT DISTINCT layer FROM contributions ORDER BY layer").fetchall()]
    n = len(layers)
    return sorted({layers[min(1, n - 1)], layers[n // 2], layers[n - 1]})


def contribution_ranges(con, layers: list[int]):
    """Seed 001 Fig. 4's data, one row per (layer, dimension): mean C_j over every valid pair (all key
    categories), its lowest and highest value over the heads and the heads' mean. A row per head would be
    L x H x d points (about 2 M for a 4096-dimension model's three layers): too many for a page or a PNG;
    the per-category means of the outlier dimensions are Table 1's."""
    return con.execute(f"""
        WITH per_head AS (
            SELECT layer, head, dim, sum(contribution_sum) / sum(n_pairs) AS c
            FROM contributions WHERE query_category = 'all' AND n_pairs > 0 AND layer IN ({", ".join(map(str, layers))})
            GROUP BY layer, head, dim)
        SELECT layer, dim, min(c) AS lowest, avg(c) AS mean, max(c) AS highest
        FROM per_head GROUP BY layer, dim ORDER BY layer, dim
    """).df()


def table1_html(con) -> str:
    """Seed 001 Table 1: mean C_j of the top outlier dimensions by key category, for the chosen layers."""
    dims = top_outlier_dims(con)
    layers = contribution_layers(con)
    rows = con.execute(f"""
        SELECT layer, dim, key_category, sum(contribution_sum) / nullif(sum(n_pairs), 0) AS mean_c
        FROM contributions WHERE query_category = 'all' AND dim IN ({", ".join(map(str, dims))})
          AND layer IN ({", ".join(map(str, layers))})
        GROUP BY layer, dim, key_category ORDER BY layer, dim, key_category
    """).fetchall()
    cats = sorted({r[2] for r in rows})
    grid_: dict = {}
    for layer, dim, cat, v in rows:
        grid_.setdefault((layer, dim), {})[cat] = v
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cats)
    body = "".join(
        f"<tr><td>{layer}</td><td>{dim}</td>" + "".join(
            f"<td>{'' if vals.get(c) is None else f'{vals[c]:.3f}'}</td>" for c in cats) + "</tr>"
        for (layer, dim), vals in sorted(grid_.items()))
    return ("<section><h2>Mean contribution C_j of the top outlier dimensions, by key category (all heads, all "
            "valid pairs; after Maruta & Matsuzaki, Table 1)</h2>"
            f"<table class='t1'><tr><th>layer</th><th>dim</th>{head}</tr>{body}</table>"
            "<p>SQL: <code>SELECT * FROM contributions_mean WHERE layer = L AND dim = J</code></p></section>")
