"""The analysis protocol: what every statistic of a job declares, and the registry that runs them.

An analysis is one class (built in, or yours: ``analyses.custom`` in the job config) that says

- what it reads (:data:`READS`): each layer's attention (a :class:`~actlake.analysis.layer_qk.LayerQK`:
  q and k as the kernel receives them, the batch's masks and categories), the key projection's input
  x and RoPE angles of that layer, products of the attention weights computed once per layer for
  every analysis that wants them (:data:`~actlake.analysis.attention_weights.PRODUCTS`), or the
  hidden states of every layer;
- how one batch updates it, on the model's device (:meth:`Analysis.add_layer`,
  :meth:`Analysis.add_hidden`), without reading values back to the host;
- an associative ``merge`` (shards reduce in any order);
- its tables (``to_tables`` / ``from_tables``; per-shard partials are written as ``<table>_by_shard``,
  the reduce step merges them into ``<table>``), its SQL views and its report charts.

Extraction, the reduce step, the SQL views and the report loop over the enabled analyses; no other
module names a particular one.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from actlake.errors import ConfigError

READS = frozenset({"attention", "layer_inputs", "hidden_states", "mass", "mass_keynorm", "weighted_qsum", "distance"})
"""What an analysis may read. ``attention``: :meth:`Analysis.add_layer` is called with each layer's
LayerQK. ``layer_inputs``: that LayerQK carries x, W_K, b_K and RoPE angles. Products of the attention
weights (``mass`` …): computed before ``add_layer`` and read with ``lq.product(name)``.
``hidden_states``: :meth:`Analysis.add_hidden` is called with each hidden state of a batch as the model
produces it, layer 0 to n_layers in order (none is kept after its call)."""


@dataclass(frozen=True)
class ModelSpec:
    """What an analysis needs to size its accumulators."""

    n_layers: int
    """Attention layers (hidden states: n_layers + 1, 0 = embeddings)."""
    n_heads: int
    n_kv_heads: int
    d_model: int
    max_length: int
    """Tokens per window (tokenization.max_length)."""
    device: torch.device
    """Where the accumulators live while a shard runs (the model's device)."""


@dataclass
class HiddenBatch:
    """A batch as :meth:`Analysis.add_hidden` sees it. Masks and categories are the host's (B, T) tensors."""

    valid: torch.Tensor
    role: torch.Tensor
    type8: torch.Tensor
    strict: bool
    """Look for inf/NaN values as they come (may read the device back). False: count them on the device
    and report them through :meth:`Analysis.problems`; the batch is then run again strictly."""
    triton: bool = False
    """The worker uses Triton kernels (:mod:`~actlake.analysis.kernels`; a CUDA device)."""


class Analysis(ABC):
    """Base class of an analysis (see the module docstring). Subclasses set the class attributes and
    override what they use; the accumulators are the instance's tensors."""

    name: ClassVar[str] = ""
    """Name in configs, logs and errors."""
    reads: ClassVar[frozenset] = frozenset()
    """Subset of :data:`READS`."""
    tables: ClassVar[tuple[str, ...]] = ()
    """Reduced tables (per-shard partials: ``<table>_by_shard``)."""
    views: ClassVar[dict[str, str]] = {}
    """SQL views over its reduced tables (name -> SELECT), created by ``actlake sql`` / ``open_run``."""

    @classmethod
    @abstractmethod
    def create(cls, spec: ModelSpec, **options) -> "Analysis":
        """Fresh (zero) accumulators on ``spec.device``; ``options`` from the job config."""

    graph_safe: ClassVar[bool] = False
    """:meth:`add_layer` may be recorded at one layer of a batch and replayed at the others
    (``analyses.layer_graphs``, :mod:`~actlake.analysis.layer_replay`): it reads only ``lq`` and what is
    the same for the whole batch, reads nothing back from the device and copies nothing from the host,
    keeps no Python state per layer, and writes only its tensor fields, each at ``[lq.layer]`` on its
    first dimension. :meth:`layer_scratch` must then work (it does for :class:`~actlake.analysis.stats.SumStats`)."""

    def add_layer(self, lq) -> None:
        """One attention layer of one batch (when ``attention`` is in :attr:`reads`)."""

    def layer_scratch(self) -> "Analysis":
        """For :attr:`graph_safe` analyses: a copy whose tensor fields hold one layer, zero (first dimension
        1), which a recorded :meth:`add_layer` writes at layer 0."""
        raise NotImplementedError(f"{type(self).__name__} is not graph_safe")

    def add_hidden(self, layer: int, h: torch.Tensor, batch: HiddenBatch) -> None:
        """Hidden state ``layer`` (B, T, d) of one batch, on the device of the block that produced it
        (``hidden_states``). Layer 0 is the embeddings, ``n_layers`` the model's last hidden state (after
        its final norm where it has one: Hugging Face's ``hidden_states`` order); calls come in that order
        while the model runs, so the call for layer ``n_layers`` is the batch's last. Keep what you need:
        the model frees ``h`` once it is no longer its input."""

    def problems(self) -> list[torch.Tensor]:
        """Device counters that must be zero for this batch's statistics to be right (read once per batch)."""
        return []

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

    @classmethod
    def charts(cls, con) -> list[tuple[float, object]]:
        """Report blocks as (position, block): a block is (slug, title, Altair chart) or an HTML string;
        ``con`` is the run's read-only DuckDB connection. Positions order the report's sections."""
        return []



class OneTable:
    """Mixin for an analysis with one table: ``to_tables`` / ``from_tables`` through the class's own
    ``to_arrow`` / ``from_arrow`` (list it before the Analysis base)."""

    def to_tables(self) -> dict:
        return {self.tables[0]: self.to_arrow()}

    @classmethod
    def from_tables(cls, tables: dict):
        return cls.from_arrow(tables[cls.tables[0]])


def builtin() -> dict[str, type[Analysis]]:
    """The built-in analyses by config key (``analyses.<name>: true/false``)."""
    from actlake.analysis.attention_distance import AttentionByDistance
    from actlake.analysis.attention_mass import AttentionMass
    from actlake.analysis.contributions import Contributions
    from actlake.analysis.dim_moments import DimMoments
    from actlake.analysis.geometry import Geometry

    return {c.name: c for c in (DimMoments, AttentionMass, Contributions, Geometry, AttentionByDistance)}


def load_class(target: str, where: str = "analyses.custom") -> type[Analysis]:
    """``package.module:ClassName`` -> the class, which must subclass :class:`Analysis`."""
    module, _, attr = target.partition(":")
    if not module or not attr:
        raise ConfigError(f"{where}: '{target}' is not 'package.module:ClassName'")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"{where}: cannot import '{target}' ({type(e).__name__}: {e})") from None
    if not (isinstance(cls, type) and issubclass(cls, Analysis)):
        raise ConfigError(f"{where}: '{target}' is not a subclass of actlake.analysis.protocol.Analysis")
    bad = set(cls.reads) - READS
    if bad or not cls.name or not cls.tables:
        raise ConfigError(f"{where}: '{target}' must set name and tables and read only {sorted(READS)}"
                          + (f" (unknown: {sorted(bad)})" if bad else ""))
    return cls


def enabled(analyses_cfg) -> list[tuple[type[Analysis], dict]]:
    """(class, options) of every analysis a job's ``analyses`` config turns on, built-ins first."""
    out = []
    for name, cls in builtin().items():
        if getattr(analyses_cfg, name):
            out.append((cls, cls.options_from(analyses_cfg) if hasattr(cls, "options_from") else {}))
    for i, custom in enumerate(getattr(analyses_cfg, "custom", []) or []):
        cls = load_class(custom.analysis, f"analyses.custom[{i}].analysis")
        out.append((cls, dict(custom.args)))
    return out


def products(classes) -> frozenset:
    """Products of the attention weights the given analyses read."""
    return frozenset().union(*(c.reads for c in classes)) & (READS - {"attention", "layer_inputs", "hidden_states"})
