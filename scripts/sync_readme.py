"""Rewrite README.md's configuration references from the config dataclasses (tests check they are current)."""

from pathlib import Path

from actlake.jobs.reference import reference_blocks

readme = Path(__file__).resolve().parents[1] / "README.md"
text = readme.read_text()
for marker, markdown in reference_blocks().items():
    head, rest = text.split(f"<!-- {marker}:start -->")
    _, tail = rest.split(f"<!-- {marker}:end -->")
    text = f"{head}<!-- {marker}:start -->\n{markdown}\n<!-- {marker}:end -->{tail}"
readme.write_text(text)
print(f"updated {readme}")
