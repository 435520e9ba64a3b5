"""``analyses.by_source``: every statistics table by document source. A source's rows equal a run over only
that source's documents; the rows ``source = '*'`` equal a run without ``by_source``; too many labels is one
error naming ``analyses.max_sources``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from actlake.errors import ConfigError
from actlake.jobs.extract.run import run_job
from actlake.storage.sql import open_run
from tests.conftest import job_config

pytestmark = pytest.mark.usefixtures("kept_workers")

STATISTICS = ("dim_moments", "attention_mass", "contributions", "attention_geometry", "attention_by_distance")
VIEWS = ("outliers", "massive_activations", "attention_mass_by_key", "contributions_mean")


def _corpus(sample_corpus: Path, out: Path, keep=lambda source: True) -> Path:
    """The sample corpus's first 15 documents of three sources (interleaved), as one jsonl, those ``keep`` takes."""
    from actlake.corpus.readers import iter_range

    records = [r for f in sorted(sample_corpus.glob("*.jsonl")) for r in iter_range(str(f), "jsonl", 0, 20, "text", "meta.pile_set_name")]
    by = {}
    for r in records:
        by.setdefault(r.source, []).append(r)
    sources = sorted(by)[:3]
    docs = [by[s][i] for i in range(5) for s in sources]
    out.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"text": r.text, "meta": {"pile_set_name": r.source}}) for r in docs if keep(r.source)]
    (out / "part.jsonl").write_text("\n".join(lines) + "\n")
    return out


def _rows(run_dir, table: str, source: str):
    """(key columns, float columns) of a table's (or view's) rows of one source, in key order: by its name
    for every document, ``<table>_by_source`` for a label."""
    con = open_run(run_dir)
    table = table if source == "*" else f"{table}_by_source"
    cols = con.execute(f"SELECT column_name, data_type FROM information_schema.columns WHERE table_name = '{table}'"
                       " ORDER BY ordinal_position").fetchall()
    keys = [c for c, t in cols if t not in ("DOUBLE", "FLOAT") and c not in ("source", "rank")]  # rank: ties may flip
    vals = [c for c, t in cols if t in ("DOUBLE", "FLOAT")]
    rows = con.execute(f"SELECT {', '.join(keys + vals)} FROM {table} WHERE source = ? ORDER BY {', '.join(keys)}",
                       [source]).fetchall()
    return [r[:len(keys)] for r in rows], np.array([r[len(keys):] for r in rows], dtype=float)


def _same(run_a, source_a: str, run_b, source_b: str, what: str, rtol: float) -> None:
    """Equal rows; each column within ``rtol`` of its largest |value| (sums of float32 terms that cancel)."""
    keys_a, a = _rows(run_a, what, source_a)
    keys_b, b = _rows(run_b, what, source_b)
    assert keys_a == keys_b and len(keys_a) > 0, what
    assert (np.isnan(a) == np.isnan(b)).all(), what
    diff = np.nan_to_num(np.abs(a - b)).max(axis=0, initial=0.0)  # per column
    scale = np.nan_to_num(np.abs(b)).max(axis=0, initial=0.0)
    assert (diff <= rtol * scale).all(), f"{what} {source_a} vs {source_b}: largest differences {diff} of {scale}"


def _run(model, corpus: Path, out: Path, **over):
    return run_job(job_config(model, corpus, out, **{"corpus.paths": [str(corpus / "*.jsonl")], "sharding.docs_per_shard": 4,
                                                     "sharding.commit_seconds": 0.001, **over}))


