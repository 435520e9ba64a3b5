"""Which producers a job runs: the built-in analyses and shard tables, and the custom ones its config names."""

from __future__ import annotations

import difflib
import importlib
import inspect
import os
import traceback

from pydantic import ValidationError

from actlake.analysis.activation_sample import ActivationSample
from actlake.analysis.documents import Documents, Rejects
from actlake.analysis.intervention_effects import InterventionEffects
from actlake.analysis.protocol import PRODUCTS, SITES, Analysis, Producer, ShardTable, TokenValues
from actlake.analysis.residual_norms import ResidualNorms
from actlake.analysis.token_surprisal import Surprisal
from actlake.analysis.tokens import Tokens
from actlake.errors import ActlakeError, AnalysisError, AnalysisFailed, ConfigError
from actlake.tables import BY_SOURCE_SUFFIX, PARTIAL_SUFFIX, is_table_name


ANALYSES = (
    "dim_moments:DimMoments",
    "attention_mass:AttentionMass",
    "contributions:Contributions",
    "geometry:Geometry",
    "attention_distance:AttentionByDistance",
    "attention_peak:AttentionPeak",
)
"""The built-in analyses, ``module:Class`` in ``actlake.analysis``, in the order their tables, charts and reference
rows come: a new built-in statistic is its module and one line here."""


def builtin() -> dict[str, type[Analysis]]:
    """The built-in analyses by config key (``analyses.<name>: true/false``)."""
    return {c.name: c for c in map(_builtin_class, ANALYSES)}


def _builtin_class(target: str) -> type[Analysis]:
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(f"{__package__}.{module}"), attr)


def builtin_producers() -> list[type[Producer]]:
    """Every built-in producer class, analyses first: what the report reads headlines and charts from."""
    return list(builtin().values()) + [InterventionEffects, Documents, Rejects, Tokens, ResidualNorms,
                                       ActivationSample] + list(TOKEN_VALUES)


TOGGLED_TABLES = (Tokens, ResidualNorms)
"""Built-in shard tables a config turns on and off by name (``documents`` and ``rejects`` are always written; the
activation sample is the ``activations`` section's)."""


def is_on(cls, cfg) -> bool:
    """Whether ``analyses.<name>`` turns a built-in producer on (absent: its :attr:`~Producer.default_on`)."""
    entry = cfg.analyses.entry(cls.name)
    return cls.default_on if entry is None else entry is not False


def builtin_tables(cfg) -> list[type[ShardTable]]:
    """The built-in shard tables a job's config turns on, in the order a shard writes them."""
    return [Documents, Rejects] + [cls for cls in TOGGLED_TABLES if is_on(cls, cfg)] \
        + [ActivationSample] * bool(cfg.activations.layers)


TOKEN_VALUES = (Surprisal,)
"""Built-in producers of values per token (:class:`~actlake.analysis.protocol.TokenValues`), which the tables that
carry them read."""


def token_values(cfg, lm_head: bool) -> list[tuple[type[TokenValues], dict]]:
    """(class, options) of the per-token values a worker computes: where its model was loaded with its LM head
    (``lm_head``; a job's worker loads it as ``analyses.surprisal`` says: null, a causal LM's), those that read the
    ``logits`` and whose ``analyses.<name>`` is not false."""
    return [(cls, cls.options_from(cfg)) for cls in TOKEN_VALUES
            if ("logits" not in cls.sites or lm_head) and getattr(cfg.analyses, cls.name, None) is not False]


def logits_readers(cfg) -> list[str]:
    """The names of the job's analyses and shard tables that read the LM head's ``logits`` (custom ones: Surprisal
    is a token value, :func:`token_values`); a worker loads the head for them whatever ``analyses.surprisal`` says."""
    return [cls.name for cls, _ in enabled(cfg) + shard_tables(cfg) if "logits" in cls.sites]


WEIGHTS_PRODUCTS = frozenset({"weighted_qsum", "distance"})
"""Products that need the attention weights, which ``attention_weights: fused`` never builds."""


def options_of(cls, entry) -> dict:
    """``analyses.<name>`` (True, False, None or a mapping) as the keyword arguments of ``cls.create``; a
    ConfigError naming the option and what it takes."""
    given = entry if isinstance(entry, dict) else {}
    try:
        return cls.Options(**given).model_dump()
    except ValidationError as e:
        err = e.errors()[0]
        key = ".".join(map(str, ("analyses", cls.name, *err["loc"])))
        if err["type"] == "extra_forbidden":
            known = list(cls.Options.model_fields)
            raise ConfigError(f"{key}: {cls.name} has no such option ("
                              f"{'its options: ' + ', '.join(known) if known else 'it has none'})") from None
        raise ConfigError(f"{key}: {err['msg'].lower()}, got {err['input']!r}") from None


