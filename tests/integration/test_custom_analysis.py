"""Your own analysis from the config: the README's example runs through a real job on real Ray, lands
exactly once, is reduced, and its table equals an independent computation from eager attention weights."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from actlake.categories import ROLE
from actlake.jobs.cli import main
from actlake.storage.sql import query

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "configs" / "attention_entropy.py"


def test_the_readme_shows_the_example_file():
    for page in (ROOT / "README.md", ROOT / "docs" / "writing-an-analysis.md"):
        block = re.search(r'```python title="configs/attention_entropy.py"\n(.*?)```', page.read_text(), re.S)
        assert block and block.group(1) == EXAMPLE.read_text(), page
    assert len(EXAMPLE.read_text().splitlines()) <= 50


def _reference_entropy(model_path, run_dir):
    """Sum of -sum_n alpha log alpha over queries, per (layer, head, query role), window by window."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(model_path, attn_implementation="eager").eval()
    rows = query(run_dir, "SELECT doc_id, window_index, token_id, role FROM tokens ORDER BY doc_id, window_index, position")
    windows: dict = {}
    for doc, win, tid, role in zip(*(rows[c].to_pylist() for c in ("doc_id", "window_index", "token_id", "role"))):
        windows.setdefault((doc, win), []).append((tid, ROLE.index(role)))
    total, count = None, None
    with torch.no_grad():
        for toks in windows.values():
            att = torch.stack(model(input_ids=torch.tensor([[t for t, _ in toks]]), output_attentions=True).attentions)
            att = att[:, 0].double()  # (L, H, T, T)
            entropy = -(att * att.clamp(min=1e-30).log()).sum(-1)  # (L, H, T)
            onehot = torch.nn.functional.one_hot(torch.tensor([r for _, r in toks]), len(ROLE)).double()  # (T, C)
            e, n = torch.einsum("lht,tc->lhc", entropy, onehot).numpy(), onehot.sum(0).numpy()
            total, count = (e, n) if total is None else (total + e, count + n)
    return total, count


VIEW = ("SELECT layer, head, sum(entropy_sum) / sum(n_queries) AS mean_entropy FROM attention_entropy "
        "GROUP BY layer, head")

LAST_NORM = '''
import numpy as np
import pyarrow as pa

from actlake.analysis.engine.device import to_host
from actlake.analysis.protocol import ShardTable


class LastNorm(ShardTable):
    """A per-token table of one's own: the last hidden state's norm of every token."""

    name, tables = "last_norm", ("last_norm",)
    sites = frozenset({"hidden_states"})
    schema = pa.schema([("doc_id", pa.int64()), ("window_index", pa.int32()), ("position", pa.int32()),
                        ("norm", pa.float64())])

    def add_hidden(self, layer, h, batch):
        if layer == self.spec.n_layers:
            self.norm = to_host(h.double().norm(dim=-1))  # (B, T)

    def collect(self, out):
        doc, window, position, _ = out.token_keys()
        self.cols = [doc, window, position, self.norm.numpy()[out.mask.bool().numpy()]]

    @classmethod
    def to_table(cls, parts, **options):
        if not parts:
            return cls.schema.empty_table()
        cols = [np.concatenate([p.cols[i] for p in parts]) for i in range(4)]
        return pa.table(dict(zip(cls.schema.names, cols)), schema=cls.schema)
'''


