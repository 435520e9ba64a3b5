"""The ``logits`` site (issue 49: surprisal a producer): a custom analysis that reads the final hidden state and the
LM head gets exactly the model's own next-token logits, and one that reads them on a model without its head is
refused by name."""

from __future__ import annotations

import textwrap

import pytest
import torch

from actlake.errors import ConfigError

pytestmark = pytest.mark.integration

NLL = textwrap.dedent('''
    import pyarrow as pa
    import torch

    from actlake.analysis.protocol import Analysis


    class NextTokenNLL(Analysis):
        """The summed -log p(token | earlier tokens) of every scored token, from the LM head's logits."""

        name = "next_token_nll"
        sites = frozenset({"logits"})
        tables = ("next_token_nll",)

        @classmethod
        def create(cls, spec, **options):
            out = cls()
            out.total = torch.zeros((), dtype=torch.float64, device=spec.device)
            return out

        def add_logits(self, out):
            lp = torch.log_softmax(out.head(out.last_hidden[:, :-1]).float(), -1)
            nll = -lp.gather(-1, out.ids[:, 1:, None].to(lp.device))[..., 0]
            keep = (out.mask[:, 1:].bool() & out.mask[:, :-1].bool()).to(lp.device)
            self.total = self.total + nll[keep].double().sum()

        def merge(self, other):
            out = type(self)()
            out.total = self.total + other.total
            return out

        def to_tables(self):
            return {"next_token_nll": pa.table({"nll": [float(self.total)]})}

        @classmethod
        def from_tables(cls, tables):
            out = cls()
            out.total = torch.tensor(tables["next_token_nll"]["nll"][0].as_py(), dtype=torch.float64)
            return out
''')

TEXTS = ["The cat sat on the mat, and then it slept for a while.", "def f(x):\n    return x + 1\n\nprint(f(2))"]


def test_a_custom_analysis_reads_the_lm_heads_logits_and_is_refused_without_a_head(tmp_path, minilm_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from actlake.batching import document_windows
    from actlake.jobs.extract.try_analysis import job_config, try_analysis
    from tests.conftest import make_tiny_model

    model = make_tiny_model("gpt2", tmp_path / "gpt2")
    module = tmp_path / "nll_site.py"
    module.write_text(NLL)
    got = try_analysis("nll_site:NextTokenNLL", TEXTS, model=str(model), path=str(module))["next_token_nll"]
    cfg = job_config("nll_site:NextTokenNLL", str(model), str(module))
    tok, lm = AutoTokenizer.from_pretrained(model), AutoModelForCausalLM.from_pretrained(model)
    want, n = 0.0, 0
    with torch.no_grad():
        for text in TEXTS:
            for ids in document_windows(tok, text, cfg.tokenization)[0]:
                logits = lm(torch.tensor([ids])).logits[0, :-1].double()
                want += float(-torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None]).sum())
                n += len(ids) - 1
    assert n > 20
    total = dict(zip(got["source"].to_pylist(), got["nll"].to_pylist()))["*"]
    assert total == pytest.approx(want, rel=1e-5)
    with pytest.raises(ConfigError, match=r"\['next_token_nll'\] read the LM head's logits"):
        try_analysis("nll_site:NextTokenNLL", TEXTS, model=minilm_path, path=str(module))


def test_the_first_batch_checks_the_surprisal_producer_against_the_models_logits(tmp_path):
    """Surprisal, a producer now, is still checked on a worker's first batch against the model's own logits: a
    logit transform the engine applies and the model does not (planted: logits times 1.5) stops the batch."""
    from actlake.errors import AnalysisError
    from actlake.jobs.extract.driver import Extractor
    from actlake.model import load_model
    from tests.conftest import make_tiny_model
    from tests.integration.test_layer_replay import _windows, job_config

    cfg = job_config(make_tiny_model("gpt2", tmp_path / "gpt2"), tmp_path, tmp_path / "out")
    ex = Extractor(cfg, load_model(cfg.model, lm_head=cfg.analyses.surprisal))
    assert [cls.name for cls, _ in ex.forward.token_values] == ["surprisal"]
    ex.forward.run_batch(_windows(ex.lm))  # the model's own: passes
    assert ex.forward.checked
    ex = Extractor(cfg, load_model(cfg.model, lm_head=cfg.analyses.surprisal))
    ex.lm.logit_transform = lambda logits: logits * 1.5
    with pytest.raises(AnalysisError, match=r"surprisal differs from the model's own logits .*affected: surprisal"):
        ex.forward.run_batch(_windows(ex.lm))
    off = job_config(tmp_path / "gpt2", tmp_path, tmp_path / "out2", **{"analyses.surprisal": False})
    assert Extractor(off, load_model(off.model, lm_head=off.analyses.surprisal)).forward.token_values == []


def test_a_job_loads_the_head_for_a_custom_logits_reader_and_refuses_one_before_ray(tmp_path, sample_corpus, minilm_path):
    """In a job: with analyses.surprisal false, a custom analysis that reads the logits still gets the head (its sum
    equals the same analysis run with surprisal on); on a model that is not a causal LM it is refused when the job is
    checked, before any worker starts."""
    import ray

    from actlake.jobs.extract.run import run_job
    from actlake.storage.sql import query
    from tests.conftest import job_config, make_tiny_model

    model = make_tiny_model("gpt2", tmp_path / "gpt2")
    module = tmp_path / "nll_site.py"
    module.write_text(NLL)
    custom = {"analyses.custom": [{"analysis": "nll_site:NextTokenNLL", "path": str(module)}], "corpus.max_docs": 8}
    totals = []
    for surprisal in (False, None):
        cfg = job_config(model, sample_corpus, tmp_path / f"out-{surprisal}", **custom, **{"analyses.surprisal": surprisal})
        run = run_job(cfg).run_dir
        totals.append(query(run, "SELECT nll FROM next_token_nll WHERE source = '*'").to_pylist()[0]["nll"])
    assert totals[0] == pytest.approx(totals[1], rel=1e-9) and totals[0] > 0
    cfg = job_config(minilm_path, sample_corpus, tmp_path / "out-minilm", **custom)
    before = ray.is_initialized()  # a session's shared Ray may be up; a job refused here starts none
    with pytest.raises(ConfigError, match=r"\['next_token_nll'\] read the LM head's logits, and model .* is not a causal"):
        run_job(cfg)
    assert ray.is_initialized() == before
