"""Per (layer, category, dimension) moments of the residual stream (METHODS.md §1).

Layer 0 is the embedding output. Categories: ``all`` plus the ``role`` and
``type8`` schemes. Tokens whose vector holds inf/NaN are counted per layer and
left out of the moments.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch

from actlake.analysis import grid
from actlake.analysis.device import to_device
from actlake.analysis.moments import GroupSums, Moments
from actlake.analysis.protocol import Analysis, OneTable
from actlake.analysis.stats import np64, tensor
from actlake.categories import SCHEMES

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
    reads = frozenset({"hidden_states"})
    tables = ("dim_moments",)
    views = {"outliers": """
        WITH m AS (SELECT layer, dim, mean, count FROM dim_moments WHERE scheme = 'all'),
             s AS (SELECT layer, median(mean) AS med FROM m GROUP BY layer),
             d AS (SELECT layer, median(abs(m.mean - s.med)) AS mad FROM m JOIN s USING (layer) GROUP BY layer)
        SELECT m.layer, m.dim, m.mean, m.count,
               (m.mean - s.med) / nullif(1.4826 * d.mad, 0) AS robust_z,
               row_number() OVER (PARTITION BY m.layer ORDER BY abs(m.mean - s.med) DESC) AS rank
        FROM m JOIN s USING (layer) JOIN d USING (layer)"""}

    moments: Moments
    """Shape (L+1, G, d)."""
    nonfinite: torch.Tensor
    """(L+1,) tokens left out per layer because their vector held inf or NaN."""
    unchecked = None
    """Device scalar from ``from_batch(exact_nonfinite=False)``: the sum of every hidden state, not finite
    when one held an inf/NaN that was not looked for (then these moments are wrong and the batch must be
    redone)."""

    @classmethod
    def create(cls, spec, **options) -> "DimMoments":
        L1, G, d, dev = spec.n_layers + 1, len(GROUPS), spec.d_model, spec.device
        z = lambda *shape: torch.zeros(shape, dtype=torch.float64, device=dev)
        return cls(Moments(z(L1, G), z(L1, G, d), z(L1, G, d), z(L1, G, d)), z(L1))

    def add_hidden(self, hidden_states, batch) -> None:
        part = DimMoments.from_batch(hidden_states, batch.valid, batch.role, batch.type8, exact_nonfinite=batch.strict,
                                     kernel=batch.triton)
        merged = self.merge(part)
        self.moments, self.nonfinite, self.unchecked = merged.moments, merged.nonfinite, part.unchecked

    def problems(self) -> list[torch.Tensor]:
        return [] if self.unchecked is None else [(~torch.isfinite(self.unchecked)).double()]

    @classmethod
    def from_batch(cls, hidden_states, valid, role, type8, exact_nonfinite: bool = True, kernel: bool = False) -> "DimMoments":
        """hidden_states: L+1 tensors (B, T, d) on the model's device; valid/role/type8: (B, T) (the host's).

        ``exact_nonfinite``: look for inf/NaN in each layer and leave those tokens out (a host sync per
        layer). False: assume every value is finite and keep in :attr:`unchecked` (a device scalar) the
        sum of every value, which is not finite if one was not; :meth:`problems` says so, the caller
        reads that once per batch and recomputes with True if so.
        ``kernel``: with ``exact_nonfinite`` False, each layer's sums and maxima from one Triton kernel
        (:func:`~actlake.analysis.kernels.group_moments`: hidden states read once in their dtype) instead of
        float64 products; :attr:`unchecked` is then the sum of the valid tokens' values, the ones that count.
        """
        dev = hidden_states[0].device
        L1, d, G = len(hidden_states), hidden_states[0].shape[-1], len(GROUPS)
        host_ids = group_ids(valid, role, type8).reshape(-1, 3)  # (B*T, 3)
        if kernel and not exact_nonfinite:
            return cls._from_kernel(hidden_states, host_ids, G, d)
        work = GroupSums(host_ids, G, d, device=dev)  # shared by the layers
        ids = work.ids
        # every layer's sums and maxima go into one buffer each; the moments follow for all layers at once
        sums = torch.zeros(L1, G, 2 * d, dtype=torch.float64, device=dev)
        dtype = functools.reduce(torch.promote_types, (h.dtype for h in hidden_states))  # every layer exact in it
        top = torch.zeros(L1, G + 1, d, dtype=dtype, device=dev)
        counts, nonfinite = [work.count] * L1, torch.zeros(L1, dtype=torch.float64, device=dev)
        unchecked = torch.zeros((), dtype=torch.float64, device=dev)
        for layer, h in enumerate(hidden_states):
            x = h.reshape(-1, d).to(dev, top.dtype)  # (B*T, d); with device_map the layer may live elsewhere
            layer_work = work
            if not exact_nonfinite:  # inf/NaN anywhere makes the running total non-finite
                unchecked += x.sum(dtype=torch.float32)
            elif not bool(torch.isfinite(x.sum())):  # inf/NaN somewhere (a sum keeps them): find the tokens
                finite = torch.isfinite(x).all(-1)
                nonfinite[layer] = ((~finite) & valid.to(dev).reshape(-1).bool()).sum()
                layer_work = GroupSums(torch.where(finite[:, None], ids, G), G, d, device=dev)
                counts[layer] = layer_work.count
                x = torch.where(finite[:, None], x, 0)
            layer_work.sums(x, out=sums[layer])
            layer_work.max_abs(x, out=top[layer])
        out = cls(Moments.from_sums(torch.stack(counts), sums[..., :d], sums[..., d:], top[:, :G]), nonfinite)
        out.unchecked = unchecked if not exact_nonfinite else None
        return out

    @classmethod
    def _from_kernel(cls, hidden_states, host_ids: torch.Tensor, G: int, d: int) -> "DimMoments":
        """:meth:`from_batch` without the inf/NaN search, each layer by :func:`~actlake.analysis.kernels.group_moments`."""
        from actlake.analysis import kernels

        dev, L1 = hidden_states[0].device, len(hidden_states)
        ids = to_device(torch.cat([host_ids, torch.full_like(host_ids[:, :1], G)], 1).int(), dev)  # S = 4 for tl.arange
        count = to_device(torch.bincount(host_ids.flatten(), minlength=G + 1)[:G].double(), dev)  # (G,)
        acc = torch.empty(L1, 3, G, d, dtype=torch.float64, device=dev)  # (sum, sum of squares, max |x|) per layer
        for layer, h in enumerate(hidden_states):
            kernels.group_moments(h.reshape(-1, d).to(dev), ids, G, out=acc[layer])  # device_map: to the first device
        if ("moments", dev) not in kernels._verified:  # the first batch of a process: the float64 products too
            x = hidden_states[-1].reshape(-1, d).to(dev)
            work = GroupSums(host_ids, G, d, device=dev)
            _, sums, sq = work.sums(x)
            pairs = (("sums", acc[-1, 0], sums), ("squares", acc[-1, 1], sq), ("max |x|", acc[-1, 2], work.max_abs(x)))
            if all([kernels.check_agreement(f"dim_moments, last layer, {name}", got, want.double())
                    for name, got, want in pairs]):
                kernels._verified.add(("moments", dev))
        out = cls(Moments.from_sums(count.expand(L1, G).clone(), acc[:, 0], acc[:, 1], acc[:, 2]),
                  torch.zeros(L1, dtype=torch.float64, device=dev))
        out.unchecked = acc[:, 0].sum()  # inf/NaN in any valid token's value makes it non-finite
        return out

    def merge(self, other: "DimMoments") -> "DimMoments":
        return DimMoments(self.moments.merge(other.moments), self.nonfinite + other.nonfinite.to(self.nonfinite.device))

    def axes(self) -> list:
        L1, G, d = self.moments.mean.shape
        return [("layer", L1), ("group", G), ("dim", d)]

    def to_arrow(self) -> pa.Table:
        m = self.moments
        t = grid.to_arrow(self.axes(), {"count": np64(m.count), "mean": np64(m.mean), "m2": np64(m.m2),
                                        "max_abs": np64(m.max_abs), "nonfinite_tokens": np64(self.nonfinite)})
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
        return cls(Moments(*(tensor(v[k]) for k in ("count", "mean", "m2", "max_abs"))), tensor(v["nonfinite_tokens"]))


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
        blocks = [(1, ("dim_means", "Fig. 1 (seed 001): per-dimension mean of the residual stream by layer, outliers marked",
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
                               "Fig. 3 (seed 001): outlier dimensions' mean value by token category", c)))
        return blocks


def top_outlier_dims(con, k: int = 3) -> list[int]:
    """The k dimensions with the largest |robust z| in any layer."""
    rows = con.execute(f"""
        SELECT dim FROM outliers WHERE robust_z IS NOT NULL GROUP BY dim ORDER BY max(abs(robust_z)) DESC LIMIT {k}
    """).fetchall()
    return [r[0] for r in rows]
