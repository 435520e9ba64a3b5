"""Model loading: safetensors only unless pickle is allowed; clear errors for bad folders and families."""

from __future__ import annotations

import pytest
import torch

from actlake.config import ModelConfig
from actlake.errors import ModelLoadError
from actlake.model import load_model

pytestmark = pytest.mark.integration


def test_pickle_weights_need_explicit_opt_in(tiny_models, tmp_path):
    from transformers import AutoModel, AutoTokenizer

    src = tiny_models["gpt2"]
    out = tmp_path / "pickled"
    model = AutoModel.from_pretrained(src)
    model.config.save_pretrained(out)
    torch.save(model.state_dict(), out / "pytorch_model.bin")  # the legacy pickle format
    AutoTokenizer.from_pretrained(src).save_pretrained(out)
    assert (out / "pytorch_model.bin").exists() and not list(out.glob("*.safetensors"))
    with pytest.raises(ModelLoadError, match="allow_pickle"):
        load_model(ModelConfig(name_or_path=str(out)))
    lm = load_model(ModelConfig(name_or_path=str(out), allow_pickle=True))
    ref = load_model(ModelConfig(name_or_path=str(src)))
    ids = torch.tensor([[3, 4, 5]])
    with torch.no_grad():
        torch.testing.assert_close(lm.model(input_ids=ids).last_hidden_state, ref.model(input_ids=ids).last_hidden_state)


def test_unsupported_family_and_empty_folder(tmp_path):
    from transformers import T5Config

    folder = tmp_path / "t5"
    folder.mkdir()
    T5Config(d_model=16, num_layers=1, num_heads=2, d_kv=8, d_ff=32, vocab_size=50).save_pretrained(folder)
    (folder / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="'t5' is not supported"):
        load_model(ModelConfig(name_or_path=str(folder)))
    (folder / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no weight files"):
        load_model(ModelConfig(name_or_path=str(folder)))


def test_bfloat16_model_gives_the_same_tables_within_tolerance(tiny_models):
    """bf16 activations, float32 analysis, float64 sums: attention mass within 2e-2 of float32."""
    import numpy as np

    from actlake.analysis.attention_mass import AttentionMass

    def mass(dtype):
        from actlake.analysis.engine import capture
        from actlake.analysis.engine.recorder import AttentionRecorder, ModelQK
        from actlake.categories import ROLE, one_hot

        lm = load_model(ModelConfig(name_or_path=str(tiny_models["llama"]), dtype=dtype))
        capture.install(lm.model)
        mqk = ModelQK(lm.model, lm.family)
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(5, 300, (2, 12), generator=g)
        valid = torch.ones(2, 12, dtype=torch.long)
        role = torch.randint(0, len(ROLE), (2, 12), generator=g)
        stats = AttentionMass.zeros(mqk.n_layers, mqk.n_heads)
        rec = AttentionRecorder(mqk, valid, one_hot(role, len(ROLE), valid), [stats.add_layer], needs=stats.products,
                                on_excluded=[stats.nonfinite_excluded])
        with torch.no_grad(), capture.recording(rec):
            lm.model(input_ids=ids, attention_mask=valid)
        return stats.mass

    full, half = mass("float32"), mass("bfloat16")
    assert np.abs(full - half).max() / np.abs(full).max() < 2e-2
    np.testing.assert_allclose(half.sum((2, 3)), full.sum((2, 3)), rtol=1e-5)  # weights still sum to 1 per query


def test_a_worker_that_cannot_load_the_model_fails_the_job_with_the_reason(tiny_models, sample_corpus, tmp_path, ray_local):
    from transformers import AutoModel

    from actlake.errors import ActlakeError
    from actlake.jobs.extract.run import run_job
    from tests.conftest import job_config

    out = tmp_path / "pickled"
    model = AutoModel.from_pretrained(tiny_models["bert"])
    model.config.save_pretrained(out)
    torch.save(model.state_dict(), out / "pytorch_model.bin")
    for f in tiny_models["bert"].glob("tokenizer*"):
        (out / f.name).write_bytes(f.read_bytes())
    cfg = job_config(out, sample_corpus, tmp_path / "runs", **{"corpus.max_docs": 4})
    with pytest.raises(ActlakeError, match="allow_pickle"):
        run_job(cfg)


def test_minilm_in_bfloat16_gives_the_float32_tables_within_the_stated_tolerance(minilm_path, sample_corpus):
    """The README's bf16 tolerances, on the real model and real text: every attention table and the
    outlier moments of a bf16 run against a float32 run of the same windows."""
    import numpy as np

    from actlake.batching import Window, document_windows
    from actlake.config import TokenizationConfig, parse_config
    from actlake.corpus.readers import Record, iter_items
    from actlake.jobs.extract.driver import Extractor

    def run(dtype):
        lm = load_model(ModelConfig(name_or_path=minilm_path, dtype=dtype))
        path = str(sorted(sample_corpus.glob("*.jsonl"))[0])
        windows = []
        for item in iter_items(path, "jsonl", 0, 12, "text", "meta.pile_set_name"):
            if isinstance(item, Record):
                ids = document_windows(lm.tokenizer, item.text, TokenizationConfig(max_length=64))[0][0]
                windows.append(Window(len(windows), 0, ids, item.source))
        ex = Extractor(parse_config({"name": "t", "model": {"name_or_path": minilm_path, "dtype": dtype},
                                     "tokenization": {"max_length": 64}, "analyses": {"tokens": False}}), lm)
        with torch.inference_mode():
            result = ex.forward.run_batch(windows)
        return result.stats, result.stats["dim_moments"]

    (a, ma), (b, mb) = run("float32"), run("bfloat16")
    per_query = lambda s: s["attention_mass"].mass.sum(2) / s["attention_mass"].n_queries.sum(1)[:, None, None]
    assert np.abs(per_query(a) - per_query(b)).max() < 0.01  # attention per query, absolute
    ga, gb = a["geometry"], b["geometry"]
    keynorm = lambda g: g.mass_keynorm / g.n_queries[:, None, None]
    assert np.abs(keynorm(ga) - keynorm(gb)).max() < 0.01
    cos = lambda g: g.cos / np.maximum(g.n_pairs[:, None], 1)
    assert np.abs(cos(ga) - cos(gb)).max() < 0.01
    assert np.nanmax(np.abs(ga.k_norm - gb.k_norm) / np.abs(ga.k_norm)) < 0.02
    ca, cb = a["contributions"], b["contributions"]

    def rel_to_layer_max(x, y):  # |difference| relative to the layer's largest |value|
        x, y = np.asarray(x), np.asarray(y)
        return (np.abs(x - y) / np.abs(x).reshape(len(x), -1).max(1).reshape((-1,) + (1,) * (x.ndim - 1))).max()

    mean_c = lambda c: c.contrib[:, :, 0] / np.maximum(c.n_pairs[:, 0][:, None, :, None], 1)
    assert rel_to_layer_max(mean_c(ca), mean_c(cb)) < 0.02
    assert rel_to_layer_max(ca.weighted, cb.weighted) < 0.03
    assert rel_to_layer_max(ma.moments.mean[:, 0], mb.moments.mean[:, 0]) < 0.03
    da, db = a["attention_by_distance"], b["attention_by_distance"]
    dist = lambda d: d.attn / np.maximum(d.pairs[:, None], 1)
    assert np.abs(dist(da) - dist(db)).max() < 0.01