def check_analysis_entries(cfg) -> None:
    """ConfigError naming the key when ``analyses`` names a producer that is not built in, gives options one does
    not have or values of the wrong type, or turns on one that needs attention weights with
    ``attention_weights: fused``."""
    named = {cls.name: cls for cls in list(builtin().values()) + list(TOGGLED_TABLES)}
    for key in cfg.analyses.model_extra or {}:
        if key not in named:
            close = difflib.get_close_matches(key, list(named) + list(type(cfg.analyses).model_fields), n=1)
            raise ConfigError(f"analyses.{key}: no built-in analysis or table of that name"
                              + (f" (did you mean '{close[0]}'?)" if close else f" (built in: {', '.join(named)})")
                              + "; your own go under analyses.custom")
    for name, cls in named.items():
        options = options_of(cls, cfg.analyses.entry(name))
        needs = cls.products_for(options) & WEIGHTS_PRODUCTS
        if needs and is_on(cls, cfg) and cfg.analyses.attention_weights == "fused":
            raise ConfigError(f"analyses.attention_weights: 'fused' computes no attention weights, which analyses.{name} "
                              f"needs ({', '.join(sorted(needs))}): turn it off or set attention_weights: explicit/auto")


def load_class(target: str, where: str = "analyses.custom") -> type[Producer]:
    """``package.module:ClassName`` -> the class, which must subclass :class:`~actlake.analysis.protocol.Analysis`
    or :class:`~actlake.analysis.protocol.ShardTable`."""
    module, _, attr = target.partition(":")
    if not module or not attr:
        raise ConfigError(f"{where}: '{target}' is not 'package.module:ClassName'")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"{where}: cannot import '{target}' ({type(e).__name__}: {e})") from None
    if not (isinstance(cls, type) and issubclass(cls, (Analysis, ShardTable))):
        raise ConfigError(f"{where}: '{target}' is not a subclass of actlake.analysis.protocol.Analysis or ShardTable")
    bad = (set(cls.sites) - SITES) | (set(cls.products) - PRODUCTS)
    if bad or not cls.name or not cls.tables or (cls.products and "attention" not in cls.sites):
        raise ConfigError(f"{where}: '{target}' must set name and tables, read sites of {sorted(SITES)} and products "
                          f"of {sorted(PRODUCTS)} (products need the 'attention' site)"
                          + (f"; unknown: {sorted(bad)}" if bad else ""))
    if issubclass(cls, ShardTable) and cls.schema is None:
        raise ConfigError(f"{where}: '{target}' is a ShardTable without a schema")
    return cls


def custom(cfg) -> list[tuple[type[Producer], dict]]:
    """(class, options) of every ``analyses.custom`` entry."""
    return [(load_class(c.analysis, f"analyses.custom[{i}].analysis"), dict(c.args))
            for i, c in enumerate(getattr(cfg.analyses, "custom", []) or [])]


def enabled(cfg) -> list[tuple[type[Analysis], dict]]:
    """(class, options) of every analysis a job's config turns on, built-ins first."""
    out = [(cls, options_of(cls, cfg.analyses.entry(name))) for name, cls in builtin().items() if is_on(cls, cfg)]
    out += [(InterventionEffects, {})] * bool(getattr(cfg, "interventions", None))  # made from the passes' sums
    return out + [(cls, options) for cls, options in custom(cfg) if issubclass(cls, Analysis)]


def shard_tables(cfg) -> list[tuple[type[ShardTable], dict]]:
    """(class, options) of every shard table a job writes, built-ins first."""
    out = [(cls, cls.options_from(cfg)) for cls in builtin_tables(cfg)]
    return out + [(cls, options) for cls, options in custom(cfg) if issubclass(cls, ShardTable)]


def check_table_names(cfg) -> None:
    """ConfigError naming the producers when two of a job's producers write the same table, or a table
    name is not a plain identifier or ends in ``_partial`` (the reduce step's partials); the views' names too
    (:func:`check_view_names`); first, the ``analyses`` entries (:func:`check_analysis_entries`)."""
    check_analysis_entries(cfg)
    seen: dict[str, str] = {}
    for cls, _ in enabled(cfg) + shard_tables(cfg):
        for table in cls.tables:
            if not is_table_name(table) or table.endswith((PARTIAL_SUFFIX, BY_SOURCE_SUFFIX)):
                raise ConfigError(f"analyses: {cls.name!r} names a table {table!r}: use lower-case letters, digits and "
                                  f"underscores, a letter first, not ending in {PARTIAL_SUFFIX} or {BY_SOURCE_SUFFIX}")
            if table in seen:
                raise ConfigError(f"analyses: {seen[table]!r} and {cls.name!r} both write a table {table!r}")
            if table in RESERVED:
                raise ConfigError(f"analyses: {cls.name!r} names a table {table!r}, a name actlake keeps for "
                                  f"{RESERVED[table]}; rename it")
            seen[table] = cls.name
    check_view_names(cfg)


