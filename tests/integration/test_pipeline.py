"""End-to-end jobs on real Ray with real models: tables equal an independent computation."""

from __future__ import annotations

import html
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from actlake.categories import ROLE
from actlake.jobs.extract.run import run_job
from actlake.storage.sql import open_run
from tests.conftest import FAMILIES, job_config

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.usefixtures("kept_workers")]


def _reference(model_path, con):
    """Norms and attention mass from output_hidden_states / output_attentions (eager), window by window."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(model_path, attn_implementation="eager").eval()
    causal = model.config.model_type != "bert"
    toks = con.sql("SELECT doc_id, window_index, position, token_id, role FROM tokens ORDER BY doc_id, window_index, position").fetchall()
    windows: dict = {}
    for doc, win, pos, tid, role in toks:
        windows.setdefault((doc, win), []).append((tid, ROLE.index(role)))
    norms, mass = {}, None
    with torch.no_grad():
        for (doc, win), rows in windows.items():
            ids = torch.tensor([[t for t, _ in rows]])
            role = torch.tensor([r for _, r in rows])
            out = model(input_ids=ids, output_hidden_states=True, output_attentions=True)
            for layer, h in enumerate(out.hidden_states):
                for pos, v in enumerate(h[0].double().norm(dim=-1).tolist()):
                    norms[(doc, win, pos, layer)] = v
            att = torch.stack(out.attentions)[:, 0].double()  # (L, H, T, T)
            if mass is None:
                mass = np.zeros(att.shape[:2] + (len(ROLE), len(ROLE)))
            oh = torch.nn.functional.one_hot(role, len(ROLE)).double()  # (T, C)
            mass += torch.einsum("lhmn,mq,nk->lhqk", att, oh, oh).numpy()
            if causal:  # explicit weights are already causal; nothing else to mask
                pass
    return norms, mass


def _check_against_reference(run_dir, model_path):
    con = open_run(run_dir)
    norms, mass = _reference(model_path, con)
    got = con.sql("SELECT doc_id, window_index, position, layer, norm FROM residual_norms").fetchall()
    assert len(got) == len(norms)
    worst = max(abs(n - norms[(d, w, p, l)]) / max(1e-6, abs(norms[(d, w, p, l)])) for d, w, p, l, n in got)
    assert worst < 1e-4
    rows = con.sql("SELECT layer, head, query_category, key_category, mass FROM attention_mass").fetchall()
    table = np.zeros_like(mass)
    for layer, head, q, k, m in rows:
        table[layer, head, ROLE.index(q), ROLE.index(k)] = m
    np.testing.assert_allclose(table, mass, rtol=1e-4, atol=1e-4)
    n_tokens = con.execute("SELECT count(*) FROM tokens").fetchall()[0][0]
    np.testing.assert_allclose(table.sum((2, 3)), n_tokens, rtol=1e-6)  # every query's weights sum to 1


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_models_match_output_attentions(family, tiny_models, sample_corpus, tmp_path, ray_local):
    cfg = job_config(tiny_models[family], sample_corpus, tmp_path, **{"corpus.max_docs": 12})
    res = run_job(cfg)
    assert res.shards_run == res.shards_total == 2
    _check_against_reference(res.run_dir, tiny_models[family])


def test_minilm_matches_output_attentions_and_reruns_are_idempotent(minilm_path, sample_corpus, tmp_path, ray_local):
    cfg = job_config(minilm_path, sample_corpus, tmp_path, **{"corpus.max_docs": 16, "output.run_id": "a"})
    first = run_job(cfg)
    _check_against_reference(first.run_dir, minilm_path)
    snapshot = {p.relative_to(first.run_dir): p.read_bytes() for p in sorted((tmp_path / "a" / "tables").rglob("*.parquet"))}

    summary = (tmp_path / "a" / "summary.json").read_bytes()
    again = run_job(cfg)  # same run id: nothing to do, identical tables
    assert again.shards_run == 0
    assert (tmp_path / "a" / "summary.json").read_bytes() == summary  # the record of the run that did the work
    assert {p.relative_to(first.run_dir): p.read_bytes() for p in sorted((tmp_path / "a" / "tables").rglob("*.parquet"))} == snapshot

    other = run_job(job_config(minilm_path, sample_corpus, tmp_path, **{"corpus.max_docs": 16, "output.run_id": "b"}))
    assert other.shards_run == other.shards_total
    for table in ("tokens", "residual_norms", "dim_moments", "attention_mass", "contributions", "attention_geometry",
                  "attention_by_distance"):
        key = "ALL"
        a = open_run(first.run_dir).sql(f"SELECT * EXCLUDE (shard) FROM {table} ORDER BY {key}" if table in ("tokens", "residual_norms")
                                        else f"SELECT * FROM {table} ORDER BY {key}").fetchall()
        b = open_run(other.run_dir).sql(f"SELECT * EXCLUDE (shard) FROM {table} ORDER BY {key}" if table in ("tokens", "residual_norms")
                                        else f"SELECT * FROM {table} ORDER BY {key}").fetchall()
        assert a == b, table


def test_merge_order_does_not_change_aggregates(minilm_path, sample_corpus, tmp_path, ray_local):
    import json

    from actlake.analysis.registry import builtin
    from actlake.jobs.extract.reduce import merge_partials
    from actlake.storage.layout import RunLayout
    from actlake.storage.manifest import REDUCE_RECORD

    # commit_seconds tiny: the worker commits after every shard, one group (and partial) per shard
    res = run_job(job_config(minilm_path, sample_corpus, tmp_path, **{"corpus.max_docs": 24, "sharding.docs_per_shard": 6,
                                                                      "sharding.commit_seconds": 0.001}))
    layout = RunLayout(Path(res.run_dir))
    records = [json.loads(p.read_text()) for p in sorted(layout.complete.glob("group-*.json"))]
    assert len(records) == res.shards_total >= 4 and all(len(r["shards"]) == 1 for r in records)
    published = json.loads((layout.complete / REDUCE_RECORD).read_text())["files"]
    orders = [records[::-1], [records[2], records[0], *records[3:], records[1]]]
    for cls in (c for c in builtin().values() if c.tables[0] in published):  # the ones on by default
        forward = merge_partials(layout, records, cls).to_tables()
        others = [merge_partials(layout, o, cls).to_tables() for o in orders]
        others.append({t: pq.read_table(layout.root / published[t]["path"]) for t in cls.tables})  # what the job published
        for other in others:
            for name, table in forward.items():
                for col in table.column_names:
                    a, b = table[col].to_numpy(zero_copy_only=False), other[name][col].to_numpy(zero_copy_only=False)
                    if a.dtype.kind == "f":
                        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)
                    else:
                        assert (a == b).all()


def test_bad_corpus_file_fails_with_one_clear_message(minilm_path, tmp_path, ray_local, capsys):
    from actlake.jobs.cli import main

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "bad.jsonl.zst").write_bytes(b"this is not zstd at all" * 10)
    cfg = tmp_path / "job.yaml"
    cfg.write_text(f"model:\n  name_or_path: {minilm_path}\ncorpus:\n  paths: ['{corpus}/*.zst']\noutput:\n  dir: {tmp_path}/runs\n")
    assert main(["run", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "bad.jsonl.zst" in err and "cannot read corpus file" in err


def test_missing_model_folder_is_one_clear_error(sample_corpus, tmp_path, capsys):
    from actlake.jobs.cli import main

    cfg = tmp_path / "job.yaml"
    cfg.write_text(f"model:\n  name_or_path: {tmp_path}/missing-model\ncorpus:\n  paths: ['{sample_corpus}/*.zst']\n")
    assert main(["run", str(cfg)]) == 2
    err = [l for l in capsys.readouterr().err.splitlines() if "error" in l]
    assert len(err) == 1 and "model folder not found" in err[0] and "missing-model" in err[0]


@pytest.mark.parametrize("fmt", ["parquet", "hf"])
def test_parquet_and_hf_dataset_corpora_give_the_same_tokens_as_jsonl(fmt, tiny_models, sample_corpus, tmp_path, ray_local):
    import json

    import pyarrow as pa

    rows = [json.loads(l) for l in (sample_corpus / "00.jsonl").read_text().splitlines()][:6]
    flat = {"text": [r["text"] for r in rows], "meta": [r["meta"] for r in rows]}
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "00.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if fmt == "parquet":
        pq.write_table(pa.table(flat), tmp_path / "c" / "00.parquet")
        over = {"corpus.paths": [str(tmp_path / "c" / "00.parquet")]}
    else:
        import datasets

        datasets.Dataset.from_dict(flat).save_to_disk(str(tmp_path / "hf"))
        over = {"corpus.format": "hf", "corpus.hf_dataset": str(tmp_path / "hf"), "corpus.paths": []}
    base = run_job(job_config(tiny_models["bert"], tmp_path / "c", tmp_path / "a",
                              **{"corpus.paths": [str(tmp_path / "c" / "00.jsonl")]}))
    other = run_job(job_config(tiny_models["bert"], tmp_path / "c", tmp_path / "b", **over))
    q = "SELECT doc_id, window_index, position, token_id, source FROM tokens ORDER BY ALL"
    assert open_run(base.run_dir).sql(q).fetchall() == open_run(other.run_dir).sql(q).fetchall()
    assert open_run(other.run_dir).execute("SELECT count(*) FROM documents").fetchall()[0][0] == 6


def test_attention_only_run_skips_hidden_states_and_gives_the_same_attention_tables(tiny_models, sample_corpus,
                                                                                   tmp_path, ray_local):
    over = {"corpus.max_docs": 6}
    full = run_job(job_config(tiny_models["gpt2"], sample_corpus, tmp_path / "full", **over))
    lean = run_job(job_config(tiny_models["gpt2"], sample_corpus, tmp_path / "lean", **over,
                              **{"analyses.residual_norms": False, "analyses.dim_moments": False}))
    tables = {p.name for p in (Path(lean.run_dir) / "tables").iterdir()}
    assert "residual_norms" not in tables and "dim_moments" not in tables and "contributions" in tables
    q = "SELECT * FROM attention_mass ORDER BY ALL"
    assert open_run(full.run_dir).execute(q).fetchall() == open_run(lean.run_dir).execute(q).fetchall()


def test_fused_attention_weights_give_the_same_mass_and_geometry_tables(tiny_models, sample_corpus, tmp_path, ray_local):
    """analyses.attention_weights: fused (one-hot V through the kernel, the model's own SDPA output)
    against the default explicit weights (whose output replaces the kernel's): same tables."""
    over = {"corpus.max_docs": 6}
    explicit = run_job(job_config(tiny_models["llama"], sample_corpus, tmp_path / "explicit", **over))
    fused = run_job(job_config(tiny_models["llama"], sample_corpus, tmp_path / "fused", **over,
                               **{"analyses.attention_weights": "fused", "analyses.contributions": {"weighted": False},
                                  "analyses.attention_by_distance": False}))
    for table, keys, cols in (
            ("attention_mass", "layer, head, query_category, key_category", "mass"),
            ("attention_geometry", "layer, head, key_category", "mass, mass_keynorm, cos_sum, k_norm_sum"),
            ("contributions", "layer, head, key_category, query_category, dim", "contribution_sum, bias_sum")):
        q = f"SELECT {cols} FROM {table} ORDER BY {keys}"
        a = np.array(open_run(explicit.run_dir).execute(q).fetchall(), dtype=float)
        b = np.array(open_run(fused.run_dir).execute(q).fetchall(), dtype=float)
        assert a.shape == b.shape and len(a) > 0
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    tables = {p.name for p in (Path(fused.run_dir) / "tables").iterdir()}
    assert "attention_by_distance" not in tables


def test_a_decoder_without_a_first_special_token_is_told_about_prepend_bos(tiny_models, sample_corpus, tmp_path,
                                                                          ray_local, caplog):
    """The tiny GPT-2's tokenizer puts nothing first: the job's output and the report say the first-token
    statistics are empty and name tokenization.prepend_bos; with it set, the note is gone."""
    import logging

    from actlake.analysis.attention_mass import NO_FIRST_TOKEN
    from actlake.jobs.extract.report import build_report

    with caplog.at_level(logging.WARNING, logger="actlake.run"):
        res = run_job(job_config(tiny_models["gpt2"], sample_corpus, tmp_path / "a", **{"corpus.max_docs": 4}))
    assert any("tokenization.prepend_bos: true" in r.getMessage() for r in caplog.records), caplog.text
    assert html.escape(NO_FIRST_TOKEN) in build_report(res.run_dir).read_text()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="actlake.run"):
        res = run_job(job_config(tiny_models["gpt2"], sample_corpus, tmp_path / "b", **{
            "corpus.max_docs": 4, "tokenization.prepend_bos": True}))
    assert not any("prepend_bos" in r.getMessage() for r in caplog.records), caplog.text
    assert html.escape(NO_FIRST_TOKEN) not in build_report(res.run_dir).read_text()
