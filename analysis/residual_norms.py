"""The ``residual_norms`` table: per-token, per-layer residual-stream norms ||h_t^l|| (METHODS.md §1)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import torch

from actlake.analysis.engine.device import to_host
from actlake.analysis.protocol import BatchOutputs, Headline, HiddenBatch, ShardTable, TableDoc


def add_norms(out: torch.Tensor | None, layer: int, h: torch.Tensor, n_hidden: int) -> torch.Tensor:
    """Write hidden state ``layer``'s (B, T, d) norms into ``out`` (B, T, n_hidden) float64, allocated on
    h's device at the first call (``out`` None); returns ``out``. With device_map the layers may live on
    several devices: each layer's norms move to ``out``'s."""
    if out is None:
        out = torch.empty(*h.shape[:-1], n_hidden, dtype=torch.float64, device=h.device)
    out[..., layer] = torch.linalg.vector_norm(h, dim=-1, dtype=torch.float64).to(out.device)
    return out


class ResidualNorms(ShardTable):
    """Norms of every hidden state into one (B, T, L+1) float64 device buffer per batch, copied to the host
    without blocking after the last layer; rows of the real tokens at :meth:`collect`."""

    name = "residual_norms"
    about = 'The `residual_norms` table: one row per token and hidden state.'
    sites = frozenset({"hidden_states"})
    tables = ("residual_norms",)
    schema = pa.schema([("doc_id", pa.int64()), ("window_index", pa.int32()), ("position", pa.int32()),
                        ("layer", pa.int16()), ("norm", pa.float64())])
    table_docs = {"residual_norms": TableDoc("token × layer", {
        "doc_id": "", "window_index": "", "position": "", "layer": "",
        "norm": "L2 norm of the residual stream, model units"})}
    headlines = (Headline(
        "residual_norms", "residual_norms", "Residual-stream norm by layer (mean)", "mean ||h||",
        "SELECT {series} AS series, layer, avg(norm) AS value FROM residual_norms GROUP BY ALL ORDER BY ALL",
        source_sql="SELECT d.source AS series, r.layer, avg(r.norm) AS value FROM residual_norms r JOIN documents d "
                   "USING (doc_id) GROUP BY ALL ORDER BY ALL", position=1),)

    @classmethod
    def charts(cls, con) -> list:
        """Median and 10th-90th percentile band of the norms by layer, over finite norms (DuckDB orders NaN above
        every number, which would move every percentile)."""
        import altair as alt

        df = con.execute("""
            SELECT layer, avg(norm) AS mean, quantile_cont(norm, 0.1) AS p10, quantile_cont(norm, 0.5) AS median,
                   quantile_cont(norm, 0.9) AS p90 FROM residual_norms WHERE isfinite(norm) GROUP BY layer ORDER BY layer
        """).df()
        base = alt.Chart(df).encode(x=alt.X("layer:O", title="layer (0 = embeddings)"))
        c = (base.mark_area(opacity=0.25).encode(y=alt.Y("p10:Q", title="||h|| (10th-90th percentile band)"), y2="p90:Q")
             + base.mark_line(point=True).encode(y="median:Q", tooltip=["layer", alt.Tooltip("median:Q", format=".2f"),
                                                                         alt.Tooltip("mean:Q", format=".2f")])
             ).properties(width=420, height=260)
        return [(3, ("residual_norms", "Residual-stream norm by layer (median, 10th-90th percentile)", c))]

    norms = None  # (B, T, L+1) on the device while the batch runs, then the host's copy

    def add_hidden(self, layer: int, h: torch.Tensor, batch: HiddenBatch) -> None:
        n_hidden = self.spec.n_layers + 1
        self.norms = add_norms(self.norms, layer, h, n_hidden)
        if layer == n_hidden - 1:
            self.norms = to_host(self.norms)

    def collect(self, out: BatchOutputs) -> None:
        doc_id, window, position, _ = out.token_keys()
        self.keys = np.stack([doc_id, window, position], 1)  # (n, 3)
        self.values = self.norms.numpy()[out.mask.bool().numpy()]  # (n, L+1)

    @classmethod
    def to_table(cls, parts: list["ResidualNorms"], **options) -> pa.Table:
        if not parts:
            return cls.schema.empty_table()
        keys = np.concatenate([p.keys for p in parts])  # (N, 3)
        norms = np.concatenate([p.values for p in parts])  # (N, L+1)
        L1 = norms.shape[1]
        return pa.table({
            "doc_id": pa.array(np.repeat(keys[:, 0], L1), pa.int64()),
            "window_index": pa.array(np.repeat(keys[:, 1], L1), pa.int32()),
            "position": pa.array(np.repeat(keys[:, 2], L1), pa.int32()),
            "layer": pa.array(np.tile(np.arange(L1), len(keys)), pa.int16()),
            "norm": pa.array(norms.ravel(), pa.float64()),
        }, schema=cls.schema)
