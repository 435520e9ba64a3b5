"""Surprisal in the tokens table and the activation store, against the models' own outputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from actlake.jobs.extract.run import run_job
from actlake.storage.activations import read_windows
from actlake.storage.sql import open_run
from tests.conftest import job_config

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("kept_workers")]

LIGHT = {"analyses.contributions": False, "analyses.geometry": False, "analyses.attention_by_distance": False,
         "corpus.max_docs": 8}


def _windows(con):
    rows = con.sql("SELECT doc_id, window_index, token_id FROM tokens ORDER BY doc_id, window_index, position").fetchall()
    out: dict = {}
    for doc, win, tid in rows:
        out.setdefault((doc, win), []).append(tid)
    return out


@pytest.mark.parametrize("family", ["gpt2", "gpt_neox", "llama"])
def test_surprisal_equals_log_softmax_of_the_models_logits(family, tiny_models, sample_corpus, tmp_path, ray_local):
    from transformers import AutoModelForCausalLM

    res = run_job(job_config(tiny_models[family], sample_corpus, tmp_path, **LIGHT))
    con = open_run(res.run_dir)
    got = {(d, w, p): s for d, w, p, s in con.sql("SELECT doc_id, window_index, position, surprisal FROM tokens").fetchall()}
    model = AutoModelForCausalLM.from_pretrained(tiny_models[family], attn_implementation="eager").eval()
    checked = 0
    with torch.no_grad():
        for (doc, win), ids in _windows(con).items():
            logits = model(input_ids=torch.tensor([ids])).logits[0].double()  # (T, V)
            ref = -torch.log_softmax(logits, -1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
            assert got[(doc, win, 0)] is None  # no context for the first token of a window
            for pos in range(1, len(ids)):
                assert got[(doc, win, pos)] == pytest.approx(ref[pos - 1].item(), rel=1e-4, abs=1e-4)
                checked += 1
    assert checked > 100


def test_bert_has_no_surprisal_and_asking_for_it_is_an_error(minilm_path, sample_corpus, tmp_path, ray_local):
    from actlake.config import ModelConfig
    from actlake.errors import ModelLoadError
    from actlake.model import load_model

    res = run_job(job_config(minilm_path, sample_corpus, tmp_path, **LIGHT))
    con = open_run(res.run_dir)
    assert con.execute("SELECT count(surprisal) FROM tokens").fetchall()[0][0] == 0
    with pytest.raises(ModelLoadError, match="surprisal needs a causal LM"):
        load_model(ModelConfig(name_or_path=minilm_path), lm_head=True)


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-6), ("float16", 1e-3)])
def test_activation_store_round_trips_through_duckdb(dtype, tol, tiny_models, sample_corpus, tmp_path, ray_local):
    from transformers import AutoModel

    path = tiny_models["gpt_neox"]
    cfg = job_config(path, sample_corpus, tmp_path, **LIGHT, **{
        "activations.layers": [0, -1], "activations.fraction": 0.5, "activations.seed": 3, "activations.dtype": dtype})
    res = run_job(cfg)
    con = open_run(res.run_dir)
    all_windows = _windows(con)
    stored = con.execute("SELECT count(DISTINCT (doc_id, window_index)) FROM activations").fetchall()[0][0]
    assert 0 < stored < len(all_windows)  # a sample, not everything
    typ = con.execute("SELECT typeof(h) FROM activations LIMIT 1").fetchall()[0][0]
    assert typ == "FLOAT[32]"  # a fixed-size array in SQL, whatever the stored precision
    model = AutoModel.from_pretrained(path).eval()
    n_layers = model.config.num_hidden_layers
    for layer in (0, n_layers):
        h, valid, meta = read_windows(con, layer)
        assert h.shape[0] == stored and h.shape[2] == 32
        with torch.no_grad():
            for i, (doc, win) in enumerate(zip(meta["doc_id"], meta["window_index"])):
                ids = all_windows[(int(doc), int(win))]
                ref = model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states[layer][0].numpy()
                assert valid[i].sum() == len(ids)
                scale = np.abs(ref).max()
                np.testing.assert_allclose(h[i, : len(ids)], ref, atol=tol * scale * 4, rtol=tol)
    # the same windows are sampled whatever the sharding: a deterministic function of (seed, doc, window)
    cfg2 = job_config(path, sample_corpus, tmp_path, **LIGHT, **{
        "activations.layers": [0], "activations.fraction": 0.5, "activations.seed": 3, "sharding.docs_per_shard": 3})
    con2 = open_run(run_job(cfg2).run_dir)
    q = "SELECT DISTINCT doc_id, window_index FROM activations ORDER BY 1, 2"
    assert con.sql(q).fetchall() == con2.sql(q).fetchall()
