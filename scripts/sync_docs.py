"""Rewrite docs/configuration.md's references from the config classes, docs/sql-schema.md's tables and views from
the producers' declarations and docs/api.md from the docstrings (tests/unit/test_docs.py checks all are current)."""

from pathlib import Path

from actlake.jobs.api_reference import api_page
from actlake.jobs.reference import reference_blocks, sql_schema_blocks

docs = Path(__file__).resolve().parents[1] / "docs"
for page, blocks in ((docs / "configuration.md", reference_blocks()), (docs / "sql-schema.md", sql_schema_blocks())):
    text = page.read_text()
    for marker, markdown in blocks.items():
        head, rest = text.split(f"<!-- {marker}:start -->")
        _, tail = rest.split(f"<!-- {marker}:end -->")
        text = f"{head}<!-- {marker}:start -->\n{markdown}\n<!-- {marker}:end -->{tail}"
    page.write_text(text)
    print(f"updated {page}")
api = docs / "api.md"
api.write_text(api_page())
print(f"updated {api}")
