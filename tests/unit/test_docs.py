"""The README is a door and the docs the house: the README stays short, the site builds strictly (so a
broken link fails), every command block is run by a test or says why not, and the config reference and the SQL
schema's tables and views are generated from the code."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import torch

from actlake.analysis.protocol import Analysis, ModelSpec
from actlake.analysis.registry import builtin_producers
from actlake.jobs.reference import reference_blocks, sql_schema_blocks
from tests.documented import ROOT, blocks

CONFIG_PAGE = ROOT / "docs" / "configuration.md"
SQL_PAGE = ROOT / "docs" / "sql-schema.md"


def test_the_readme_is_a_door():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    assert "bash scripts/quickstart.sh" in text and "bash scripts/test.sh" in text and "](METHODS.md)" in text
    assert "bash scripts/test.sh" in (ROOT / ".ci" / "run").read_text()
    for link in re.findall(r"\]\((docs/[^)#]+)", text):
        assert (ROOT / link).is_file(), link


def test_the_site_builds_strictly(tmp_path):
    mkdocs = Path(sys.executable).with_name("mkdocs")
    done = subprocess.run([str(mkdocs), "build", "--strict", "-d", str(tmp_path / "site")], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    for name in ("add_layer", "add_hidden", "collect_read", "token_keys", "weights", "ModelSpec"):
        assert name in api, name


def test_the_api_reference_is_current_and_readable_unbuilt():
    """docs/api.md is Markdown generated from the docstrings (a reader on GitHub sees it whole): current, no
    Sphinx role left raw, and the attributes a custom analysis reads listed with their shapes."""
    from actlake.jobs.api_reference import api_page

    text = (ROOT / "docs" / "api.md").read_text()
    assert text == api_page(), "docs/api.md is stale: run python scripts/sync_docs.py"
    assert ":::" not in text and not re.search(r":(class|meth|func|data|attr|mod|param|returns?):", text)
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `(\w+)`(?: \(property\))? \| `[^`]*` \| (.*) \|$",
                                                      text, re.M)}
    for name, shape in (("layer", ""), ("query", "(B, H, T, d_h)"), ("valid", "(B, T)"), ("n_heads", "H"),
                        ("query_onehot", "(B, T, C)"), ("key_onehot", "(B, T, C)"), ("surprisal", "(B, T)")):
        assert name in rows and rows[name] and shape in rows[name], (name, rows.get(name))
    anchors = set(re.findall(r'<a id="([\w.]+)"></a>', text))
    for page in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        for target in re.findall(r"api\.md#([\w.]+)", page.read_text()):
            assert target in anchors, f"{page.name} links to api.md#{target}, which is not there"


def test_every_command_block_is_run_by_a_test_or_says_why_not():
    found = blocks()  # raises naming a block without a mark
    idents = {i for *_, i in found if i}
    assert {"quickstart", "activate-and-query", "tour-sql", "tour-try"} <= idents
    tests = "\n".join(p.read_text() for p in (ROOT / "tests").rglob("test_*.py"))
    for ident in idents:
        assert f'command("{ident}")' in tests, f"no test runs the documented command {ident!r}"


def test_config_references_are_current():
    text = CONFIG_PAGE.read_text()
    for marker, markdown in reference_blocks().items():
        assert f"<!-- {marker}:start -->" in text, f"{CONFIG_PAGE} lacks the {marker} block"
        block = text.split(f"<!-- {marker}:start -->")[1].split(f"<!-- {marker}:end -->")[0].strip()
        assert block == markdown.strip(), f"{CONFIG_PAGE.name}: {marker} is stale: run python scripts/sync_docs.py"


def test_the_sql_schema_tables_and_views_are_current():
    text = SQL_PAGE.read_text()
    for marker, markdown in sql_schema_blocks().items():
        assert f"<!-- {marker}:start -->" in text, f"{SQL_PAGE} lacks the {marker} block"
        block = text.split(f"<!-- {marker}:start -->")[1].split(f"<!-- {marker}:end -->")[0].strip()
        assert block == markdown.strip(), f"{SQL_PAGE.name}: {marker} is stale: run python scripts/sync_docs.py"


def _arrow_schema(cls, table: str):
    """The Arrow schema of a built-in producer's table: the one it declares, else the table it writes from nothing
    (an analysis's zero statistics of a tiny model, a shard table of no batches)."""
    if getattr(cls, "schema", None) is not None:
        return cls.schema
    if issubclass(cls, Analysis):
        spec = ModelSpec(n_layers=2, n_heads=2, n_kv_heads=2, d_model=4, max_length=3, device=torch.device("cpu"))
        return cls.create(spec).to_tables()[table].schema
    return cls.to_table([]).schema


def test_every_builtin_table_and_view_is_documented_with_the_columns_it_has():
    """The page cannot drift from the code: each built-in producer documents exactly its tables and views, a
    table's documented columns are the columns of its Arrow schema (``shard`` is the folder's; ``source`` and
    ``intervention`` the engine's, documented by hand), and an analysis's table says it is reduced."""
    for cls in builtin_producers():
        assert set(cls.table_docs) == set(cls.tables), f"{cls.name}: table_docs must document its tables {cls.tables}"
        views = getattr(cls, "views", {})
        assert set(getattr(cls, "view_docs", {})) == set(views), f"{cls.name}: view_docs must document {set(views)}"
        for table in cls.tables:
            reduced = "(reduced" in cls.table_docs[table].rows  # the page's prose names the reduced tables so
            assert reduced == issubclass(cls, Analysis), f"{cls.name}: say '(reduced' in {table}'s rows iff it is"
            have, documented = set(_arrow_schema(cls, table).names), set(cls.table_docs[table].columns)
            assert documented == have, (f"{cls.name}: table {table!r}: documented but not in its schema: "
                                        f"{sorted(documented - have)}; in its schema, not documented: "
                                        f"{sorted(have - documented)}")


def test_methods_is_in_the_repository_and_cited_there():
    assert (ROOT / "METHODS.md").is_file()
    outside = "../shared/"  # the seeds and the original METHODS.md live outside the repository
    for path in [ROOT / "README.md", ROOT / "METHODS.md", *(ROOT / "docs").glob("*.md")]:
        assert outside not in path.read_text(), f"{path} points outside the repository"
    for folder in ("actlake", "jobs", "analysis", "storage", "scripts", "tests"):
        for path in (ROOT / folder).rglob("*.py"):
            assert outside + "METHODS" not in path.read_text(), f"{path} cites a file outside the repository"
