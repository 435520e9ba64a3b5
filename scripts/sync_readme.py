"""Rewrite README.md's configuration reference from the config dataclasses (tests check it is current)."""

from pathlib import Path

from actlake.config import reference_markdown

readme = Path(__file__).resolve().parents[1] / "README.md"
text = readme.read_text()
head, rest = text.split("<!-- config-reference:start -->")
_, tail = rest.split("<!-- config-reference:end -->")
readme.write_text(f"{head}<!-- config-reference:start -->\n{reference_markdown()}\n<!-- config-reference:end -->{tail}")
print(f"updated {readme}")
