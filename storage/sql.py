"""DuckDB over a run's committed Parquet files: one view per table, read-only and locked down.

Each table is a view over exactly the files of the run's manifest
(:func:`actlake.storage.manifest.committed_files`), named as ``actlake-ro://`` URLs served by a
read-only file system (:mod:`actlake.storage.readonly_fs`). DuckDB may touch those URLs only
(``allowed_paths``; ``enable_external_access = false``, no allowed directories), and since DuckDB
would let a connection write to an allowed path, that file system opens them for reading only.
Its own database is an empty read-only one, it spills into a private temporary folder of
bounded size, and its configuration is locked: whatever statement runs on the connection, it
cannot write a file, nor read one the manifest does not list.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import weakref
from pathlib import Path

from actlake.errors import QueryError, StorageError
from actlake.fs import arrow, location
from actlake.storage.layout import RunLayout
from actlake.storage.manifest import committed_files, is_table_name, recorded_views
from actlake.storage.readonly_fs import ReadOnlyFiles, url
from actlake.storage.sql_process import MAX_TEMP_SIZE  # one default for open_run and actlake sql
from actlake.storage.verified import verify_files


def derived_views(layout: RunLayout) -> dict[str, tuple[str, str]]:
    """View name -> (source table, SELECT): the views the job's analyses (built in and custom) declared over
    their tables, as its reduce record names them; created when the source table has committed files.
    Querying a run imports no analysis (no torch) and never code named in the run folder. A run reduced
    before views were recorded gets the built-in analyses' views (which imports them)."""

    views = recorded_views(layout)
    if views is None:
        from actlake.analysis.registry import builtin  # loads torch: imported when used

        views = {name: (cls.tables[0], sql) for cls in builtin().values() for name, sql in cls.views.items()}
    return views


READ_ONLY_STATEMENTS = {"SELECT"}
"""Statement types ``query`` runs; ``EXPLAIN`` / ``EXPLAIN ANALYZE`` of one of them too."""

_EXPLAIN_PREFIX = re.compile(r"\s*EXPLAIN(\s+ANALYZE)?\s+", re.IGNORECASE)



def _quote(s: str) -> str:
    return "'" + s.replace("'", "''") + "'"


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def _parse(sql: str) -> list:
    """DuckDB's own parse of ``sql`` into statements."""
    import duckdb

    try:
        return duckdb.extract_statements(sql)
    except duckdb.Error as e:
        raise QueryError(f"cannot parse SQL: {_first_line(e)}") from None


def check_statement(sql: str) -> None:
    """Refuse anything but one SELECT, or EXPLAIN [ANALYZE] of one SELECT.

    Wrapped statements are checked by what they wrap: EXPLAIN's inner statement is parsed again by
    DuckDB and must itself be a SELECT (so ``EXPLAIN ANALYZE COPY …`` is refused); PREPARE, EXECUTE,
    COPY, ATTACH, SET, PRAGMA, CREATE, INSTALL, LOAD, CALL … are refused outright.
    """
    statements = _parse(sql)
    if len(statements) != 1:
        raise QueryError(f"one statement at a time, got {len(statements)}")
    kind = statements[0].type.name
    if kind == "EXPLAIN":
        text = statements[0].query
        prefix = _EXPLAIN_PREFIX.match(text)
        inner = _parse(text[prefix.end():]) if prefix else []
        if len(inner) != 1 or inner[0].type.name not in READ_ONLY_STATEMENTS:
            raise QueryError(f"read-only: EXPLAIN of anything but one SELECT is not allowed: {text.strip()[:80]}")
        return
    if kind not in READ_ONLY_STATEMENTS:
        raise QueryError(f"read-only: {kind} statements are not allowed (only SELECT and EXPLAIN SELECT)")


def _file_schema(path):
    import pyarrow.parquet as pq

    try:
        fs, key = arrow(path)
        return pq.read_schema(key, filesystem=fs)
    except Exception as e:
        raise StorageError(f"{path}: not a readable Parquet file ({type(e).__name__}: {_first_line(e)})") from None


def _fixed_size_casts(files: list[Path]) -> list[str]:
    """Parquet has no fixed-size list; columns written as one (Arrow schema kept in the file) become FLOAT[d].

    Reads every file's footer, so a committed file that is not Parquet is named before any query.
    """
    import pyarrow as pa

    out = {}
    for path in files:
        for f in _file_schema(path):
            if pa.types.is_fixed_size_list(f.type) and f.type.list_size > 0:
                out[f.name] = f'CAST({_ident(f.name)} AS FLOAT[{f.type.list_size}]) AS {_ident(f.name)}'
    return list(out.values())


