"""The protocol every table of a job is made through: what it reads, how a batch updates it, its tables.

Two kinds of producer share it (:class:`Producer`):

- an :class:`Analysis` holds mergeable statistics (float64 sums on the model's device). Each shard's
  statistics are committed in its commit group as ``<table>_partial`` rows; the reduce step merges every
  group's (``merge`` is associative) into the reduced ``<table>``. It may declare SQL views and report charts.
  Its tables get a leading ``source`` column from the engine (``analyses.by_source``,
  :mod:`~actlake.analysis.by_source`): one instance per document source label, ``'*'`` for every document.
- a :class:`ShardTable` writes rows per token, window or document (``per_token``) with each shard and is
  never reduced: ``tokens``, ``residual_norms``, ``activations``, ``documents``, ``rejects``.

A third kind, built in only, gives values per token that the others read and writes no table of its own
(:class:`TokenValues`: ``surprisal``, the ``tokens`` and ``activations`` tables' column and the interventions'
effect on it).

A producer reads from *sites* (:data:`Site`): each layer's attention (a
:class:`~actlake.analysis.engine.layer_qk.LayerQK`: q and k as the kernel receives them, the batch's masks
and categories), that layer's key-projection input x and RoPE angles, the hidden states of every layer, or
the final hidden state with the LM head that turns it into next-token logits;
an analysis may also read *products* of the attention weights (:data:`Product`), computed once per layer
for every analysis that wants them (:mod:`~actlake.analysis.engine.attention_weights`). Device work
(:meth:`Producer.add_layer`, :meth:`Producer.add_hidden`, :meth:`Producer.add_logits`) reads nothing back to the host.

Extraction, the reduce step, the SQL views and the report loop over the enabled producers
(:mod:`~actlake.analysis.registry`). A particular one is named only by a producer that reads its output (``tokens``
reads :class:`~actlake.analysis.token_surprisal.Surprisal`'s values, ``contributions``' charts ``dim_moments``'
outlier dimensions) and by the extraction driver, which makes ``intervention_effects`` from the passes' per-window
sums (the ``interventions`` section's table, not an ``analyses`` entry).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from operator import attrgetter
from typing import ClassVar, Literal, get_args

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from pydantic import BaseModel, ConfigDict

from actlake.analysis.engine import grid
from actlake.analysis.engine.batch import BatchOutputs, HiddenBatch, LogitsBatch, ModelSpec  # noqa: F401 - protocol
from actlake.analysis.engine.grid import Column  # noqa: F401 - part of the protocol
from actlake.deprecation import deprecated

Site = Literal["attention", "layer_inputs", "hidden_states", "logits"]
"""Where a producer reads. ``attention``: :meth:`Producer.add_layer` is called with each layer's LayerQK.
``layer_inputs``: that LayerQK also carries x, W_K, b_K and RoPE angles. ``hidden_states``:
:meth:`Producer.add_hidden` is called with each hidden state of a batch as the model produces it,
layer 0 to n_layers in order (none is kept after its call). ``logits``: :meth:`Producer.add_logits` is called
once per pass, after the model returns, with its final hidden state and LM head (a model loaded with its head:
a causal LM, ``analyses.surprisal`` not false)."""
Product = Literal["mass", "mass_keynorm", "weighted_qsum", "distance"]
"""Products of a layer's attention weights, computed before ``add_layer`` and read with ``lq.product(name)``
(METHODS.md §2-4; :mod:`~actlake.analysis.engine.attention_weights`)."""
SITES: frozenset = frozenset(get_args(Site))
PRODUCTS: frozenset = frozenset(get_args(Product))


class NoOptions(BaseModel):
    """A producer's options (``analyses.<name>: {option: value}``): a pydantic model whose fields are the keyword
    arguments of its :meth:`Producer.create`, each with its default and a docstring (the config reference shows them)."""

    model_config = ConfigDict(extra="forbid", strict=True, use_attribute_docstrings=True)


@dataclass(frozen=True)
class Headline:
    """One number per layer that the report draws for runs side by side (a line per run), a checkpoint sweep
    (a line per layer against the step) and ``analyses.by_source`` (a line per source label).

    ``sql`` reads table or view ``over`` and gives columns ``series``, ``layer``, ``value`` (and any more for
    the tooltip) with three placeholders: ``{series}`` the column that tells the lines apart (``run``,
    ``checkpoint``), ``{by}`` the suffix of ``over`` (``_by_source`` for the rows per source), ``{rows}`` a
    condition ending in AND (the rows per source label). ``source_sql``: its own SELECT for the lines per source,
    where ``sql`` cannot give them (a shard table has no ``source`` column). ``position`` orders the charts."""

    over: str
    slug: str
    title: str
    y_title: str
    sql: str
    source_sql: str | None = None
    position: float = 0.0


@dataclass(frozen=True)
class TableDoc:
    """What one table a producer writes holds: its row of docs/sql-schema.md (``scripts/sync_docs.py`` renders
    the built-ins'; a test checks the columns against the table's Arrow schema).

    ``rows``: what one row is ("token × layer"); ``columns``: every column of the table, in the order shown, each
    with its meaning and units ("" where the name says it; a run of such columns shares the next one's meaning);
    ``intro`` is shown before the columns, ``note`` after them. A shard table's ``shard`` column is storage's."""

    rows: str
    columns: dict[str, str]
    intro: str = ""
    note: str = ""


class Producer(ABC):
    """What every producer declares (see the module docstring); the hooks it does not use keep their defaults."""

    def __init_subclass__(cls, **kwargs):
        """0.1.0's ``reads`` (sites and products in one set) still works, with a deprecation warning: it is split
        into :attr:`sites` and :attr:`products` (a name in neither stays in ``sites``, where the check names it)."""
        super().__init_subclass__(**kwargs)
        if "reads" in cls.__dict__:
            reads = frozenset(cls.__dict__["reads"])
            cls.sites, cls.products = reads - PRODUCTS, reads & PRODUCTS
            deprecated(f"{cls.__qualname__}.reads is deprecated: declare sites = {set(cls.sites) or 'frozenset()'} "
                       f"and products = {set(cls.products) or 'frozenset()'}; reads goes in the release after 0.2.0")

    name: ClassVar[str] = ""
    """Name in configs, logs and errors."""
    sites: ClassVar[frozenset] = frozenset()
    """Subset of :data:`SITES`."""
    products: ClassVar[frozenset] = frozenset()
    """Subset of :data:`PRODUCTS` (read with ``lq.product(name)``; needs ``attention`` in :attr:`sites`)."""
    tables: ClassVar[tuple[str, ...]] = ()
    """The tables it writes."""
    table_docs: ClassVar[dict[str, TableDoc]] = {}
    """What each of its tables holds (:class:`TableDoc`), by table name: a built-in's rows of docs/sql-schema.md."""
    per_token: ClassVar[bool] = False
    """True for a :class:`ShardTable` (rows written per shard, never reduced)."""
    graph_safe: ClassVar[bool] = False
    """:meth:`add_layer` may be recorded at one layer of a batch and replayed at the others
    (``analyses.layer_graphs``, :mod:`~actlake.analysis.engine.layer_replay`): it reads only ``lq`` and what
    is the same for the whole batch, reads nothing back from the device and copies nothing from the host,
    keeps no Python state per layer, and writes only its tensor fields, each at ``[lq.layer]`` on its
    first dimension. :meth:`layer_scratch` must then work (it does for :class:`~actlake.analysis.stats.SumStats`)."""

    Options: ClassVar[type[BaseModel]] = NoOptions
    """Its options, a subclass of :class:`NoOptions`; the job validates ``analyses.<name>`` against it before Ray."""
    about: ClassVar[str] = ""
    """What it writes, in a sentence (the configuration reference shows it)."""
    default_on: ClassVar[bool] = True
    """A built-in producer runs unless the config sets ``analyses.<name>: false`` (False: only when it is set)."""
    headlines: ClassVar[tuple[Headline, ...]] = ()
    """Its headline statistics (:class:`Headline`), drawn by the report where runs, checkpoints or sources are compared."""
    nonfinite_layer: ClassVar[str | None] = None
    """When its table has a ``nonfinite_tokens`` column per ``layer``: what a layer is ("hidden state"); the
    report's summary lists the tokens left out."""

    @classmethod
    def charts(cls, con) -> list[tuple[float, object]]:
        """Report blocks as (position, block): a block is (slug, title, Altair chart) or an HTML string;
        ``con`` is the run's read-only DuckDB connection. Positions order the report's sections."""
        return []

    @classmethod
    def plan_note(cls, cfg, n_records: int | None) -> str | None:
        """A line the job prints before it hands out shards (the activation store: its size), or None;
        ``n_records``: the corpus records about to run (None: not counted, a streamed dataset)."""
        return None

    @classmethod
    def run_notes(cls, con) -> list[str]:
        """Warnings the job logs about its finished run, read from the run's views (``con``, as for :meth:`charts`)."""
        return []

    @classmethod
    def options_from(cls, cfg) -> dict:
        """Keyword arguments of :meth:`create` from the job's config (a :class:`~actlake.config.JobConfig`): its
        ``analyses.<name>`` mapping through :attr:`Options` (:func:`~actlake.analysis.registry.options_of` names a bad
        one before Ray); a custom producer gets its ``analyses.custom[].args`` instead."""
        entry = cfg.analyses.entry(cls.name)
        return cls.Options(**(entry if isinstance(entry, dict) else {})).model_dump()

    @classmethod
    def products_for(cls, options: dict) -> frozenset:
        """The attention products it reads when created with ``options`` (default :attr:`products`)."""
        return cls.products

    @classmethod
    @abstractmethod
    def create(cls, spec: ModelSpec, **options) -> "Producer":
        """A fresh (zero) producer for one batch or one shard, its tensors on ``spec.device``."""

    def add_layer(self, lq) -> None:
        """One attention layer of one batch (``attention`` in :attr:`sites`)."""

    def add_hidden(self, layer: int, h: torch.Tensor, batch: HiddenBatch) -> None:
        """Hidden state ``layer`` (B, T, d) of one batch, on the device of the block that produced it
        (``hidden_states``). Layer 0 is the embeddings, ``n_layers`` the model's last hidden state (after
        its final norm where it has one: Hugging Face's ``hidden_states`` order); calls come in that order
        while the model runs, so the call for layer ``n_layers`` is the batch's last. Keep what you need:
        the model frees ``h`` once it is no longer its input."""

    def add_logits(self, out: LogitsBatch) -> None:
        """The pass's final hidden state and the LM head that makes its next-token logits (``logits`` in
        :attr:`sites`), once the model has returned; for an edited pass, with the clean pass's final hidden
        state too. The pass's :meth:`problems` were gathered before this call."""

    def nonfinite_excluded(self, layer: int, count: torch.Tensor) -> None:
        """``count`` tokens of ``layer`` left every attention statistic of this batch (their q, k or x held
        inf/NaN); called before that layer's :meth:`add_layer`."""

    def problems(self) -> list[torch.Tensor]:
        """Device counters that must be zero for this batch's outputs to be right (read once per batch)."""
        return []


class Analysis(Producer):
    """Mergeable statistics: one instance per batch and per shard, merged, reduced over shards."""

    views: ClassVar[dict[str, str]] = {}
    """SQL views over its reduced tables (name -> SELECT), recorded in the run by the reduce step and
    created by ``actlake sql`` / ``open_run``."""
    view_docs: ClassVar[dict[str, str]] = {}
    """What each of its views is, the question it answers, by view name: a built-in's rows of docs/sql-schema.md."""

    def layer_scratch(self) -> "Analysis":
        """For :attr:`graph_safe` analyses: a copy whose tensor fields hold one layer, zero (first dimension
        1), which a recorded :meth:`add_layer` writes at layer 0."""
        raise NotImplementedError(f"{type(self).__name__} is not graph_safe")

    @abstractmethod
    def merge(self, other: "Analysis") -> "Analysis":
        """This plus ``other``: associative and commutative up to float64 rounding."""

    @abstractmethod
    def to_tables(self) -> dict:
        """``{table: pyarrow.Table}`` for every name in :attr:`tables`."""

    @classmethod
    @abstractmethod
    def from_tables(cls, tables: dict) -> "Analysis":
        """The inverse of :meth:`to_tables` (the reduce step reads partials with it)."""


def _host(a) -> np.ndarray:
    """A float64 host array of a tensor on any device, or of an array: ``stats.np64`` (stats imports this module)."""
    if isinstance(a, torch.Tensor):
        return a.detach().to("cpu", torch.float64).numpy()
    return np.asarray(a, dtype=np.float64)


@dataclass(frozen=True)
class LabelsOf:
    """An axis whose labels an instance holds in its field ``field`` (one of ``choices``): written as held, read
    back as the choice whose labels the table's are, which :meth:`OneTable.from_arrow` passes to ``field``."""

    field: str
    """The instance's field holding the labels (and the keyword its constructor takes them by)."""
    choices: tuple[tuple[str, ...], ...]
    """Every labelling a table may have."""

    def pick(self, labels) -> tuple[str, ...]:
        """The choice whose labels are those of ``labels`` (a table's column)."""
        found = set(pc.unique(labels).to_pylist())
        for choice in self.choices:
            if set(choice) == found:
                return choice
        raise ValueError(f"labels {sorted(found)} are none of {self.field}'s {self.choices}")


class OneTable:
    """Mixin for an analysis with one table (list it before the Analysis base): ``to_tables`` / ``from_tables``
    through ``to_arrow`` / ``from_arrow``, which by default write and read the long table (one row per cell)
    declared by :attr:`AXES` and :attr:`COLUMNS` (:mod:`~actlake.analysis.engine.grid`)."""

    AXES: ClassVar[list] = []
    """The table's axes, its leading columns in order: (name, labels), (name, length) with length 0 for the
    arrays' (written) or the table's (read), or (name, :class:`LabelsOf`) for labels an instance holds. A name
    that is a tuple of column names has tuples of labels: one string column each (``("scheme", "category")``)."""
    COLUMNS: ClassVar[dict] = {}
    """Its value columns after the axes, in order: column name -> :class:`~actlake.analysis.engine.grid.Column`
    (the array attribute it holds, the axes that array spans, the column's type)."""

    def to_tables(self) -> dict:
        return {self.tables[0]: self.to_arrow()}

    @classmethod
    def from_tables(cls, tables: dict):
        return cls.from_arrow(tables[cls.tables[0]])

    def to_arrow(self) -> pa.Table:
        """The table of :attr:`COLUMNS` over :attr:`AXES`: each column's array (a tensor on any device, or an array)
        as float64, transposed to the axes' order and repeated over the axes it does not span."""
        if not self.COLUMNS:
            raise NotImplementedError(f"{type(self).__name__}: declare AXES and COLUMNS, or write to_arrow")
        axes = [(name, getattr(self, spec.field) if isinstance(spec, LabelsOf) else spec) for name, spec in self.AXES]
        arrays = {c.field: _host(attrgetter(c.field)(self)) for c in self.COLUMNS.values()}
        return grid.table(axes, self.COLUMNS, arrays)

    @classmethod
    def from_arrow(cls, table: pa.Table):
        """The inverse of :meth:`to_arrow`: each field a float64 host tensor, through :meth:`from_fields`."""
        if not cls.COLUMNS:
            raise NotImplementedError(f"{cls.__name__}: declare AXES and COLUMNS, or write from_arrow")
        axes, labels = [], {}
        for name, spec in cls.AXES:
            if isinstance(spec, LabelsOf):
                labels[spec.field] = spec = spec.pick(table[name])
            axes.append((name, spec))
        arrays = grid.arrays(table, axes, cls.COLUMNS)
        fields = {f: torch.from_numpy(np.ascontiguousarray(a)) for f, a in arrays.items()}
        return cls.from_fields(fields | labels)

    @classmethod
    def from_fields(cls, fields: dict):
        """An instance from its fields read back (field -> value; a dotted name as in :attr:`COLUMNS`):
        ``cls(**fields)``."""
        return cls(**fields)


class ShardTable(Producer):
    """One table written with each shard, never reduced; :attr:`schema` is its Arrow schema.

    A token table is made per batch: :meth:`create` before the forward pass, the device hooks while it
    runs, :meth:`collect` once the batch is finished (host arrays only, cheap: the worker holds its compute
    lock), and :meth:`to_table` over the shard's parts when the shard is written. A failed batch's parts
    are dropped, so a retried batch counts once. Tables of reading (``documents``, ``rejects``) are made
    per shard from its reading (:meth:`collect_read`)."""

    per_token = True
    schema: ClassVar = None
    """Its ``pyarrow.Schema``."""
    of_reading: ClassVar[bool] = False
    """Rows come from the shard's reading (:meth:`collect_read`), not from its batches."""

    @classmethod
    def create(cls, spec: ModelSpec, **options) -> "ShardTable":
        out = cls()
        out.spec, out.options = spec, options
        return out

    def collect(self, out: BatchOutputs) -> None:
        """This batch's rows, from the finished batch (and what the device hooks copied to the host)."""

    def collect_read(self, docs: list[dict], rejects: list[dict]) -> None:
        """For :attr:`of_reading` tables: the shard's documents and rejected records."""

    @classmethod
    @abstractmethod
    def to_table(cls, parts: list["ShardTable"], **options):
        """The shard's table from its parts (``options`` as given to :meth:`create`; ``parts`` may be empty)."""


class TokenValues(Producer):
    """Values per token of a batch that other producers read, written into no table of its own (``surprisal``:
    the ``tokens`` and ``activations`` tables' column, and the interventions' effect on it). One instance per pass
    of a batch (the clean one and each edited one), filled by its device hooks; :meth:`values` gives them on the
    device, the engine copies the clean pass's to the host as the :class:`BatchOutputs` fields of the same names
    (what the shard tables read) and hands every pass's to the interventions' per-window sums
    (:mod:`~actlake.analysis.engine.window_summary`). Built in only: ``analyses.custom`` takes an
    :class:`Analysis` or a :class:`ShardTable`."""

    per_token = True
    value_docs: ClassVar[dict[str, str]] = {}
    """Each value it gives, by name (a :class:`BatchOutputs` field): what it is, with units (the tables that carry
    it document their column with this text)."""

    @classmethod
    def create(cls, spec: ModelSpec, **options) -> "TokenValues":
        out = cls()
        out.spec, out.options = spec, options
        return out

    @abstractmethod
    def values(self) -> dict[str, torch.Tensor]:
        """This pass's (B, T) values on the device, NaN where undefined, by the names of :attr:`value_docs`."""

    def check(self, check, values: dict, logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> None:
        """The first batch's self-check (:class:`~actlake.analysis.engine.selfcheck.SelfCheck`), for a reader of
        ``logits``: its ``values`` (the clean pass's host copies, by name) against the model's own ``logits``
        (T, V) of the batch's first sequence (``ids``, ``mask``: its (T,) real tokens)."""
