"""SQL over a run: views, output formats, and read-only enforcement."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from actlake.errors import QueryError
from actlake.jobs.cli import main
from actlake.jobs.extract.run import run_job
from actlake.storage.sql import query
from tests.conftest import job_config

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("kept_workers")]


@pytest.fixture(scope="module")
def run_dir(tiny_models, sample_corpus, tmp_path_factory, ray_local):
    out = tmp_path_factory.mktemp("sqlrun")
    return run_job(job_config(tiny_models["bert"], sample_corpus, out, **{"corpus.max_docs": 8})).run_dir


def _tree_digest(root) -> str:
    from pathlib import Path

    h = hashlib.sha256()
    for p in sorted(Path(root).rglob("*")):
        h.update(str(p.relative_to(root)).encode())
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


def test_views_and_formats(run_dir, capsys):
    names = {r["name"] for r in query(run_dir, "SELECT table_name AS name FROM information_schema.tables").to_pylist()}
    assert {"tokens", "residual_norms", "dim_moments", "attention_mass", "documents", "rejects", "outliers",
            "attention_mass_by_key"} <= names
    n = query(run_dir, "SELECT count(*) AS n FROM tokens").to_pylist()[0]["n"]
    assert n == query(run_dir, "SELECT sum(n_tokens) AS n FROM documents").to_pylist()[0]["n"]
    # outliers: robust z from the raw moments, checked by hand for one layer
    import numpy as np

    means = np.array([r["mean"] for r in query(run_dir, "SELECT mean FROM dim_moments WHERE scheme='all' AND layer=1 ORDER BY dim").to_pylist()])
    med = np.median(means)
    mad = np.median(np.abs(means - med))
    top = query(run_dir, "SELECT dim, robust_z FROM outliers WHERE layer=1 AND rank=1").to_pylist()[0]
    assert top["dim"] == int(np.argmax(np.abs(means - med)))
    assert abs(top["robust_z"] - (means[top["dim"]] - med) / (1.4826 * mad)) < 1e-9

    assert main(["sql", run_dir, "SELECT layer, count(*) AS n FROM residual_norms GROUP BY layer ORDER BY layer", "--format", "json"]) == 0
    rows = [json.loads(l) for l in capsys.readouterr().out.splitlines()]
    assert [r["layer"] for r in rows] == [0, 1, 2] and all(r["n"] == n for r in rows)
    assert main(["sql", run_dir, "SELECT 1 AS a, 'x' AS b", "--format", "csv"]) == 0
    assert capsys.readouterr().out.splitlines() == ['"a","b"', '1,"x"']


def test_plain_duckdb_reads_the_files_with_hive_partitioning(run_dir):
    import duckdb

    n = duckdb.sql(f"SELECT count(*) FROM read_parquet('{run_dir}/tables/tokens/**/*.parquet', hive_partitioning=true)").fetchall()[0][0]
    shards = duckdb.sql(f"SELECT count(DISTINCT shard) FROM read_parquet('{run_dir}/tables/tokens/**/*.parquet', hive_partitioning=true)").fetchall()[0][0]
    assert n == query(run_dir, "SELECT count(*) AS n FROM tokens").to_pylist()[0]["n"] and shards == 1


@pytest.mark.parametrize("sql", [
    "SELECT * FROM read_csv('/etc/passwd')",
    "SELECT * FROM read_text('/etc/passwd')",
    "COPY (SELECT 1) TO '{run}/tables/tokens/evil.parquet'",
    "CREATE TABLE t AS SELECT 1",
    "INSERT INTO tokens VALUES (1)",
    "ATTACH '{run}/evil.duckdb' AS evil",
    "INSTALL httpfs",
    "LOAD httpfs",
    "SET enable_external_access = true",
    "SELECT 1; SELECT 2",
    "DROP VIEW tokens",
])
def test_hostile_sql_is_refused_and_the_tree_is_unchanged(run_dir, sql):
    before = _tree_digest(run_dir)
    with pytest.raises(QueryError):
        query(run_dir, sql.format(run=run_dir))
    assert _tree_digest(run_dir) == before


def test_runaway_query_is_stopped(run_dir):
    with pytest.raises(QueryError, match="time limit"):
        query(run_dir, "SELECT count(*) FROM range(100000000) a, range(100000000) b WHERE a.range * b.range = 7",
              timeout_s=1.0)


def test_massive_activations_rank_dimensions_within_each_token_role(run_dir, tiny_models):
    """Issue 34: the ``outliers`` view ranks by the all-token mean, so a dimension large only on [CLS] never
    shows. ``massive_activations`` ranks within each category; checked against the model's hidden states
    recomputed window by window (float64): per role, the mean, max |x|, E[x_j^2] / E[|x|^2] and the top dimension."""
    import numpy as np
    import torch
    from transformers import AutoModel

    from actlake.categories import ROLE

    model = AutoModel.from_pretrained(tiny_models["bert"]).eval()
    rows = query(run_dir, "SELECT doc_id, window_index, token_id, role FROM tokens ORDER BY doc_id, window_index, position")
    windows: dict = {}
    for doc, win, tid, role in zip(*(rows[c].to_pylist() for c in ("doc_id", "window_index", "token_id", "role"))):
        windows.setdefault((doc, win), []).append((tid, role))
    layer, xs = 1, {r: [] for r in ROLE}
    with torch.no_grad():
        for toks in windows.values():
            h = model(input_ids=torch.tensor([[t for t, _ in toks]]), output_hidden_states=True).hidden_states[layer][0]
            for (_, role), vec in zip(toks, h.double().numpy()):
                xs[role].append(vec)
    got = query(run_dir, f"SELECT category, dim, mean, max_abs, share, rank FROM massive_activations "
                         f"WHERE layer = {layer} AND scheme = 'role'").to_pylist()
    by = {(r["category"], r["dim"]): r for r in got}
    for role, vecs in xs.items():
        if not vecs:
            continue
        x = np.stack(vecs)  # (n, d)
        mean, square = x.mean(0), (x * x).mean(0)
        top = int(np.argmax(np.abs(mean)))
        assert by[(role, top)]["rank"] == 1, role
        for j in (top, 0):
            r = by[(role, j)]
            assert r["mean"] == pytest.approx(mean[j], rel=1e-4, abs=1e-5)
            assert r["max_abs"] == pytest.approx(np.abs(x[:, j]).max(), rel=1e-4)
            assert r["share"] == pytest.approx(square[j] / square.sum(), rel=1e-4)


@pytest.fixture(scope="module")
def other_run(tiny_models, sample_corpus, tmp_path_factory, ray_local):
    out = tmp_path_factory.mktemp("sqlrun2")
    return run_job(job_config(tiny_models["gpt2"], sample_corpus, out, **{"corpus.max_docs": 8,
                                                                           "analyses.attention_by_distance": False})).run_dir


def _names(con) -> set[str]:
    return {r[0] for r in con.execute("SELECT table_name FROM information_schema.tables").fetchall()}


def test_runs_side_by_side(run_dir, other_run, capsys):
    """Two runs of different models opened together: every row of each run's own views reappears under its run
    value and nothing else; a view the runs do not share is left out with a line naming it."""
    import warnings
    from pathlib import Path

    import pandas as pd

    import actlake

    runs = [run_dir, other_run]
    names = [Path(r).name for r in runs]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        both = actlake.open_runs(runs)
    offered = _names(both)
    assert {"residual_norms", "dim_moments", "attention_mass_by_key", "massive_activations", "documents"} <= offered
    alone = [actlake.open_run(r) for r in runs]
    for view in sorted(offered):
        cols = ", ".join(f'"{c[0]}"' for c in alone[0].execute(f"DESCRIBE {view}").fetchall())
        counts = []
        for name, con in zip(names, alone):
            own = con.execute(f"SELECT {cols} FROM {view} ORDER BY ALL").df()
            theirs = both.execute(f"SELECT {cols} FROM {view} WHERE run = ? ORDER BY ALL", [name]).df()
            pd.testing.assert_frame_equal(own, theirs, check_dtype=False, obj=f"{view} of {name}")
            counts.append(len(own))
        assert both.execute(f"SELECT count(*) FROM {view}").fetchone()[0] == sum(counts), view
    import duckdb

    assert (Path(run_dir) / "run.json").exists()
    for write in ("CREATE TABLE t AS SELECT 1", f"COPY (SELECT 1) TO '{Path(run_dir).parent}/x.csv'",
                  f"SELECT * FROM read_json('{Path(run_dir) / 'run.json'}')"):
        with pytest.raises(duckdb.Error):  # read-only, and locked to the runs' committed files, as one run is
            both.execute(write)
    left_out = (_names(alone[0]) | _names(alone[1])) - offered
    assert "attention_by_distance" in left_out and all(v.startswith("attention_by_distance") for v in left_out) and all(any(str(w.message).startswith(f"{v}: not offered") for w in caught) for v in left_out)

    capsys.readouterr()
    assert main(["sql", *runs, "SELECT run, count(*) AS n FROM residual_norms GROUP BY run ORDER BY run",
                 "--format", "json"]) == 0
    out = capsys.readouterr()
    got = {json.loads(line)["run"]: json.loads(line)["n"] for line in out.out.splitlines()}
    assert got == {n: c.execute("SELECT count(*) FROM residual_norms").fetchone()[0] for n, c in zip(names, alone)}
    assert all(f"actlake: note: {v}: not offered" in out.err for v in left_out)
    for con in (both, *alone):
        con.close()


def test_the_statement_and_the_runs_are_told_apart(tmp_path):
    from actlake.errors import ActlakeError
    from actlake.jobs.cli import _runs_and_sql

    long = "SELECT " + "x" * 300 + " FROM t"  # a name too long for a file: no OSError
    assert _runs_and_sql(["a", long]) == (["a"], long)
    like = "SELECT * FROM documents WHERE file LIKE 's3://%'"
    assert _runs_and_sql(["s3://b/r1", like]) == (["s3://b/r1"], like)
    (tmp_path / "r2").mkdir()
    assert _runs_and_sql(["s3://b/r1", str(tmp_path / "r2")]) == (["s3://b/r1", str(tmp_path / "r2")], None)
    with pytest.raises(ActlakeError, match="nowhere: no such run folder"):
        _runs_and_sql(["s3://b/r1", "nowhere"])


def test_a_recorded_view_stands_in_a_subquery_without_its_semicolon():
    import duckdb

    from actlake.storage.sql import _without_terminator

    for sql in ("SELECT 1 AS x;", "SELECT 1 AS x; -- done", "SELECT 1 AS x -- a comment; not a terminator",
                "WITH e AS (SELECT ';' AS x) SELECT 1 AS x FROM e ;  /* z */ "):
        assert duckdb.sql(f"SELECT * FROM (\n{_without_terminator(sql)}\n)").fetchall() == [(1,)], sql


def test_report_compares_runs_side_by_side(run_dir, other_run, tmp_path, capsys):
    """``actlake report --compare``: a page with a chart per shared headline statistic; each run's line holds
    what that run alone gives."""
    import warnings
    from pathlib import Path

    import pandas as pd

    import actlake
    from actlake.jobs.extract.report import comparison_blocks

    assert main(["report", "--compare", run_dir, other_run, "--out", str(tmp_path / "cmp")]) == 0
    page = Path(capsys.readouterr().out.strip().splitlines()[-1])
    assert page == tmp_path / "cmp" / "report" / "report.html" and Path(run_dir).name in page.read_text()
    for slug in ("compare_residual_norms", "compare_first_token_mass", "compare_massive_activations", "compare_outliers"):
        assert (page.parent / f"{slug}.png").read_bytes()[:4] == b"\x89PNG"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the view one run lacks
        both = actlake.open_runs([run_dir, other_run])
    blocks = {slug: chart.data for slug, _, chart in comparison_blocks(both)}
    both.close()
    for run in (run_dir, other_run):
        con = actlake.open_run(run)
        own = con.execute("SELECT layer, avg(norm) AS value FROM residual_norms GROUP BY layer ORDER BY layer").df()
        con.close()
        drawn = blocks["compare_residual_norms"]
        drawn = drawn[drawn.run == Path(run).name][["layer", "value"]].reset_index(drop=True)
        pd.testing.assert_frame_equal(own, drawn, check_dtype=False)
    assert main(["report", run_dir, other_run]) == 2  # several runs without --compare: one line, status 2
    assert "with --compare" in capsys.readouterr().err


def test_a_closed_pipe_ends_the_query_at_once_quietly(run_dir):
    """`actlake sql … --format csv | head -1`: the reader goes away after one line; the query ends at once with
    exit 0 and nothing on standard error (it printed a BrokenPipeError traceback, hung until the time limit and
    then blamed the limit)."""
    import subprocess
    import sys
    from pathlib import Path

    actlake = str(Path(sys.executable).parent / "actlake")
    p = subprocess.Popen([actlake, "sql", str(run_dir), "SELECT * FROM residual_norms, range(50)", "--format", "csv",
                          "--timeout", "120"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = p.stdout.readline()
    p.stdout.close()
    rc = p.wait(timeout=100)  # well under the query's own 120 s limit: it did not run to it
    err = p.stderr.read().decode()
    assert first.startswith(b"\"doc_id\",") and rc == 0 and err == "", (first, rc, err)


def test_output_files_for_every_format_and_never_inside_a_run(run_dir, tmp_path, capsys):
    """-o writes csv and json too (it printed to standard output and wrote nothing); a file inside the run folder
    (which would replace a committed Parquet file) and a symbolic link are refused before the query runs."""
    import json

    import pyarrow.csv as pacsv

    sql = "SELECT layer, count(*) AS n FROM residual_norms GROUP BY 1 ORDER BY 1"
    assert main(["sql", str(run_dir), sql, "--format", "csv"]) == 0
    want = capsys.readouterr().out
    assert main(["sql", str(run_dir), sql, "--format", "csv", "-o", str(tmp_path / "a.csv")]) == 0
    assert "wrote" in capsys.readouterr().out and (tmp_path / "a.csv").read_text() == want
    assert main(["sql", str(run_dir), sql, "--format", "json", "-o", str(tmp_path / "a.json")]) == 0
    rows = [json.loads(line) for line in (tmp_path / "a.json").read_text().splitlines()]
    assert rows == pacsv.read_csv(tmp_path / "a.csv").to_pylist()
    committed = next(Path(run_dir).rglob("*.parquet"))
    before = committed.read_bytes()
    link = tmp_path / "link.csv"
    link.symlink_to(tmp_path / "a.csv")
    for target, why in [(committed, "is inside the run folder"), (Path(run_dir) / "new.csv", "is inside the run folder"),
                        (link, "is a symbolic link")]:
        assert main(["sql", str(run_dir), sql, "--format", "csv", "-o", str(target)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("actlake: error: --output: ") and why in err[0], err
    assert committed.read_bytes() == before and not (Path(run_dir) / "new.csv").exists()