def test_a_custom_analysis_runs_reduces_and_is_queryable(minilm_path, sample_corpus, tmp_path, ray_local):
    """The README's example, plus a view (a custom class's views were silently dropped: issue 33): the job
    records it, and ``actlake sql`` makes it without importing the class."""
    module = tmp_path / "code" / "entropy_views.py"
    module.parent.mkdir()
    module.write_text(EXAMPLE.read_text() + f"\n\nAttentionEntropy.views = {{**AttentionEntropy.views, 'entropy_by_head': {VIEW!r}}}\n")
    (tmp_path / "code" / "last_norm.py").write_text(LAST_NORM)
    cfg = {"name": "custom", "model": {"name_or_path": minilm_path},
           "corpus": {"paths": [str(sample_corpus / "*.jsonl.zst")], "max_docs": 12},
           "tokenization": {"max_length": 48, "max_windows_per_doc": 2}, "sharding": {"docs_per_shard": 6},
           "batching": {"max_tokens": 512}, "output": {"dir": str(tmp_path / "runs"), "report": False},
           "resources": {"num_workers": 1, "cpus_per_worker": 1},
           "analyses": {"contributions": False, "geometry": False, "attention_by_distance": False,
                        "custom": [{"analysis": "entropy_views:AttentionEntropy", "path": str(module)},
                                   {"analysis": "last_norm:LastNorm", "path": str(module.parent / "last_norm.py")}]}}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["run", str(path), "--run-id", "r"]) == 0
    run = tmp_path / "runs" / "r"
    groups = sorted(json.loads(p.read_text())["group"] for p in (run / "_complete").glob("group-*.json"))
    assert sorted(p.name for p in (run / "tables" / "attention_entropy_partial").iterdir()) == [f"group={g}" for g in groups]
    got = query(run, "SELECT layer, head, query_category, entropy_sum, n_queries FROM attention_entropy")
    want, count = _reference_entropy(minilm_path, run)
    table = np.zeros_like(want)
    n = np.zeros((want.shape[0], len(ROLE)))
    for layer, head, cat, e, q in zip(*(got[c].to_pylist() for c in got.column_names)):
        table[layer, head, ROLE.index(cat)] = e
        n[layer, ROLE.index(cat)] = q
    np.testing.assert_allclose(table, want, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(n, np.broadcast_to(count, n.shape))
    view = query(run, "SELECT layer, head, mean_entropy FROM entropy_by_head ORDER BY layer, head")
    per_head = want.sum(2) / count.sum()  # every query has one category: n_queries summed over categories
    np.testing.assert_allclose(np.array(view["mean_entropy"].to_pylist()).reshape(per_head.shape), per_head, rtol=1e-4)
    # the per-token table of one's own, against the built-in residual norms of the last layer
    mine = query(run, "SELECT doc_id, window_index, position, norm FROM last_norm ORDER BY 1, 2, 3")
    builtin = query(run, "SELECT doc_id, window_index, position, norm FROM residual_norms "
                         "WHERE layer = (SELECT max(layer) FROM residual_norms) ORDER BY 1, 2, 3")
    assert mine.num_rows == builtin.num_rows == query(run, "SELECT count(*) AS n FROM tokens")["n"][0].as_py()
    for col in ("doc_id", "window_index", "position"):
        assert mine[col].to_pylist() == builtin[col].to_pylist()
    np.testing.assert_allclose(mine["norm"].to_numpy(), builtin["norm"].to_numpy(), rtol=1e-9)
    # docs/writing-an-analysis.md's query of the example's view, as printed (RUN: this run's folder)
    import subprocess
    import sys

    from tests.documented import command

    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '/usr/bin:/bin')}")
    shown = subprocess.run(["bash", "-c", command("custom-sql").replace("runs/RUN", str(run))], env=env,
                           capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0 and "mean_entropy" in shown.stdout and shown.stdout.count("│") > 20, shown.stderr
    assert main(["run", str(path), "--run-id", "r"]) == 0  # a rerun skips both shards and reduces again
    again = query(run, "SELECT sum(entropy_sum) AS s FROM attention_entropy")["s"][0].as_py()
    assert again == pytest.approx(float(want.sum()), rel=1e-4)


def test_a_class_that_is_not_an_analysis_is_refused_in_one_line(minilm_path, sample_corpus, tmp_path, capsys):
    cfg = {"name": "bad", "model": {"name_or_path": minilm_path}, "corpus": {"paths": [str(sample_corpus / "*.jsonl.zst")]},
           "output": {"dir": str(tmp_path / "runs")},
           "analyses": {"custom": [{"analysis": "collections:OrderedDict"}]}}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["run", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "analyses.custom[0].analysis" in err[0] and "not a subclass" in err[0]


BUGGY = '''
from dataclasses import dataclass

import torch

from actlake.analysis.protocol import OneTable
from actlake.analysis.stats import SumStats, zeros


@dataclass
class Buggy(OneTable, SumStats):
    name, sites, tables = "buggy", frozenset({"attention"}), ("buggy",)
    total: torch.Tensor

    @classmethod
    def create(cls, spec, **options):
        return cls(zeros(spec.n_layers, spec.n_heads + 1, device=spec.device))  # one head too many

    def add_layer(self, lq) -> None:
        self.total[lq.layer] += lq.weights().sum((0, 2, 3)).double()
'''


def _buggy(tmp_path, name: str) -> tuple[Path, int]:
    """The buggy analysis as module ``name`` (a name per test: a module imported once stays imported)."""
    module = tmp_path / "code" / f"{name}.py"
    module.parent.mkdir(exist_ok=True)
    module.write_text(BUGGY)
    line = BUGGY.splitlines().index("        self.total[lq.layer] += lq.weights().sum((0, 2, 3)).double()") + 1
    return module, line


def test_an_analysis_that_raises_is_named_with_its_file_line_and_method_in_a_job(minilm_path, sample_corpus, tmp_path,
                                                                                ray_local, capsys):
    """Issue 33: a bug in an analysis gave one line with no analysis name, file or line. The job stops at its
    first failure (every shard would fail alike) with the line, and the whole traceback in the file it names."""
    module, line = _buggy(tmp_path, "buggy_in_a_job")
    cfg = {"name": "buggy", "model": {"name_or_path": minilm_path},
           "corpus": {"paths": [str(sample_corpus / "*.jsonl.zst")], "max_docs": 6},
           "tokenization": {"max_length": 32}, "output": {"dir": str(tmp_path / "runs"), "report": False},
           "resources": {"num_workers": 1, "cpus_per_worker": 1},
           "analyses": {"contributions": False, "geometry": False, "attention_by_distance": False,
                        "custom": [{"analysis": "buggy_in_a_job:Buggy", "path": str(module)}]}}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["run", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"actlake: error: analysis 'buggy' failed at {module}:{line} in add_layer: RuntimeError: "
                          "The size of tensor a (13) must match the size of tensor b (12)"), err
    log = Path(err.rsplit("; traceback in ", 1)[1])
    assert f'File "{module}", line {line}, in add_layer' in log.read_text()


def test_try_analysis_runs_one_analysis_in_process_and_names_a_failure(minilm_path, tmp_path, capsys):
    """``actlake try-analysis``: the example on two texts, in this process, equal to eager attention's
    entropies; the buggy one is the same one line as in a job."""
    from actlake.jobs.extract.try_analysis import try_analysis

    texts = ["The cat sat on the mat, and then it slept.", "def f(x):\n    return x + 1"]
    tables = try_analysis("attention_entropy:AttentionEntropy", texts, model=minilm_path, path=str(EXAMPLE))
    assert set(tables) == {"attention_entropy", "attention_entropy_mean"}
    got = tables["attention_entropy"]
    from transformers import AutoModel, AutoTokenizer

    tok, model = AutoTokenizer.from_pretrained(minilm_path), AutoModel.from_pretrained(minilm_path, attn_implementation="eager")
    want = 0.0
    with torch.no_grad():
        for text in texts:
            att = torch.stack(model(**tok(text, return_tensors="pt"), output_attentions=True).attentions)[:, 0].double()
            want += float(-(att * att.clamp(min=1e-30).log()).sum())
    assert sum(got["entropy_sum"].to_pylist()) == pytest.approx(want, rel=1e-5)
    module, line = _buggy(tmp_path, "buggy_tried")
    assert main(["try-analysis", "buggy_tried:Buggy", "--path", str(module), "--model", minilm_path, "--text", texts[0]]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"actlake: error: analysis 'buggy' failed at {module}:{line} in add_layer: RuntimeError:"), err
    assert main(["try-analysis", "attention_mass", "--model", minilm_path, "--text", texts[0], "--rows", "2"]) == 0
    assert "attention_mass_by_key:" in capsys.readouterr().out


def _with_view(tmp_path: Path, module_name: str, view: str, sql: str) -> Path:
    """The README's example saved as ``module_name`` with one more view."""
    module = tmp_path / f"{module_name}.py"
    module.write_text(EXAMPLE.read_text() + f"\n\nAttentionEntropy.views = {{**AttentionEntropy.views, {view!r}: {sql!r}}}\n")
    return module


def _job(minilm_path, sample_corpus, tmp_path, target: str, module: Path) -> Path:
    cfg = {"name": "views", "model": {"name_or_path": minilm_path},
           "corpus": {"paths": [str(sample_corpus / "*.jsonl.zst")], "max_docs": 8},
           "tokenization": {"max_length": 32}, "sharding": {"docs_per_shard": 2},
           "output": {"dir": str(tmp_path / "runs"), "report": False},
           "resources": {"num_workers": 1, "cpus_per_worker": 1},
           "analyses": {"contributions": False, "geometry": False, "attention_by_distance": False,
                        "custom": [{"analysis": target, "path": str(module)}]}}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_a_custom_view_named_like_a_builtin_one_is_refused_before_anything_runs(minilm_path, sample_corpus, tmp_path,
                                                                               capsys):
    """Issue 50: a custom view ``outliers`` replaced dim_moments' own silently."""
    module = _with_view(tmp_path, "shadowing", "outliers", "SELECT layer FROM attention_entropy")
    assert main(["run", str(_job(minilm_path, sample_corpus, tmp_path, "shadowing:AttentionEntropy", module))]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == ("actlake: error: analyses: 'attention_entropy' declares a view 'outliers', the name of "
                   "'dim_moments''s view; rename the view"), err
    assert not (tmp_path / "runs").exists()


def test_a_custom_view_that_does_not_run_stops_the_job_at_its_first_shard(minilm_path, sample_corpus, tmp_path,
                                                                          ray_local, capsys):
    """Issue 50: a typo in a custom view's SQL ran every shard, then failed with a Binder Error naming neither view
    nor analysis, and every later query of the run failed. Now the first shard runs the views, nothing commits,
    and the error names both; try-analysis names them too (it crashed in its own error handler)."""
    module = _with_view(tmp_path, "typo_view", "entropy_typo", "SELECT layr, sum(n_queries) FROM attention_entropy GROUP BY 1")
    assert main(["run", str(_job(minilm_path, sample_corpus, tmp_path, "typo_view:AttentionEntropy", module)),
                 "--run-id", "typo"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("actlake: error: analysis 'attention_entropy': its view 'entropy_typo' does not run over its "
                          "tables (BinderException: Binder Error: Referenced column \"layr\" not found"), err
    assert not list((tmp_path / "runs" / "typo" / "_complete").glob("group-*.json"))
    assert main(["try-analysis", "typo_view:AttentionEntropy", "--path", str(module), "--model", minilm_path,
                 "--text", "The cat sat on the mat."]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("actlake: error: analysis 'attention_entropy': its view 'entropy_typo' does not run"), err


def test_a_recorded_view_that_does_not_run_leaves_the_other_tables_queryable(minilm_path, sample_corpus, tmp_path,
                                                                           ray_local, capsys):
    """A run folder whose record holds a view that does not run (written by hand, or by a view that ran on the
    first shard only) is still a run: the view is left out, named, and everything else answers."""
    module = _with_view(tmp_path, "fine_view", "entropy_layers", "SELECT DISTINCT layer FROM attention_entropy")
    assert main(["run", str(_job(minilm_path, sample_corpus, tmp_path, "fine_view:AttentionEntropy", module)),
                 "--run-id", "ok"]) == 0
    run = tmp_path / "runs" / "ok"
    record_path = run / "_complete" / "reduced.json"
    record = json.loads(record_path.read_text())
    record["views"]["entropy_layers"]["sql"] = "SELECT layr FROM attention_entropy"
    record_path.write_text(json.dumps(record))
    capsys.readouterr()
    assert main(["sql", str(run), "SELECT count(*) AS n FROM attention_mass", "--format", "csv"]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines()[0] == '"n"' and int(out.splitlines()[1]) > 0
    assert "entropy_layers: not offered, the recorded view does not run" in err
    assert main(["sql", str(run), "SELECT * FROM outliers LIMIT 1", "--format", "csv"]) == 0


@pytest.mark.parametrize("view,sql,message", [
    ("two_statements", "SELECT 1 AS a; SELECT 2 AS b",
     "analysis 'attention_entropy': its view 'two_statements' is not one SELECT"),
    ("checkpoints", "SELECT 1 AS a", "analyses: 'attention_entropy' declares a view 'checkpoints', a name actlake "
                                     "keeps for a checkpoint sweep's table"),
])
def test_a_custom_view_that_sql_would_refuse_is_refused_before_anything_runs(view, sql, message, minilm_path,
                                                                             sample_corpus, tmp_path, capsys):
    """A view of two statements ran on the first shard (DuckDB runs the last) and then made every query of the run
    fail; a view named ``checkpoints`` would break a sweep's."""
    module = _with_view(tmp_path, f"refused_{view}", view, sql)
    job = _job(minilm_path, sample_corpus, tmp_path, f"refused_{view}:AttentionEntropy", module)
    assert main(["run", str(job)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"actlake: error: {message}"), err
    assert not (tmp_path / "runs").exists()
