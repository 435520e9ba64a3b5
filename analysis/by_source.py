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
from actlake.tables import SOURCE


class BySource:
    """One analysis's statistics by source label. ``split``: labels are the documents' sources (else every
    batch is :data:`ALL`); ``max_sources``: more labels than this is a ConfigError naming the key."""

    def __init__(self, zero, split: bool = False, max_sources: int | None = None, parts: dict | None = None):
        self.zero, self.split, self.max_sources = zero, split, max_sources  # zero: the empty statistics (schema)
        self.parts = dict(parts) if parts is not None else ({} if split else {ALL: zero})
        if any(k != ALL for k in self.parts):  # a split run's ALL part is an empty shard's zero statistics
            self.parts.pop(ALL, None)

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

    def add(self, label: str, stats) -> None:
        """Merge one batch's statistics (of source ``label``) in."""
        self.parts[label] = self.parts[label].merge(stats) if label in self.parts else stats
        self._check()

    def merge(self, other: BySource) -> BySource:
        parts = dict(self.parts)
        for label, stats in other.parts.items():
            parts[label] = parts[label].merge(stats) if label in parts else stats
        out = BySource(self.zero, self.split or other.split, self.max_sources or other.max_sources, parts)
        out._check()
        return out

    def _check(self) -> None:
        check_labels(self.parts, self.max_sources)

    def total(self):
        """Every label merged (in label order)."""
        parts = [self.parts[k] for k in sorted(self.parts)]
        return reduce(lambda a, b: a.merge(b), parts) if parts else self.zero

    def to_tables(self, with_total: bool = False) -> dict:
        """``{table: pyarrow.Table}`` with a leading ``source`` column; ``with_total`` (the reduced tables) adds
        the :data:`ALL` rows when the labels are sources."""
        labelled = sorted(self.parts.items())
        if with_total and any(k != ALL for k in self.parts):
            labelled.append((ALL, self.total()))
        if not labelled:  # no batch yet: zero statistics, as without by_source
            labelled = [(ALL, self.zero)]
        out: dict = {}
        for label, stats in labelled:
            for t, data in stats.to_tables().items():
                if SOURCE in data.column_names:
                    raise ConfigError(f"analyses: {self.name!r} writes a column {SOURCE!r} in its table {t!r}; every "
                                      f"statistics table gets that column from the engine (its source label): rename it")
                out.setdefault(t, []).append(_labelled(data, label))
        return {t: pa.concat_tables(parts) for t, parts in out.items()}

    @classmethod
    def from_tables(cls, analysis, tables: dict) -> BySource:
        """The inverse of :meth:`to_tables` for ``analysis`` (a class): its statistics per label, the
        :data:`ALL` rows of a reduced table left out where labelled rows sum to them."""
        first = tables[analysis.tables[0]]
        labels = pc.unique(first.column(SOURCE)).to_pylist() if SOURCE in first.column_names else [ALL]
        if len(labels) > 1:
            labels = [x for x in labels if x != ALL]
        parts = {label: analysis.from_tables({t: _of(data, label) for t, data in tables.items()})
                 for label in labels or [ALL]}
        return cls(next(iter(parts.values())), labels not in ([], [ALL]), None, parts)


def check_labels(labels, max_sources: int | None) -> None:
    """ConfigError naming ``analyses.max_sources`` when ``labels`` are more than it allows."""
    if max_sources is not None and len(labels) > max_sources:
        shown = ", ".join(sorted(labels)[:8]) + (", ..." if len(labels) > 8 else "")
        raise ConfigError(f"analyses.max_sources: the corpus has at least {len(labels)} source labels "
                          f"({shown}), more than analyses.max_sources = {max_sources}; raise it (memory "
                          f"and partials grow with it) or set analyses.by_source: false")


def _labelled(data: pa.Table, label: str) -> pa.Table:
    return data.add_column(0, SOURCE, pa.array([label] * data.num_rows, pa.string()))


def _of(data: pa.Table, label: str) -> pa.Table:
    """One label's rows, without the source column (a table without rows: all of it)."""
    if data.num_rows == 0:
        return data.drop_columns([SOURCE])
    return data.filter(pc.equal(data.column(SOURCE), label)).drop_columns([SOURCE])