def _ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _view_sql(files: list[Path]) -> str:
    """SELECT over exactly ``files``, read through the read-only file system (hive keys from the folder names)."""

    casts = _fixed_size_casts(files)
    select = f"* REPLACE ({', '.join(casts)})" if casts else "*"
    listed = ", ".join(_quote(url(f)) for f in files)
    return f"SELECT {select} FROM read_parquet([{listed}], hive_partitioning = true, union_by_name = true)"


def _connect(private: str, memory_limit: str, threads: int | None, max_temp_size: str):
    """An empty read-only DuckDB database in ``private``, spilling into ``private/spill``."""
    import duckdb

    db = os.path.join(private, "empty.duckdb")
    duckdb.connect(db).close()
    con = duckdb.connect(db, read_only=True)
    settings = {"temp_directory": os.path.join(private, "spill"), "max_temp_directory_size": max_temp_size,
                "memory_limit": memory_limit, "autoinstall_known_extensions": "false",
                "autoload_known_extensions": "false", "python_enable_replacements": "false"}
    if threads:
        settings["threads"] = str(int(threads))
    for name, value in settings.items():
        con.execute(f"SET {name} = {_quote(value)}")
    return con


def _restrict(con, files: list[Path]) -> None:
    """File access only to ``files`` through the read-only file system (the caller then locks the configuration)."""

    con.execute(f"SET allowed_paths = [{', '.join(_quote(url(f)) for f in files)}]")
    con.execute("SET enable_external_access = false")


def _check_view(layout: RunLayout, name: str, sql: str) -> None:
    """A recorded view must be one SELECT under a plain name (the record is a file of the run folder)."""

    try:
        if not is_table_name(name):
            raise QueryError(f"{name!r} is not a view name")
        check_statement(sql)
    except QueryError as e:
        raise StorageError(f"{layout.complete}/reduced.json: view {name!r} refused ({e})") from None


def _open(run_dir, memory_limit: str = "2GB", threads: int | None = None, max_temp_size: str = MAX_TEMP_SIZE):
    """(connection, cleanup): the locked connection of :func:`open_run` and a callable that closes it and removes its folder."""
    import duckdb


    layout = RunLayout(location(run_dir))
    files = committed_files(layout)
    if not files:
        raise StorageError(f"{layout.root}: no committed tables (has a job finished a shard here?)")
    every = [f for fs in files.values() for f in fs]
    verify_files(every)  # page checksums, once per version of a file (storage/verified.py)
    views = {t: _view_sql(fs) for t, fs in files.items()}
    private = tempfile.mkdtemp(prefix="actlake-duckdb-")
    try:
        con = _connect(private, memory_limit, threads, max_temp_size)
    except BaseException:
        shutil.rmtree(private, ignore_errors=True)
        raise
    finalizer = weakref.finalize(con, shutil.rmtree, private, True)

    def cleanup():
        con.close()
        finalizer()

    try:
        con.register_filesystem(ReadOnlyFiles(every))
        for t, sql in views.items():
            con.execute(f"CREATE TEMP VIEW {_ident(t)} AS {sql}")
        _restrict(con, every)  # the recorded views below are the run folder's text: bound with no access outside
        for name, (source, sql) in derived_views(layout).items():
            if source in views and name not in views:
                _check_view(layout, name, sql)
                con.execute(f"CREATE TEMP VIEW {_ident(name)} AS {sql}")
        con.execute("SET lock_configuration = true")
    except duckdb.Error as e:
        cleanup()
        raise StorageError(f"{layout.root}: cannot set up the views ({_first_line(e)})") from None
    return con, cleanup


def open_run(run_dir: str | os.PathLike, memory_limit: str = "2GB", threads: int | None = None,
             max_temp_size: str = MAX_TEMP_SIZE):
    """A DuckDB connection with a view per committed table of the run; it can read nothing else and write nothing.

    Spills go to a private temporary folder (at most ``max_temp_size``), removed when the
    connection is garbage-collected (``query`` removes it when it closes the connection).
    """
    return _open(run_dir, memory_limit, threads, max_temp_size)[0]


def query(run_dir, sql: str, timeout_s: float = 60.0, **kwargs):
    """Run one read-only statement over a run; returns a pyarrow Table."""
    import threading

    import duckdb

    check_statement(sql)
    con, cleanup = _open(run_dir, **kwargs)
    try:
        timer = threading.Timer(timeout_s, con.interrupt)
        timer.start()
        try:
            return con.sql(sql).to_arrow_table()
        except duckdb.InterruptException:
            raise QueryError(f"query stopped after the {timeout_s:g}s time limit") from None
        except duckdb.Error as e:
            raise QueryError(_first_line(e)) from None
        finally:
            timer.cancel()
    finally:
        cleanup()
