"""Every analysis's statistics per corpus subset: one accumulator per document source label.

With ``analyses.by_source`` a worker batches each source's windows apart (one label per batch,
:func:`~actlake.batching.make_batches`), so a batch's statistics belong to one label and any analysis,
built-in or custom, is split by source without knowing it: :class:`BySource` keeps ``{label: Analysis}``
and merges label by label. Every statistics table (partials and reduced) has a leading ``source`` column:
the label, or ``'*'`` (:data:`~actlake.tables.ALL_SOURCES`) without ``by_source``; the reduced tables of a
``by_source`` run also hold the rows ``source = '*'``, every label merged: a run without it (whose batches
differ, so up to the rounding of the model's dtype). ``actlake sql`` shows a reduced table or view by its
name with the ``'*'`` rows only, and every label's under ``<name>_by_source`` (:mod:`~actlake.storage.sql`).
"""

from __future__ import annotations

from functools import reduce

import pyarrow as pa
import pyarrow.compute as pc

from actlake.errors import ConfigError
from actlake.tables import ALL_SOURCES as ALL
from actlake.tables import CLEAN, INTERVENTION, SOURCE


class BySource:
    """One analysis's statistics by source label (and, with ``interventions:``, by pass: ``parts`` is keyed by
    (intervention, source)). ``split``: labels are the documents' sources (else every batch is :data:`ALL`);
    ``max_sources``: more labels than this is a ConfigError naming the key; ``interventions``: the tables get a
    leading ``intervention`` column (:data:`~actlake.tables.CLEAN` for the clean pass)."""

    def __init__(self, zero, split: bool = False, max_sources: int | None = None, parts: dict | None = None,
                 interventions: bool = False):
        self.zero, self.split, self.max_sources = zero, split, max_sources  # zero: the empty statistics (schema)
        self.interventions = interventions and not getattr(zero, "labels_interventions", False)
        self.parts = ({(k if isinstance(k, tuple) else (CLEAN, k)): v for k, v in parts.items()}  # a source label
                      if parts is not None else ({} if split else {(CLEAN, ALL): zero}))  # alone: the clean pass's
        if any(src != ALL for _, src in self.parts):  # a split run's ALL part is an empty shard's zero statistics
            self.parts = {k: v for k, v in self.parts.items() if k[1] != ALL}

    @property
    def name(self) -> str:
        return self.zero.name

    def label_of(self, windows) -> str:
        """The label of a batch (its windows share one source when ``split``)."""
        if not self.split:
            return ALL
        label = windows[0].source
        if label == ALL:
            raise ConfigError(f"analyses.by_source: a document's source label is {ALL!r}, which names the rows over "
                              f"every document; relabel it (corpus.source_field)")
        return label

    def add(self, label: str, stats, intervention: str = CLEAN) -> None:
        """Merge one batch's statistics (of source ``label``, under ``intervention``) in."""
        key = (intervention, label)
        self.parts[key] = self.parts[key].merge(stats) if key in self.parts else stats
        self._check()

    def merge(self, other: BySource) -> BySource:
        parts = dict(self.parts)
        for key, stats in other.parts.items():
            parts[key] = parts[key].merge(stats) if key in parts else stats
        out = BySource(self.zero, self.split or other.split, self.max_sources or other.max_sources, parts,
                       self.interventions or other.interventions)
        out._check()
        return out

    def _check(self) -> None:
        check_labels({src for _, src in self.parts}, self.max_sources)

    def total(self, intervention: str = CLEAN):
        """Every label of one pass merged (in label order)."""
        parts = [self.parts[k] for k in sorted(self.parts) if k[0] == intervention]
        return reduce(lambda a, b: a.merge(b), parts) if parts else self.zero

    def to_tables(self, with_total: bool = False) -> dict:
        """``{table: pyarrow.Table}`` with a leading ``source`` column (and before it ``intervention``, with
        interventions); ``with_total`` (the reduced tables) adds the :data:`ALL` rows when the labels are sources."""
        labelled = sorted(self.parts.items())
        if with_total and any(src != ALL for _, src in self.parts):
            labelled += [((iv, ALL), self.total(iv)) for iv in sorted({iv for iv, _ in self.parts})]
        if not labelled:  # no batch yet: zero statistics, as without by_source
            labelled = [((CLEAN, ALL), self.zero)]
        out: dict = {}
        for (iv, label), stats in labelled:
            own = (INTERVENTION,) if getattr(self.zero, "labels_interventions", False) else ()
            for t, data in stats.to_tables().items():
                for column in (c for c in (SOURCE, INTERVENTION) if c not in own):
                    if column in data.column_names:
                        raise ConfigError(f"analyses: {self.name!r} writes a column {column!r} in its table {t!r}; "
                                          f"every statistics table gets that column from the engine: rename it")
                data = _labelled(data, SOURCE, label)
                out.setdefault(t, []).append(_labelled(data, INTERVENTION, iv) if self.interventions else data)
        return {t: pa.concat_tables(parts) for t, parts in out.items()}

    @classmethod
    def from_tables(cls, analysis, tables: dict) -> BySource:
        """The inverse of :meth:`to_tables` for ``analysis`` (a class): its statistics per label, the
        :data:`ALL` rows of a reduced table left out where labelled rows sum to them."""
        first = tables[analysis.tables[0]]
        interventions = INTERVENTION in first.column_names and not getattr(analysis, "labels_interventions", False)
        keys = _keys(first, interventions)
        split = any(src != ALL for _, src in keys)
        if split:
            keys = [k for k in keys if k[1] != ALL]
        parts = {key: analysis.from_tables({t: _of(data, key, interventions) for t, data in tables.items()})
                 for key in keys or [(CLEAN, ALL)]}
        return cls(next(iter(parts.values())), split, None, parts, interventions)


def check_labels(labels, max_sources: int | None) -> None:
    """ConfigError naming ``analyses.max_sources`` when ``labels`` are more than it allows."""
    if max_sources is not None and len(labels) > max_sources:
        shown = ", ".join(sorted(labels)[:8]) + (", ..." if len(labels) > 8 else "")
        raise ConfigError(f"analyses.max_sources: the corpus has at least {len(labels)} source labels "
                          f"({shown}), more than analyses.max_sources = {max_sources}; raise it (memory "
                          f"and partials grow with it) or set analyses.by_source: false")


def _labelled(data: pa.Table, column: str, label: str) -> pa.Table:
    return data.add_column(0, column, pa.array([label] * data.num_rows, pa.string()))


def _keys(data: pa.Table, interventions: bool) -> list[tuple[str, str]]:
    """The (intervention, source) labels of a table's rows, in order of appearance."""
    sources = data.column(SOURCE).to_pylist() if SOURCE in data.column_names else [ALL] * data.num_rows
    ivs = data.column(INTERVENTION).to_pylist() if interventions else [CLEAN] * data.num_rows
    return list(dict.fromkeys(zip(ivs, sources)))


def _of(data: pa.Table, key: tuple[str, str], interventions: bool) -> pa.Table:
    """One label's rows, without the label columns (a table without rows: all of it)."""
    labels = [c for c in (SOURCE, INTERVENTION) if c in data.column_names and (c == SOURCE or interventions)]
    if data.num_rows == 0:
        return data.drop_columns(labels)
    rows = pc.equal(data.column(SOURCE), key[1]) if SOURCE in data.column_names else None
    if interventions:
        by_pass = pc.equal(data.column(INTERVENTION), key[0])
        rows = by_pass if rows is None else pc.and_(rows, by_pass)
    return (data if rows is None else data.filter(rows)).drop_columns(labels)
