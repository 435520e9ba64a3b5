"""The built-in ``attention_peak`` (added as one module and one registry line: issue 49): the mean of each query's
largest attention weight per layer, query category and head equals eager attention's, for a bidirectional and a
causal model; the statistics of two halves of a batch merge into those of the whole."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from actlake.categories import ROLE
from actlake.jobs.extract.try_analysis import try_analysis

pytestmark = pytest.mark.integration
TEXTS = ["The cat sat on the mat, and then it slept.", "def f(x):\n    return x * 2  # twice", "Short one."]


def _reference(path) -> dict:
    """(layer, query_category, head) -> summed peak weight, from the model's own eager attention weights over the
    windows try-analysis cuts (its config, its tokenizer) and the categories actlake gives their tokens."""
    from transformers import AutoModel, AutoTokenizer

    from actlake.batching import document_windows
    from actlake.categories import Categorizer
    from actlake.jobs.extract.try_analysis import job_config

    cfg = job_config("attention_peak", path)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path, attn_implementation="eager").eval()
    want: dict = {}
    with torch.no_grad():
        for text in TEXTS:
            for ids in document_windows(tok, text, cfg.tokenization)[0]:
                role = Categorizer(tok).batch(np.array([ids]), np.array([len(ids)]))[0][0]  # (T,) role ids
                att = torch.stack(model(input_ids=torch.tensor([ids]), output_attentions=True).attentions)[:, 0]
                peak = att.double().amax(-1)  # (L, H, T)
                for (layer, head, t), v in zip(torch.cartesian_prod(*map(torch.arange, peak.shape)).tolist(),
                                               peak.flatten().tolist()):
                    key = (layer, ROLE[int(role[t])], head)
                    want[key] = want.get(key, 0.0) + v
    return want


@pytest.mark.parametrize("family", ["minilm", "llama"])
def test_attention_peak_equals_eager_attention(family, request, tiny_models):
    path = request.getfixturevalue("minilm_path") if family == "minilm" else str(tiny_models["llama"])
    tables = try_analysis("attention_peak", TEXTS, model=path)
    got = tables["attention_peak"].to_pydict()
    want = _reference(path)
    have = {(l, c, h): s for l, c, h, s in zip(got["layer"], got["query_category"], got["head"], got["peak_sum"])}
    assert set(want) <= set(have) and all(have[k] == 0 for k in set(have) - set(want))
    for k, v in want.items():
        assert have[k] == pytest.approx(v, rel=1e-5), k
    assert 0 < min(tables["attention_peak_mean"]["mean_peak"].drop_null().to_pylist()) <= 1


def test_two_halves_merge_into_the_whole(minilm_path, tmp_path):
    from actlake.batching import Window, document_windows
    from actlake.jobs.extract.driver import Extractor
    from actlake.model import load_model
    from tests.conftest import job_config

    cfg = job_config(minilm_path, tmp_path, tmp_path / "out", **{"analyses.attention_peak": True})
    forward = Extractor(cfg, load_model(cfg.model)).forward
    windows = [Window(i, 0, document_windows(forward.lm.tokenizer, t, cfg.tokenization)[0][0], "s")
               for i, t in enumerate(TEXTS)]
    whole = forward.run_batch(windows).stats["attention_peak"]
    a, b = (forward.run_batch(part).stats["attention_peak"] for part in (windows[:1], windows[1:]))
    merged = a.merge(b)
    # float32 weights: the batches pad differently
    assert torch.allclose(merged.peak, whole.peak, rtol=1e-5, atol=1e-5) and torch.equal(merged.n_queries, whole.n_queries)
    assert float(whole.n_queries.sum()) == sum(len(w.ids) for w in windows) * whole.peak.shape[0]
    assert len(ROLE) == whole.peak.shape[1]
