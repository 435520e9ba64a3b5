"""Per (layer, category, dimension) moments of the residual stream (METHODS.md §1).

Layer 0 is the embedding output. Categories: ``all`` plus the ``role`` and
``type8`` schemes. Tokens whose vector holds inf/NaN are counted per layer and
left out of the moments.
"""

from __future__ import annotations

import html
from dataclasses import dataclass

import torch

from actlake.analysis.engine.device import to_device
from actlake.analysis.engine.moments import GroupSums, Moments
from actlake.analysis.protocol import Analysis, Column, Headline, OneTable, TableDoc
from actlake.categories import SCHEMES
from actlake.deprecation import deprecated

GROUPS: tuple[tuple[str, str], ...] = tuple((s, c) for s, cats in SCHEMES.items() for c in cats)
"""(scheme, category) of each group index."""


def group_ids(valid: torch.Tensor, role: torch.Tensor, type8: torch.Tensor) -> torch.Tensor:
    """(B, T) masks and ids -> (B, T, 3) the group (index into GROUPS) of each token in each scheme;
    len(GROUPS) (no group) on padding."""
    n_role = len(SCHEMES["role"])
    ids = torch.stack([torch.zeros_like(role), 1 + role.clamp(min=0), 1 + n_role + type8.clamp(min=0)], dim=-1)
    return torch.where(valid.bool()[..., None], ids, len(GROUPS))


OUTLIER_Z = 5.0
"""|robust z| above which the report marks a dimension as an outlier."""


