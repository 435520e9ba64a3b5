"""DuckDB over a run's Parquet: one view per table, read-only and locked down.

The connection may read files under the run directory only, cannot write,
attach, install or load anything, and cannot change its own configuration.
"""

from __future__ import annotations

import os
from pathlib import Path

from actlake.errors import QueryError, StorageError
from actlake.storage.layout import RunLayout

def derived_views() -> dict[str, str]:
    """View name -> SELECT: the views each built-in analysis declares over its tables (created when their
    source tables exist). Custom analyses' tables get plain views only: querying a run never imports
    code named in the run folder."""
    from actlake.analysis.protocol import builtin

    return {name: sql for cls in builtin().values() for name, sql in cls.views.items()}

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
    for name, sql in derived_views().items():
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