def test_each_source_equals_a_run_over_its_documents_and_star_equals_a_plain_run(tiny_models, sample_corpus,
                                                                                  tmp_path, ray_local):
    model = tiny_models["bert"]
    corpus = _corpus(sample_corpus, tmp_path / "all")
    split = _run(model, corpus, tmp_path / "split", **{"analyses.by_source": True})
    plain = _run(model, corpus, tmp_path / "plain")
    con = open_run(split.run_dir)
    labels = sorted(r[0] for r in con.execute("SELECT DISTINCT source FROM attention_mass_by_source").fetchall())
    assert len(labels) == 4 and "*" in labels  # three sources and every document
    for name in STATISTICS + VIEWS:  # by its name, a table or view holds the rows over every document
        assert {r[0] for r in con.execute(f"SELECT DISTINCT source FROM {name}").fetchall()} == {"*"}, name
    con.close()
    plain_con = open_run(plain.run_dir)
    assert not plain_con.execute("SELECT * FROM information_schema.tables WHERE table_name LIKE '%_by_source'").fetchall()
    plain_con.close()
    for what in STATISTICS + VIEWS:  # other batches (not split by source): the model's float32 values round otherwise
        _same(split.run_dir, "*", plain.run_dir, "*", what, rtol=1e-6)
    one = labels[1]
    alone = _run(model, _corpus(sample_corpus, tmp_path / "one", keep=lambda s: s == one), tmp_path / "alone")
    for what in STATISTICS + VIEWS:  # other shards, so other batches: float32 rounding again
        _same(split.run_dir, one, alone.run_dir, "*", what, rtol=1e-6)
    # the sums add up: the three sources' valid queries are every document's
    n = open_run(split.run_dir).execute(
        "SELECT source = '*', sum(n_queries) FROM attention_mass_by_source GROUP BY ALL ORDER BY ALL").fetchall()
    assert n[0][1] == n[1][1] > 0
    _report_draws_a_line_per_source(split.run_dir, [x for x in labels if x != "*"])


def _report_draws_a_line_per_source(run_dir, labels) -> None:
    """The report's by-source section: each source's line of first-token mass is that source's rows."""
    from actlake.jobs.extract.report import build_report, comparison_blocks

    page = build_report(run_dir)
    assert "By source: attention mass on the leading special token" in page.read_text()
    assert (page.parent / "by_source_first_token_mass.png").read_bytes()[:4] == b"\x89PNG"
    con = open_run(run_dir)
    drawn = {slug: chart.data for slug, _, chart in comparison_blocks(con, series="source")}["by_source_first_token_mass"]
    assert sorted(set(drawn.source)) == labels
    for label in set(drawn.source):
        own = con.execute("SELECT layer, avg(mean_mass) FROM attention_mass_by_key_by_source WHERE source = ? "
                          "AND key_category = 'bos' "
                          "GROUP BY layer ORDER BY layer", [label]).fetchall()
        line = drawn[drawn.source == label]
        np.testing.assert_allclose(line.value.to_numpy(), [v for _, v in own], rtol=1e-12)
    con.close()


def test_more_source_labels_than_max_sources_is_one_error_naming_the_key(tiny_models, sample_corpus, tmp_path, ray_local):
    corpus = _corpus(sample_corpus, tmp_path / "all")
    with pytest.raises(ConfigError, match=r"analyses.max_sources: the corpus has at least 3 source labels .* = 2"):
        _run(tiny_models["bert"], corpus, tmp_path / "run", **{"analyses.by_source": True, "analyses.max_sources": 2})


def test_a_parquet_corpus_with_too_many_labels_is_refused_before_ray(tiny_models, tmp_path):
    """Parquet (and Hugging Face datasets): the labels are listed from the source column at planning, so the
    error comes before Ray starts and before the run folder exists; within max_docs' rows only."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"text": f"document number {i}", "meta": {"pile_set_name": s}} for i, s in enumerate("ABCAB")]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "c.parquet", row_group_size=2)
    over = {"corpus.paths": [str(tmp_path / "c.parquet")], "analyses.by_source": True, "analyses.max_sources": 2}
    cfg = job_config(tiny_models["bert"], tmp_path, tmp_path / "out", **over)
    with pytest.raises(ConfigError, match=r"^analyses.max_sources: the corpus has at least 3 source labels \(A, B, C\)"):
        run_job(cfg)
    assert not (tmp_path / "out" / cfg.run_id).exists()
    from actlake.jobs.extract.plan import plan_with_inputs, planned_labels

    two = job_config(tiny_models["bert"], tmp_path, tmp_path / "out", **over, **{"corpus.max_docs": 2})
    assert planned_labels(two, plan_with_inputs(two)[0]) == {"A", "B"}