@dataclass
class DimMoments(OneTable, Analysis):
    name = "dim_moments"
    about = 'Per (layer, category, dimension) moments of the residual stream, merged into `dim_moments`; views `outliers`, `massive_activations`.'
    sites = frozenset({"hidden_states"})
    tables = ("dim_moments",)
    table_docs = {"dim_moments": TableDoc("layer × category × dimension (reduced)", {
        "layer": "", "scheme": "`all`, `role`, `type8`", "category": "", "dim": "", "count": "tokens", "mean": "",
        "m2": "sum of squared deviations; variance = m2/count", "max_abs": "",
        "nonfinite_tokens": "tokens of that layer left out for inf/NaN"})}
    nonfinite_layer = "hidden state"
    headlines = (
        Headline("massive_activations", "massive_activations",
                 "Share of [CLS]/BOS's mean squared norm in its largest dimension, by layer", "share (top dimension)",
                 "SELECT {series} AS series, layer, share AS value, dim FROM massive_activations{by} WHERE {rows}"
                 "scheme = 'role' AND category = 'bos' AND rank = 1 ORDER BY ALL", position=3),
        Headline("outliers", "outliers", f"Outlier dimensions by layer (|robust z| > {OUTLIER_Z:g})", "dimensions",
                 f"SELECT {{series}} AS series, layer, count(*) FILTER (WHERE abs(robust_z) > {OUTLIER_Z}) AS value "
                 "FROM outliers{by} WHERE {rows}true GROUP BY ALL ORDER BY ALL", position=4),
    )
    views = {"outliers": """
        WITH m AS (SELECT source, layer, dim, mean, count FROM dim_moments WHERE scheme = 'all'),
             s AS (SELECT source, layer, median(mean) AS med FROM m GROUP BY source, layer),
             d AS (SELECT source, layer, median(abs(m.mean - s.med)) AS mad FROM m JOIN s USING (source, layer)
                   GROUP BY source, layer)
        SELECT m.source, m.layer, m.dim, m.mean, m.count,
               (m.mean - s.med) / nullif(1.4826 * d.mad, 0) AS robust_z,
               row_number() OVER (PARTITION BY m.source, m.layer ORDER BY abs(m.mean - s.med) DESC, m.dim) AS rank
        FROM m JOIN s USING (source, layer) JOIN d USING (source, layer)""",
             "massive_activations": """
        WITH e AS (SELECT source, layer, dim, scheme, category, count, mean, max_abs,
                          mean * mean + m2 / count AS mean_square FROM dim_moments WHERE count > 0)
        SELECT source, layer, dim, scheme, category, count, mean, max_abs,
               mean_square / sum(mean_square) OVER (PARTITION BY source, layer, scheme, category) AS share,
               row_number() OVER (PARTITION BY source, layer, scheme, category ORDER BY abs(mean) DESC, dim) AS rank
        FROM e"""}
    """``outliers``: dimensions ranked by their mean over all tokens against the layer's other dimensions
    (robust z). ``massive_activations``: dimensions ranked by |mean| within each token category of each
    scheme, so a dimension large only on a rare role ([CLS]) ranks first there; ``share`` is its part of the
    category's mean squared norm, E[x_j²] / E[‖x‖²]."""
    view_docs = {
        "outliers": "per layer and dimension (scheme `all`): `mean`, `robust_z` = (mean − median) / (1.4826 · MAD) "
                    "over that layer's dimensions, `rank` by distance from the median",
        "massive_activations": "per layer, scheme, category and dimension (from `dim_moments`): `count`, `mean`, "
                               "`max_abs`, `share` = E[x_j²] / E[‖x‖²] of that category's tokens, `rank` by |mean| "
                               "within the layer, scheme and category — so a dimension large only on [CLS] "
                               "(`scheme = 'role' AND category = 'bos'`) ranks first there, where `outliers` (all "
                               "tokens) never shows it"}

    AXES = [("layer", 0), (("scheme", "category"), GROUPS), ("dim", 0)]
    COLUMNS = {"count": Column("moments.count", 2), "mean": Column("moments.mean"), "m2": Column("moments.m2"),
               "max_abs": Column("moments.max_abs"), "nonfinite_tokens": Column("nonfinite", 1)}

    moments: Moments
    """Shape (L+1, G, d)."""
    nonfinite: torch.Tensor
    """(L+1,) tokens left out per layer because their vector held inf or NaN."""
    _batch = None
    """The current batch's :class:`BatchMoments` while its hidden states arrive (``add_hidden``)."""
    unchecked = None
    """Device scalar of the last batch added non-strictly (``add_hidden`` of a batch that is not strict,
    :class:`BatchMoments` with ``exact_nonfinite=False``): the sum of every hidden state, not finite
    when one held an inf/NaN that was not looked for (then these moments are wrong and the batch must be
    redone)."""

    @classmethod
    def create(cls, spec, **options) -> "DimMoments":
        L1, G, d, dev = spec.n_layers + 1, len(GROUPS), spec.d_model, spec.device
        z = lambda *shape: torch.zeros(shape, dtype=torch.float64, device=dev)
        return cls(Moments(z(L1, G), z(L1, G, d), z(L1, G, d), z(L1, G, d)), z(L1))

    def add_hidden(self, layer, h, batch) -> None:
        if layer == 0:
            self._batch = BatchMoments(self.moments.mean.shape[0], h.shape[-1], batch.valid, batch.role, batch.type8,
                                       self.moments.mean.device, exact_nonfinite=batch.strict, kernel=batch.triton)
        self._batch.add(layer, h)
        if layer == self.moments.mean.shape[0] - 1:  # the batch's last hidden state
            part, self._batch = self._batch.finish(), None
            merged = self.merge(part)
            self.moments, self.nonfinite, self.unchecked = merged.moments, merged.nonfinite, part.unchecked

    def problems(self) -> list[torch.Tensor]:
        return [] if self.unchecked is None else [(~torch.isfinite(self.unchecked)).double()]

    def merge(self, other: "DimMoments") -> "DimMoments":
        return DimMoments(self.moments.merge(other.moments), self.nonfinite + other.nonfinite.to(self.nonfinite.device))

    def axes(self) -> list:
        """Deprecated (AXES declares the table's axes): [("layer", L+1), ("group", G), ("dim", d)]."""
        deprecated("DimMoments.axes() is deprecated: DimMoments.AXES declares the table's axes; axes() goes in the "
                   "release after 0.2.0")
        L1, G, d = self.moments.mean.shape
        return [("layer", L1), ("group", G), ("dim", d)]

    @classmethod
    def from_fields(cls, fields: dict) -> "DimMoments":  # its four moments are one Moments field
        return cls(Moments(*(fields[f"moments.{k}"] for k in ("count", "mean", "m2", "max_abs"))), fields["nonfinite"])

    @classmethod
    def charts(cls, con) -> list:
        import altair as alt

        df = con.execute(f"""
            SELECT layer, dim, mean, robust_z, abs(robust_z) > {OUTLIER_Z} AS outlier FROM outliers ORDER BY layer, dim
        """).df()
        means = alt.Chart(df).mark_circle(size=12).encode(
            x=alt.X("dim:Q", title="dimension"),
            y=alt.Y("mean:Q", title="mean over all tokens"),
            color=alt.Color("outlier:N", title=f"|robust z| > {OUTLIER_Z:g}", scale=alt.Scale(range=["#9aa5b1", "#d62728"])),
            tooltip=["layer", "dim", alt.Tooltip("mean:Q", format=".3f"), alt.Tooltip("robust_z:Q", format=".1f")],
        ).properties(width=640, height=90).facet(row=alt.Row("layer:O", title="layer (0 = embeddings)"))
        blocks = [(1, ("dim_means", "Per-dimension mean of the residual stream by layer, outliers marked (after Maruta & Matsuzaki, Fig. 1)",
                       means))]
        dims = top_outlier_dims(con)
        if dims:
            df = con.execute(f"""
                SELECT layer, dim, category, mean FROM dim_moments
                WHERE scheme = 'role' AND dim IN ({", ".join(map(str, dims))}) AND count > 0 ORDER BY layer
            """).df()
            c = alt.Chart(df).mark_line(point=True).encode(
                x=alt.X("layer:O", title="layer"), y=alt.Y("mean:Q", title="mean value"),
                color=alt.Color("category:N", title="token category"),
                tooltip=["layer", "dim", "category", alt.Tooltip("mean:Q", format=".3f")],
            ).properties(width=260, height=200).facet(column=alt.Column("dim:O", title="outlier dimension"))
            blocks.append((4, ("outlier_dims_by_category",
                               "Outlier dimensions' mean value by token category (after Maruta & Matsuzaki, Fig. 3)", c)))
        top = top_dimension_by_role(con)
        if len(top):
            bars = alt.Chart(top).mark_bar().encode(
                x=alt.X("layer:O", title="layer (0 = embeddings)"), xOffset=alt.XOffset("category:N"),
                y=alt.Y("share:Q", title="share of the role's mean squared norm"),
                color=alt.Color("category:N", title="token role"),
                tooltip=["layer", "category", "dim", alt.Tooltip("mean:Q", format=".3g"),
                         alt.Tooltip("share:Q", format=".3f")])
            labels = bars.mark_text(dy=-5, fontSize=9).encode(text="dim:N")  # the dimension, on its bar
            blocks.append((4.4, ("massive_activations", "Massive activations: per layer and token role, the dimension "
                                 "with the largest |mean| (its number on the bar) and its share of the role's squared "
                                 "norm", (bars + labels).properties(width=640, height=220))))
        blocks.append((4.5, massive_activations_html(con)))
        return blocks


