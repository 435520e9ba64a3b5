"""A custom analysis written against 0.1.0's names still runs, each old name warning once (issue 53): the modules
that moved into ``actlake.analysis.engine`` and ``reads`` (now ``sites`` and ``products``)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from actlake.analysis import MOVED

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]

OLD_EXAMPLE = textwrap.dedent('''
    """0.1.0's README example, as it was written then (configs/attention_entropy.py at 0.1.0)."""
    from dataclasses import dataclass

    import torch

    from actlake.analysis import grid
    from actlake.analysis.stats import SumStats, np64, tensor, zeros
    from actlake.categories import ROLE


    @dataclass
    class AttentionEntropy(SumStats):
        name, reads, tables = "attention_entropy", frozenset({"attention"}), ("attention_entropy",)
        entropy: torch.Tensor  # (L, H, C)
        n_queries: torch.Tensor  # (L, C)

        @classmethod
        def create(cls, spec, **options) -> "AttentionEntropy":
            return cls(zeros(spec.n_layers, spec.n_heads, len(ROLE), device=spec.device),
                       zeros(spec.n_layers, len(ROLE), device=spec.device))

        def add_layer(self, lq) -> None:
            w = lq.weights()
            entropy = -(w * torch.log(w.clamp(min=1e-30))).sum(-1)
            self.entropy[lq.layer] += torch.einsum("bht,btc->hc", entropy.double(), lq.query_onehot)
            self.n_queries[lq.layer] += lq.query_onehot.sum((0, 1))

        AXES = [("layer", 0), ("head", 0), ("query_category", ROLE)]

        def to_tables(self) -> dict:
            L, H, _ = self.entropy.shape
            axes = [("layer", L), ("head", H), ("query_category", ROLE)]
            values = {"entropy_sum": np64(self.entropy), "n_queries": np64(self.n_queries)[:, None].repeat(H, 1)}
            return {"attention_entropy": grid.to_arrow(axes, values)}

        @classmethod
        def from_tables(cls, tables: dict) -> "AttentionEntropy":
            v = grid.from_arrow(tables["attention_entropy"], cls.AXES, {"entropy_sum": 3, "n_queries": 3})
            return cls(tensor(v["entropy_sum"]), tensor(v["n_queries"][:, 0]))
''')


def test_every_moved_module_imports_as_the_engine_s_own_with_a_warning():
    """In a fresh interpreter (this one may have imported them): each old name is the new module object, and
    warns once, naming both."""
    script = textwrap.dedent(f'''
        import importlib, warnings
        from actlake.deprecation import ActlakeDeprecationWarning
        moved = {dict(MOVED)!r}
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for old, new in moved.items():
                assert importlib.import_module("actlake.analysis." + old) is importlib.import_module(new), old
                assert importlib.import_module(new).__spec__.name == new
        messages = [str(w.message) for w in seen if w.category is ActlakeDeprecationWarning]
        assert messages == [f"actlake.analysis.{{o}} moved to {{n}}; the old name goes in the release after 0.2.0"
                            for o, n in moved.items()], messages
        print("ok")
    ''')
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_a_0_1_0_analysis_runs_with_warnings_and_equals_today_s_example(minilm_path, tmp_path):
    """0.1.0's example (``from actlake.analysis import grid``, ``reads``) through try-analysis: the same entropy
    sums, layer by layer, head by head and category by category, as today's example."""
    from actlake.deprecation import ActlakeDeprecationWarning
    from actlake.jobs.extract.try_analysis import try_analysis

    (tmp_path / "old_entropy.py").write_text(OLD_EXAMPLE)
    texts = ["The cat sat on the mat, and then it slept.", "def f(x):\n    return x + 1"]
    with pytest.warns(ActlakeDeprecationWarning, match=r"AttentionEntropy\.reads is deprecated: declare sites = "
                                                         r"\{'attention'\} and products = frozenset\(\)"):
        old = try_analysis("old_entropy:AttentionEntropy", texts, model=minilm_path, path=str(tmp_path / "old_entropy.py"))
    new = try_analysis("attention_entropy:AttentionEntropy", texts, model=minilm_path,
                       path=str(ROOT / "configs" / "attention_entropy.py"))
    key = ("layer", "head", "query_category")
    old_rows = {tuple(r[k] for k in key): r["entropy_sum"] for r in old["attention_entropy"].to_pylist()}
    new_rows = {tuple(r[k] for k in key): r["entropy_sum"] for r in new["attention_entropy"].to_pylist()}
    assert old_rows.keys() == new_rows.keys() and len(old_rows) == 6 * 12 * 5
    assert all(old_rows[k] == pytest.approx(new_rows[k], rel=1e-12, abs=1e-12) for k in new_rows)
    assert sum(new_rows.values()) > 0


def test_the_command_line_shows_an_old_name_in_one_line(minilm_path, tmp_path, capsys):
    """Python hides a DeprecationWarning raised outside ``__main__``; the command line shows actlake's own, one line
    each, and runs on."""
    from actlake.jobs.cli import main

    (tmp_path / "old_entropy_cli.py").write_text(OLD_EXAMPLE)
    assert main(["try-analysis", "old_entropy_cli:AttentionEntropy", "--path", str(tmp_path / "old_entropy_cli.py"),
                 "--model", minilm_path, "--text", "The cat sat on the mat."]) == 0
    err = capsys.readouterr().err.splitlines()
    assert ("actlake: deprecated: AttentionEntropy.reads is deprecated: declare sites = {'attention'} and products = "
            "frozenset(); reads goes in the release after 0.2.0") in err, err
