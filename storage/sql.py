"""DuckDB over a run's Parquet: one view per table, read-only and locked down.

The connection may read files under the run directory only, cannot write,
attach, install or load anything, and cannot change its own configuration.
"""

from __future__ import annotations

import os
from pathlib import Path

from actlake.errors import QueryError, StorageError
from actlake.storage.layout import RunLayout

VIEWS = {
    "outliers": """
        WITH m AS (SELECT layer, dim, mean, count FROM dim_moments WHERE scheme = 'all'),
             s AS (SELECT layer, median(mean) AS med FROM m GROUP BY layer),
             d AS (SELECT layer, median(abs(m.mean - s.med)) AS mad FROM m JOIN s USING (layer) GROUP BY layer)
        SELECT m.layer, m.dim, m.mean, m.count,
               (m.mean - s.med) / nullif(1.4826 * d.mad, 0) AS robust_z,
               row_number() OVER (PARTITION BY m.layer ORDER BY abs(m.mean - s.med) DESC) AS rank
        FROM m JOIN s USING (layer) JOIN d USING (layer)""",
    "attention_mass_by_key": """
        SELECT layer, head, key_category, sum(mass) AS mass, sum(n_queries) AS n_queries,
               sum(mass) / sum(n_queries) AS mean_mass
        FROM attention_mass GROUP BY layer, head, key_category""",
    "contributions_mean": """
        SELECT layer, head, query_category, key_category, dim, n_pairs,
               contribution_sum / nullif(n_pairs, 0) AS mean_contribution,
               bias_sum / nullif(n_pairs, 0) AS mean_bias_term,
               CASE WHEN query_category = 'all' THEN weighted_sum / nullif(n_queries, 0) END AS weighted_per_query
        FROM contributions""",
    "attention_geometry_mean": """
        SELECT layer, head, key_category, n_pairs,
               q_norm_sum / nullif(n_pairs, 0) AS mean_q_norm, k_norm_sum / nullif(n_pairs, 0) AS mean_k_norm,
               cos_sum / nullif(n_pairs, 0) AS mean_cos, mass / nullif(n_queries, 0) AS mean_mass,
               mass_keynorm / nullif(n_queries, 0) AS mean_mass_keynorm
        FROM attention_geometry""",
    "attention_by_distance_mean": """
        SELECT layer, head, distance, n_pairs, attn_sum / nullif(n_pairs, 0) AS mean_attention
        FROM attention_by_distance WHERE n_pairs > 0""",
}
"""Derived views, created when their source tables exist."""

ALLOWED_STATEMENTS = {"SELECT", "EXPLAIN"}


def _quote(s: str) -> str:
    return "'" + s.replace("'", "''") + "'"


def _fixed_size_casts(table_dir: Path) -> list[str]:
    """Parquet has no fixed-size list; columns written as one (Arrow schema kept in the file) become FLOAT[d]."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    first = next(iter(sorted(table_dir.rglob("*.parquet"))), None)
    if first is None:
        return []
    out = []
    for f in pq.read_schema(first):
        if pa.types.is_fixed_size_list(f.type) and f.type.list_size > 0:
            out.append(f'CAST("{f.name}" AS FLOAT[{f.type.list_size}]) AS "{f.name}"')
    return out


def open_run(run_dir: str | os.PathLike, memory_limit: str = "2GB", threads: int | None = None):
    """A DuckDB connection with a view per table of the run; file access limited to the run."""
    import duckdb

    layout = RunLayout(Path(run_dir).resolve())
    tables = layout.table_names()
    if not tables:
        raise StorageError(f"{layout.root}: no tables (is this a run directory?)")
    con = duckdb.connect(":memory:")
    for t in tables:
        glob = str(layout.tables / t / "**" / "*.parquet")
        cast = _fixed_size_casts(layout.tables / t)
        select = f"* REPLACE ({', '.join(cast)})" if cast else "*"
        con.execute(f'CREATE VIEW "{t}" AS SELECT {select} FROM read_parquet({_quote(glob)}, hive_partitioning = true, union_by_name = true)')
    for name, sql in VIEWS.items():
        try:
            con.execute(f"CREATE VIEW {name} AS {sql}")
        except duckdb.Error:
            pass  # its source table is absent in this run
    con.execute(f"SET allowed_directories = [{_quote(str(layout.root))}]")
    con.execute("SET enable_external_access = false")
    con.execute("SET autoinstall_known_extensions = false")
    con.execute("SET autoload_known_extensions = false")
    con.execute(f"SET memory_limit = {_quote(memory_limit)}")
    if threads:
        con.execute(f"SET threads = {int(threads)}")
    con.execute("SET lock_configuration = true")
    return con


def check_statement(con, sql: str) -> None:
    """Refuse anything but one read-only statement."""
    try:
        statements = con.extract_statements(sql)
    except Exception as e:
        raise QueryError(f"cannot parse SQL: {e}") from None
    if len(statements) != 1:
        raise QueryError(f"one statement at a time, got {len(statements)}")
    kind = statements[0].type.name
    if kind not in ALLOWED_STATEMENTS:
        raise QueryError(f"read-only: {kind} statements are not allowed (only SELECT)")


def query(run_dir, sql: str, timeout_s: float = 60.0, **kwargs):
    """Run one read-only statement over a run; returns a pyarrow Table."""
    import threading

    import duckdb

    con = open_run(run_dir, **kwargs)
    try:
        check_statement(con, sql)
        timer = threading.Timer(timeout_s, con.interrupt)
        timer.start()
        try:
            return con.sql(sql).to_arrow_table()
        except duckdb.InterruptException:
            raise QueryError(f"query stopped after the {timeout_s:g}s time limit") from None
        except duckdb.Error as e:
            raise QueryError(str(e).splitlines()[0] if str(e) else type(e).__name__) from None
        finally:
            timer.cancel()
    finally:
        con.close()