MASSIVE_TOP = 2
"""Dimensions per layer and token role in the report's massive-activations table."""


def top_dimension_by_role(con):
    """(layer, category, dim, mean, share) of the rank-1 dimension of each layer and token role (view
    ``massive_activations``), as a DataFrame: the massive-activations chart's data."""
    return con.execute("""
        SELECT layer, category, dim, mean, share FROM massive_activations
        WHERE scheme = 'role' AND rank = 1 ORDER BY layer, category
    """).df()


def massive_activations_html(con, top: int = MASSIVE_TOP) -> str:
    """The report's section on massive activations: per layer and token role, the ``top`` dimensions by |mean|
    (view ``massive_activations``) with their mean, largest |value| and share of the role's mean squared norm."""
    rows = con.execute(f"""
        SELECT layer, category, rank, dim, mean, max_abs, share FROM massive_activations
        WHERE scheme = 'role' AND rank <= {int(top)} ORDER BY layer, category, rank
    """).fetchall()
    cats = [c for c in SCHEMES["role"] if any(r[1] == c for r in rows)]
    cells: dict = {}
    for layer, cat, _, dim, mean, max_abs, share in rows:
        cells.setdefault(layer, {}).setdefault(cat, []).append(
            f"<b>{dim}</b>: {mean:.3g} (max {max_abs:.3g}, {100 * share:.0f} %)")
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cats)
    body = "".join(f"<tr><td>{layer}</td>" + "".join(f"<td>{'<br>'.join(by.get(c, []))}</td>" for c in cats) + "</tr>"
                   for layer, by in sorted(cells.items()))
    return ("<section id='massive-activations'><h2>Massive activations: per layer and token role, the dimensions "
            f"with the largest |mean| (top {int(top)})</h2>"
            "<p>Each cell: <b>dimension</b>: mean (largest |value|, share of the role's mean squared norm "
            "E[x<sub>j</sub>²] / E[‖x‖²]). A dimension large only on a rare role ([CLS] or BOS: <i>bos</i>) ranks "
            "first there and never in the all-token ranking of Fig. 1.</p>"
            f"<table class='t1 massive'><tr><th>layer</th>{head}</tr>{body}</table>"
            "<p>SQL: <code>SELECT * FROM massive_activations WHERE scheme = 'role' AND category = 'bos' AND rank &lt;= 5"
            "</code></p></section>")


