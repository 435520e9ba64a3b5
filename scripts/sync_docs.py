"""Rewrite docs/configuration.md's references from the config classes and docs/api.md from the docstrings
(tests/unit/test_docs.py checks both are current)."""

from pathlib import Path

from actlake.jobs.api_reference import api_page
from actlake.jobs.reference import reference_blocks

page = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
text = page.read_text()
for marker, markdown in reference_blocks().items():
    head, rest = text.split(f"<!-- {marker}:start -->")
    _, tail = rest.split(f"<!-- {marker}:end -->")
    text = f"{head}<!-- {marker}:start -->\n{markdown}\n<!-- {marker}:end -->{tail}"
page.write_text(text)
print(f"updated {page}")
api = page.with_name("api.md")
api.write_text(api_page())
print(f"updated {api}")
