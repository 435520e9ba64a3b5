"""Each intervention's effect, paired by document, with a 95 % confidence interval (issue 51, METHODS.md §8).

Every batch runs clean and under each intervention (``interventions:``); each pass sums, per window, the attention
mass each key role takes per layer and head (and its mean over heads: head -1), the residual norm per hidden state, and for causal LMs the surprisal and
the KL divergence of the edited next-token distributions from the clean ones
(:mod:`~actlake.analysis.engine.window_summary`). At the end of a shard each document's mean of each quantity is
formed per pass (its windows' sums over their counts), and the paired difference d = edited - clean is added to a
count / mean / sum of squared deviations per (intervention, quantity, layer, head, key category), merged across
shards with Chan et al.'s update, so the reduced table is exact whatever the sharding.

The interval is Student's t over documents: mean(d) ± t_{0.975, n-1} · sd(d) / √n (the documents are the units;
windows of one document are averaged first, so a long document is one observation, not many).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from actlake.analysis.engine.window_summary import KL, MASS, NORM, SURPRISAL, cells
from actlake.analysis.protocol import Analysis, OneTable, TableDoc
from actlake.tables import EFFECTS, INTERVENTION

KEYS = ("quantity", "layer", "head", "key_category")


@dataclass
class InterventionEffects(OneTable, Analysis):
    name = "intervention_effects"
    about = ("Each intervention's paired effect per document on attention mass by key role, residual norm, "
             "surprisal and KL, with 95 % t intervals: `intervention_effects`.")
    tables = (EFFECTS,)
    table_docs = {EFFECTS: TableDoc(
        "intervention × quantity × layer × head × key category (reduced; with `interventions:`)", {
            "intervention": "", "quantity": "`attention_mass`, `residual_norm`, `surprisal`, `kl_divergence`",
            "layer": "−1: none", "head": "−1: the mean over heads, or none", "key_category": "mass only",
            "n_docs": "documents with the quantity in both passes", "clean_mean": "",
            "edited_mean": "means over documents of each document's mean",
            "diff_mean": "mean of the paired differences edited − clean", "ci_low": "",
            "ci_high": "95 % Student-t interval of it over documents, METHODS.md §8", "clean_sum": "", "edited_sum": "",
            "diff_m2": "the mergeable sums"})}
    labels_interventions = True
    """Its rows name the intervention they are about: the engine adds no ``intervention`` column of passes."""

    names: tuple[str, ...]
    cells: tuple[tuple, ...]
    """(quantity, layer, head, key_category) per column (:func:`~actlake.analysis.engine.window_summary.cells`)."""
    n: np.ndarray
    """(I, K) documents with the quantity in both passes."""
    clean: np.ndarray
    """(I, K) sum over those documents of the clean pass's per-document mean."""
    edited: np.ndarray
    """(I, K) the same for the edited pass."""
    mean: np.ndarray
    """(I, K) mean over documents of d = edited - clean."""
    m2: np.ndarray
    """(I, K) sum of squared deviations of d from its mean."""

    @classmethod
    def empty(cls, names, cell_list) -> InterventionEffects:
        z = np.zeros((len(names), len(cell_list)))
        return cls(tuple(names), tuple(map(tuple, cell_list)), z, z.copy(), z.copy(), z.copy(), z.copy())

    @classmethod
    def create(cls, spec, causal: bool = False, names: tuple = ()) -> InterventionEffects:
        return cls.empty(names, cells(tuple(spec.attention_layers), spec.n_heads, spec.n_layers + 1, causal))

    def add_documents(self, i: int, clean: np.ndarray, edited: np.ndarray) -> InterventionEffects:
        """Intervention ``i``'s per-document means (D, K) of both passes (NaN where a document has none) merged in."""
        ok = np.isfinite(clean) & np.isfinite(edited)
        d = np.where(ok, edited - clean, 0.0)
        n = ok.sum(0).astype(float)
        mean = np.divide(d.sum(0), n, out=np.zeros_like(n), where=n > 0)
        m2 = (np.where(ok, d - mean, 0.0) ** 2).sum(0)
        part = InterventionEffects.empty(self.names, self.cells)
        part.n[i], part.clean[i], part.edited[i] = n, np.where(ok, clean, 0).sum(0), np.where(ok, edited, 0).sum(0)
        part.mean[i], part.m2[i] = mean, m2
        return self.merge(part)

    def merge(self, other: InterventionEffects) -> InterventionEffects:
        if (self.names, self.cells) != (other.names, other.cells):
            raise ValueError("intervention_effects: merging the effects of different interventions or models")
        n = self.n + other.n
        delta = other.mean - self.mean
        w = np.divide(other.n, n, out=np.zeros_like(n), where=n > 0)
        mean = self.mean + delta * w
        m2 = self.m2 + other.m2 + delta ** 2 * self.n * w
        return InterventionEffects(self.names, self.cells, n, self.clean + other.clean, self.edited + other.edited,
                                   mean, m2)

    # its own pair, not AXES/COLUMNS: rows are (intervention, cell) pairs, not a grid, and the interval columns are
    # derived from the merged sums, not stored ones
    def to_arrow(self) -> pa.Table:
        from scipy import stats

        I, K = self.n.shape
        n = self.n.reshape(-1)
        with np.errstate(invalid="ignore", divide="ignore"):
            half = stats.t.ppf(0.975, n - 1) * np.sqrt(self.m2.reshape(-1) / (n - 1) / n)
        half = np.where(n >= 2, half, np.nan)
        cols = list(zip(*self.cells)) if K else [(), (), (), ()]
        data = {INTERVENTION: np.repeat(np.array(self.names, dtype=object), K).tolist()}
        for name, values, kind in zip(KEYS, cols, (pa.string(), pa.int32(), pa.int32(), pa.string())):
            data[name] = pa.array(list(values) * I, kind)
        mean = self.mean.reshape(-1)
        with np.errstate(invalid="ignore", divide="ignore"):
            derived = {"clean_mean": self.clean.reshape(-1) / n, "edited_mean": self.edited.reshape(-1) / n}
        data |= {"n_docs": n, "clean_sum": self.clean.reshape(-1), "edited_sum": self.edited.reshape(-1),
                 "diff_mean": mean, "diff_m2": self.m2.reshape(-1), **derived,
                 "ci_low": mean - half, "ci_high": mean + half}
        return pa.table(data)

    @classmethod
    def from_arrow(cls, t: pa.Table) -> InterventionEffects:
        names = tuple(dict.fromkeys(t[INTERVENTION].to_pylist()))
        rows = list(zip(*(t[k].to_pylist() for k in KEYS)))
        K = len(rows) // max(len(names), 1)
        shape = (len(names), K)
        get = lambda c: t[c].to_numpy().astype(float).reshape(shape)
        return cls(names, tuple(rows[:K]), get("n_docs"), get("clean_sum"), get("edited_sum"), get("diff_mean"),
                   get("diff_m2"))

    @classmethod
    def charts(cls, con) -> list:
        import altair as alt

        df = con.execute(f"""
            SELECT intervention, layer, head, diff_mean, ci_low, ci_high, n_docs FROM intervention_effects
            WHERE quantity = '{MASS}' AND key_category = 'bos' AND head >= 0 AND n_docs > 0 ORDER BY ALL""").df()
        blocks = []
        if len(df):
            base = alt.Chart(df).encode(x=alt.X("layer:O", title="layer"), xOffset="head:N",
                                        color=alt.Color("intervention:N"))
            c = (base.mark_errorbar().encode(y=alt.Y("ci_low:Q", title="change in mass on the first token"),
                                              y2="ci_high:Q")
                 + base.mark_point(filled=True, size=18).encode(
                     y="diff_mean:Q", tooltip=["intervention", "layer", "head", alt.Tooltip("diff_mean:Q", format=".4f"),
                                               alt.Tooltip("ci_low:Q", format=".4f"),
                                               alt.Tooltip("ci_high:Q", format=".4f"), "n_docs"])
                 ).properties(width=520, height=240)
            blocks.append((8, ("intervention_mass", "Each intervention's change in attention mass on the first token "
                                                    "per layer and head (edited - clean, mean over documents, 95 % "
                                                    "t interval)", c)))
        df = con.execute(f"""
            SELECT intervention, quantity, layer, diff_mean, ci_low, ci_high FROM intervention_effects
            WHERE quantity IN ('{NORM}', '{SURPRISAL}', '{KL}') AND n_docs > 0 ORDER BY ALL""").df()
        if len(df):
            base = alt.Chart(df).encode(x=alt.X("layer:O", title="hidden state (-1: the model's output)"),
                                        color=alt.Color("intervention:N"))
            c = (base.mark_errorbar().encode(y=alt.Y("ci_low:Q", title="edited - clean"), y2="ci_high:Q")
                 + base.mark_point(filled=True).encode(y="diff_mean:Q")).properties(width=300, height=200).facet(
                column=alt.Column("quantity:N", title=None)).resolve_scale(y="independent")
            blocks.append((8.5, ("intervention_norms", "Each intervention's change in residual norm, surprisal and KL "
                                                       "(mean over documents, 95 % t interval)", c)))
        return blocks