class BatchMoments:
    """One batch's :class:`DimMoments`, built from its hidden states one layer at a time (as the model
    produces them; none is kept).

    ``exact_nonfinite``: look for inf/NaN in each layer and leave those tokens out (a host sync per
    layer). False: assume every value is finite and keep in ``unchecked`` (a device scalar) the sum of
    every value, which is not finite if one was not; :meth:`DimMoments.problems` says so, the caller
    reads that once per batch and recomputes with True if so.
    ``kernel``: with ``exact_nonfinite`` False, each layer's sums and maxima from one Triton kernel
    (:func:`~actlake.analysis.engine.kernels.group_moments`: hidden states read once in their dtype) instead of
    float64 products; ``unchecked`` is then the sum of the valid tokens' values, the ones that count.
    """

    def __init__(self, n_hidden: int, d: int, valid, role, type8, device, exact_nonfinite: bool = True,
                 kernel: bool = False):
        G, L1, dev = len(GROUPS), n_hidden, torch.device(device)
        self.G, self.d, self.dev, self.valid = G, d, dev, valid
        self.exact_nonfinite = exact_nonfinite
        self.kernel = kernel and not exact_nonfinite
        self.host_ids = group_ids(valid, role, type8).reshape(-1, 3)  # (B*T, 3)
        self.nonfinite = torch.zeros(L1, dtype=torch.float64, device=dev)
        if self.kernel:
            self.ids = to_device(torch.cat([self.host_ids, torch.full_like(self.host_ids[:, :1], G)], 1).int(), dev)  # S = 4
            count = to_device(torch.bincount(self.host_ids.flatten(), minlength=G + 1)[:G].double(), dev)  # (G,)
            self.counts = count.expand(L1, G).clone()
            self.acc = torch.empty(L1, 3, G, d, dtype=torch.float64, device=dev)  # (sum, sum of squares, max |x|)
            return
        self.work = GroupSums(self.host_ids, G, d, device=dev)  # shared by the layers
        # every layer's sums and maxima go into one buffer each; the moments follow for all layers at once
        self.sums = torch.zeros(L1, G, 2 * d, dtype=torch.float64, device=dev)
        self.top = torch.zeros(L1, G, d, dtype=torch.float64, device=dev)
        self.counts = [self.work.count] * L1
        self.unchecked = torch.zeros((), dtype=torch.float64, device=dev)

    def add(self, layer: int, h: torch.Tensor) -> None:
        """Hidden state ``layer`` (B, T, d), on any device (with device_map: moved to this one's)."""
        x = h.reshape(-1, self.d).to(self.dev)  # (B*T, d)
        if self.kernel:
            from actlake.analysis.engine import kernels  # imports triton, installed only where kernels run

            kernels.group_moments(x, self.ids, self.G, out=self.acc[layer])
            if layer == self.acc.shape[0] - 1 and ("moments", self.dev) not in kernels._verified:
                self._verify(x)  # the first batch of a process: the float64 products too
            return
        work = self.work
        if not self.exact_nonfinite:  # inf/NaN anywhere makes the running total non-finite
            self.unchecked += x.sum(dtype=torch.float32)
        elif not bool(torch.isfinite(x.sum())):  # inf/NaN somewhere (a sum keeps them): find the tokens
            finite = torch.isfinite(x).all(-1)
            self.nonfinite[layer] = ((~finite) & self.valid.to(self.dev).reshape(-1).bool()).sum()
            work = GroupSums(torch.where(finite[:, None], work.ids, self.G), self.G, self.d, device=self.dev)
            self.counts[layer] = work.count
            x = torch.where(finite[:, None], x, 0)
        work.sums(x, out=self.sums[layer])
        self.top[layer] = work.max_abs(x)  # in x's own dtype (exact), then float64

    def _verify(self, x: torch.Tensor) -> None:
        """The kernel's sums of the last layer against the float64 products (once per process and device)."""
        from actlake.analysis.engine import kernels  # imports triton, installed only where kernels run

        work, acc = GroupSums(self.host_ids, self.G, self.d, device=self.dev), self.acc[-1]
        _, sums, sq = work.sums(x)
        pairs = (("sums", acc[0], sums), ("squares", acc[1], sq), ("max |x|", acc[2], work.max_abs(x)))
        if all([kernels.check_agreement(f"dim_moments, last layer, {name}", got, want.double())
                for name, got, want in pairs]):
            kernels._verified.add(("moments", self.dev))

    def finish(self) -> DimMoments:
        if self.kernel:
            acc = self.acc
            out = DimMoments(Moments.from_sums(self.counts, acc[:, 0], acc[:, 1], acc[:, 2]), self.nonfinite)
            out.unchecked = acc[:, 0].sum()  # inf/NaN in any valid token's value makes it non-finite
            return out
        d = self.d
        out = DimMoments(Moments.from_sums(torch.stack(self.counts), self.sums[..., :d], self.sums[..., d:], self.top),
                         self.nonfinite)
        out.unchecked = self.unchecked if not self.exact_nonfinite else None
        return out



def top_outlier_dims(con, k: int = 3) -> list[int]:
    """The k dimensions with the largest |robust z| in any layer."""
    rows = con.execute(f"""
        SELECT dim FROM outliers WHERE robust_z IS NOT NULL GROUP BY dim ORDER BY max(abs(robust_z)) DESC LIMIT {k}
    """).fetchall()
    return [r[0] for r in rows]