RESERVED = {"checkpoints": "a checkpoint sweep's table"}
"""Names no producer's table or view may take."""


def check_view_names(cfg) -> None:
    """ConfigError naming the producers when a view's name is not a plain identifier, is a table's (a view would
    hide it), or is another producer's view (one would replace the other silently)."""
    producers = [cls for cls, _ in enabled(cfg) + shard_tables(cfg)]
    tables = {t: cls.name for cls in producers for t in cls.tables}
    seen: dict[str, str] = {}
    for cls in producers:
        for view in getattr(cls, "views", {}):
            if not is_table_name(view) or view.endswith((PARTIAL_SUFFIX, BY_SOURCE_SUFFIX)):
                raise ConfigError(f"analyses: {cls.name!r} names a view {view!r}: use lower-case letters, digits and "
                                  f"underscores, a letter first, not ending in {PARTIAL_SUFFIX} or {BY_SOURCE_SUFFIX}")
            if view in RESERVED:
                raise ConfigError(f"analyses: {cls.name!r} declares a view {view!r}, a name actlake keeps for "
                                  f"{RESERVED[view]}; rename the view")
            clash = tables.get(view) or seen.get(view)
            if clash:
                what = "table" if view in tables else "view"
                raise ConfigError(f"analyses: {cls.name!r} declares a view {view!r}, the name of {clash!r}'s {what}; "
                                  "rename the view")
            seen[view] = cls.name


def custom_views(producers) -> list:
    """The producers among ``producers`` (classes) that declare views and are not built in: the views a job checks
    on each worker's first shard (built-in views are checked by actlake's tests)."""
    mine = set(builtin_producers())
    return [cls for cls in producers if getattr(cls, "views", None) and cls not in mine]


def producer_views(producers, tables: dict) -> dict:
    """The producers' declared views over ``tables`` (name -> Arrow table) in an in-memory DuckDB, by name (a
    view may read one whose name sorts before it, as in ``actlake sql``), as Arrow tables; a view that does not bind is an AnalysisError naming it and
    its producer, with DuckDB's message."""
    import duckdb

    con = duckdb.connect()
    out = {}
    try:
        for name, table in tables.items():
            con.register(name, table)
        views = sorted(((name, cls, sql) for cls in producers for name, sql in getattr(cls, "views", {}).items()),
                       key=lambda v: v[0])
        for name, cls, sql in views:  # in the order the run records them and actlake sql creates them: by name
            try:
                out[name] = con.sql(sql).to_arrow_table()
            except duckdb.Error as e:
                why = " ".join(str(e).split())[:300]
                raise AnalysisError(f"analysis {cls.name!r}: its view {name!r} does not run over its tables "
                                    f"({type(e).__name__}: {why})") from None
            con.register(name, out[name])
        return out
    finally:
        con.close()


def products(producers) -> frozenset:
    """Products of the attention weights the given producers (classes or instances) read."""
    return frozenset().union(*(p.products for p in producers))


def failure(exc: BaseException, classes) -> AnalysisFailed | None:
    """``exc`` as an :class:`~actlake.errors.AnalysisFailed` naming the producer among ``classes`` whose code
    raised it (None: none of theirs did). The producer is the innermost frame whose ``self``/``cls`` is one
    of them, or else whose file is one of theirs; FILE:LINE is the innermost frame in such a file. An actlake
    error is not wrapped (None)."""
    if isinstance(exc, AnalysisFailed):
        return exc
    if isinstance(exc, ActlakeError):  # actlake's own error: it names what went wrong already
        return None
    classes = list(classes)
    files = {}
    for cls in classes:
        try:
            files.setdefault(os.path.realpath(inspect.getsourcefile(cls)), cls)
        except TypeError:  # a class without a source file
            continue
    frames = list(traceback.walk_tb(exc.__traceback__))  # (frame, line number), outermost first
    line_at = where = owner = None
    for frame, lineno in reversed(frames):
        me = frame.f_locals.get("self", frame.f_locals.get("cls"))
        mine = next((c for c in classes if me is c or isinstance(me, c) or (isinstance(me, type) and issubclass(me, c))), None)
        if line_at is None and (mine is not None or os.path.realpath(frame.f_code.co_filename) in files):
            line_at = (frame.f_code.co_filename, lineno)
        if mine is not None and not frame.f_code.co_name.startswith("<"):  # not a comprehension's frame
            owner, where = mine, frame.f_code.co_name
            break
    if line_at is None:
        return None
    owner = owner or files.get(os.path.realpath(line_at[0]))
    if owner is None:  # matched by a local ``cls`` outside the producer's code (a loop over producers): not theirs
        return None
    text = " ".join(str(exc).split())[:300] or "(no message)"
    return AnalysisFailed(f"analysis {owner.name!r} failed at {line_at[0]}:{line_at[1]} in {where or '?'}: "
                          f"{type(exc).__name__}: {text}", "".join(traceback.format_exception(exc)))
